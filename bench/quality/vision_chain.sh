#!/usr/bin/env bash
# The vision benches of issues 43-44 in order, resumable (each bench skips the rows it has): the models page, CORP's
# accuracy tables, Torch-Pruning's rows, the speed table, and the backbones' feature rows once they are trained.
# One torch thread each (the training script may run beside them); every row records its threads and load.
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
$PY bench/quality/vision_models.py
$PY bench/quality/corp_vit.py --groups t2,t3,f5
$PY bench/quality/torch_pruning_vit.py --sparsities 0.5
$PY bench/quality/corp_vit.py --groups t5 --threads 1
$PY bench/quality/corp_vit.py --groups t8,fam
$PY bench/quality/corp_vit.py --groups f2,f3          # the sweeps, headline sparsity first (PRIORITY)
$PY bench/quality/torch_pruning_vit.py
$PY bench/quality/vision_models.py                    # the models trained since (dense rows)
$PY bench/speed/corp_vit_speed.py --threads 1             # speed targets: prune vs forward, width crossover
