#!/usr/bin/env bash
# CoCurve's full protocol on SmolLM2-135M on one GPU (issue 18 §3): the 128 x 2048 graph sweep, the held-out
# lambda choice (16 x 2048) and the 30% row (CoCurve; held-out KL on an independent 16 x 2048 test split;
# perplexity on every 2048/512 window of WikiText-2, C4, PTB, with the dense row), for a lent single-H200 machine
# without network (torch + CUDA, transformers preinstalled; gguf travels as a wheel). Preset `full` of
# bench/quality/cocurve_smollm2.py, run with --device cuda --ranks 1.
#
# Estimate: 494 ablated units x 128 sequences = 63,232 ablations of ~0.415 dense forwards (results/speed/cocurve-sweep-
# cost.md) of 2048 tokens = ~26,200 dense forwards = ~54 M dense forward-tokens; SmolLM2-135M costs ~0.3 GFLOP
# per token at 2048 context (weights + attention), so ~1.6e16 FLOP: ~4.5 minutes in float32 at 60 TFLOP/s,
# ~9 at 30 (H200 float32 peak ~67; not measured yet), about a minute in TF32. The dense passes, the lambda path
# (22 candidates x 32k held-out tokens) and 2 x 1,273 perplexity windows (dense and 30%) add about a minute.
# The run starts with a probe (the sweep of the first sequence, timed and scaled to 128 sequences): when the
# float32 projection exceeds BUDGET_S (default 330 s) it stops before the sweep (exit 3) and, unless TF32 or
# AUTO_TF32=0 is set, reruns at once with float32 products in TF32 (COCURVE_TF32=1: faster, less exact; the
# graph's metadata and the rows record the precision). TF32=1 asks for TF32 from the start. Both runs together
# are capped at 480 s (TIME_LIMIT_S).
#
# The SmolLM2 GGUF (98 MB) exceeds one call's 64 MiB carry, so it travels in two halves over two calls on the
# same warm machine (ignored paths already there are kept between calls; a machine stays warm ~30 s):
#   here:     bash bench/quality/device_cocurve_full.sh prepare   # .devcarry/a: GGUF half 1 + gguf wheel;
#                                                          # .devcarry/b: GGUF half 2, its sha256, token file
#   device 1: carry [".devcarry/a"], command `bash bench/quality/device_cocurve_full.sh receive`     (seconds)
#   device 2: carry [".devcarry/b"], command `bash bench/quality/device_cocurve_full.sh`, timeout_s 560, at once after 1
# `prepare` needs the corpora and the smollm2-135m alias here (the token file is `--stage pack` of the full preset;
# the wheels (gguf, pydantic) come from `pip download` at the installed versions). Results go to $OUT (else results/text/): the rows
# (cocurve-smollm2.jsonl, preset full), the rendered page cocurve-smollm2-full.md + plot, the graph's summary
# json, the probe, graph-full.npz, the chosen mask and the log (8 files). Back here: append the rows to
# results/text/cocurve-smollm2.jsonl, put graph-full.npz in bench/_work/cocurve-smollm2/, then
# `python bench/quality/cocurve_smollm2.py --render`.
#
# Proven end to end on the CPU at a tiny size: `TINY=1 DEVICE=cpu bash bench/quality/device_cocurve_full.sh` runs the same
# python commands (probe, graph, rows, render) on a seeded random 16-layer Llama and random token ids (preset
# `tiny`, made by `--stage tiny-setup`), writing to $OUT or bench/_work/cocurve-device-tiny/.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode="${1:-run}"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
stage=/tmp/cocurve-device  # on the device machine: the reassembled model, its dequantized cache, the exports

case "$mode" in
prepare)
  export PYTHONPATH="${PYTHONPATH:-}:src"
  mkdir -p .devcarry/a/whl .devcarry/b
  src_gguf=$("$py" -c "from secateur.models.loading import gguf_file; print(gguf_file('smollm2-135m'))")
  size=$(stat -c %s "$src_gguf")
  half=$(( (size + 1) / 2 ))
  head -c "$half" "$src_gguf" >.devcarry/a/model.gguf.part1
  tail -c +"$((half + 1))" "$src_gguf" >.devcarry/b/model.gguf.part2
  sha256sum <"$src_gguf" | cut -d' ' -f1 >.devcarry/b/model.gguf.sha256
  sha256sum <.devcarry/a/model.gguf.part1 | cut -d' ' -f1 >.devcarry/b/model.gguf.part1.sha256
  # the packages secateur imports that the device image lacks (gguf; pydantic and its three parts), at this
  # venv's versions, built for the image's Python 3.12 on x86-64
  pins=$("$py" -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in
         ('gguf', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection')))")
  # shellcheck disable=SC2086
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d .devcarry/a/whl $pins
  "$py" bench/quality/cocurve_smollm2.py --preset full --stage pack --inputs .devcarry/b/inputs-full.pt
  du -sh .devcarry/a .devcarry/b
  ;;
receive)
  ls -la .devcarry/a
  sha256sum <.devcarry/a/model.gguf.part1 | cut -d' ' -f1
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .devcarry/a/whl/*.whl
  echo "part 1 received; run the second call now (the machine stays warm ~30 s)"
  ;;
run)
  device="${DEVICE:-cuda}"
  if [ -n "${TINY:-}" ]; then
    out="${OUT:-bench/_work/cocurve-device-tiny}"
    work="bench/_work/cocurve-device-tiny/work"
    export PYTHONPATH="${PYTHONPATH:-}:src"
    mkdir -p "$out" "$work"
    "$py" bench/quality/cocurve_smollm2.py --stage tiny-setup --work "$work"
    preset=tiny model="$work/tiny-model" inputs="$work/inputs-tiny.pt"
  else
    out="${OUT:-results/text}"
    work="$stage/work"
    mkdir -p "$out" "$work"
    want=$(cat .devcarry/b/model.gguf.sha256)
    if [ ! -f .devcarry/a/model.gguf.part1 ]; then
      echo "part 1 of the GGUF is missing: run the 'receive' call first, on the same warm machine" >&2
      ls -la .devcarry .devcarry/* >&2 || true
      exit 2
    fi
    cat .devcarry/a/model.gguf.part1 .devcarry/b/model.gguf.part2 >"$stage/$gguf_name"
    got=$(sha256sum <"$stage/$gguf_name" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "GGUF sha256 $got != $want" >&2; exit 2; }
    if [ ! -d /tmp/site/gguf ]; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .devcarry/a/whl/*.whl
    fi
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}:src" SECATEUR_CACHE="$stage/cache"
    preset=full model="$stage/$gguf_name" inputs=.devcarry/b/inputs-full.pt
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  fi
  common=(--preset "$preset" --device "$device" --model "$model" --inputs "$inputs" --results "$out" --work "$work"
          --ranks 1 --stage probe,graph,rows --rhos 0.3 --methods cocurve --render)
  log="$out/cocurve-device-$preset.log"
  limit="${TIME_LIMIT_S:-480}"
  start=$SECONDS
  set +e -o pipefail
  COCURVE_TF32="${TF32:-0}" timeout "$limit" "$py" bench/quality/cocurve_smollm2.py "${common[@]}" \
    --budget-s "${BUDGET_S:-330}" 2>&1 | tee "$log"
  rc=$?
  if [ "$rc" = 3 ] && [ -z "${TF32:-}" ] && [ "${AUTO_TF32:-1}" = 1 ]; then
    echo "float32 projection over budget: rerunning with TF32 float32 products" | tee -a "$log"
    COCURVE_TF32=1 timeout "$((limit - (SECONDS - start)))" "$py" bench/quality/cocurve_smollm2.py "${common[@]}" \
      2>&1 | tee -a "$log"
    rc=$?
  fi
  set -e
  [ "$rc" = 0 ] || { echo "cocurve run failed (exit $rc)" >&2; ls -la "$out" >&2; exit "$rc"; }
  rm -f "$out"/*.lock  # the row files' lock: at most 8 files come back from $OUT
  cp "$work/graph-$preset.npz" "$out/"
  cp "$work/out-$preset-cocurve-30/cocurve_mask.pt" "$out/cocurve_mask-$preset-30.pt"
  ls -la "$out"
  ;;
*)
  echo "usage: bash bench/quality/device_cocurve_full.sh [prepare|receive|run]" >&2
  exit 64
  ;;
esac
