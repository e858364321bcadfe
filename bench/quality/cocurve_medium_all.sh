#!/usr/bin/env bash
# Issue 45 §2: CoCurve's medium rows with the graph from every position (preset medium-all), resumable end to end.
# Run it again after a stop: the sweep continues from its per-block checkpoint (--resume, bit-identical H) and every
# finished row is skipped. The work folder (graph, checkpoint, exports) is under the secateur cache so that it
# outlives a checkout:  nohup bench/quality/cocurve_medium_all.sh > bench/_work/cocurve-medium-all.log 2>&1 &
# Two lanes after the graph (30% with the dense row; 20% then 40%), one process of 1 thread each, then render.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export COCURVE_WORK=${COCURVE_WORK:-${SECATEUR_CACHE:-$HOME/.cache/secateur}/bench-work/cocurve-smollm2}
B="nice -n 5 $PY bench/quality/cocurve_smollm2.py --preset medium-all"
echo "start $(date -u +%FT%TZ) $(git describe --always --dirty) load $(cut -d' ' -f1-3 /proc/loadavg)"
[ -f "$COCURVE_WORK/graph-medium-all.npz" ] || $B --stage graph --ranks 2 --resume
echo "graph done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
$B --stage rows --rhos 0.3 &
lane30=$!
( $B --stage rows --rhos 0.2 --no-dense && $B --stage rows --rhos 0.4 --no-dense ) &
lane24=$!
wait $lane30 $lane24
$B --render
echo "end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
