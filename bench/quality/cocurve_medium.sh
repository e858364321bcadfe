#!/usr/bin/env bash
# Issue 26: CoCurve's medium rows on SmolLM2-135M, resumable end to end. Run it again after a stop: the sweep
# continues from its per-block checkpoint (--resume, bit-identical H) and every finished row is skipped.
#   nohup bench/quality/cocurve_medium.sh > bench/_work/cocurve-medium.log 2>&1 &
# Two lanes after the graph (one per rho, one process of 1 thread each: the machine's 2 cores), then render.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
B="nice -n 5 $PY bench/quality/cocurve_smollm2.py --preset medium"
echo "start $(date -u +%FT%TZ) $(git describe --always --dirty) load $(cut -d' ' -f1-3 /proc/loadavg)"
[ -f results/text/cocurve-smollm2-medium-plan.json ] || $B --dry-run | tail -1
[ -f bench/_work/cocurve-smollm2/graph-medium.npz ] || $B --stage graph --ranks 2 --resume
echo "graph done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
( $B --stage rows --rhos 0.3 && $B --stage coec --rhos 0.3 --zs && $B --stage zs --rhos 0.3 ) &
lane30=$!
( $B --stage rows --rhos 0.2 --no-dense && $B --stage coec --rhos 0.2 ) &
lane20=$!
wait $lane30 $lane20
$B --render
echo "end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
