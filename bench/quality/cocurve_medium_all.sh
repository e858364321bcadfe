#!/usr/bin/env bash
# Issue 45 §2: CoCurve's medium rows with the graph from every position (preset medium-all), resumable end to end.
# Run it again after a stop: the sweep continues from its per-block checkpoint (--resume, bit-identical H) and every
# finished row is skipped. The work folder (graph, checkpoint, exports) is under the secateur cache so that it
# outlives a checkout:  nohup bench/quality/cocurve_medium_all.sh > bench/_work/cocurve-medium-all.log 2>&1 &
# The finished graph is also committed (results/text/cocurve-smollm2-graph-medium-all.npz, about 3 CPU-hours of
# sweep on 2 cores): when the work folder has none, that copy is used (the rows check its H's sha256 in every row).
# Two lanes after the graph, one process of 1 thread each, the claim check's arms first (the diagonal control, CoCurve,
# the fixed-split arm at 30% in one lane, at 20% then 40% in the other), then the baselines and the dense row; render.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export COCURVE_WORK=${COCURVE_WORK:-${SECATEUR_CACHE:-$HOME/.cache/secateur}/bench-work/cocurve-smollm2}
B="nice -n 5 $PY bench/quality/cocurve_smollm2.py --preset medium-all"
GRAPH="$COCURVE_WORK/graph-medium-all.npz"
KEPT=results/text/cocurve-smollm2-graph-medium-all.npz
ARMS=cocurve-diag,cocurve,cocurve-fixed
echo "start $(date -u +%FT%TZ) $(git describe --always --dirty) load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ ! -f "$GRAPH" ] && [ -f "$KEPT" ]; then mkdir -p "$COCURVE_WORK" && cp "$KEPT" "$GRAPH.tmp" && mv "$GRAPH.tmp" "$GRAPH"; fi
[ -f "$GRAPH" ] || $B --stage graph --ranks 2 --resume
echo "graph done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
( $B --stage rows --rhos 0.3 --methods $ARMS --no-dense && $B --stage rows --rhos 0.3 --methods wanda_sp,flap ) &
lane30=$!
( $B --stage rows --rhos 0.2 --methods $ARMS --no-dense && $B --stage rows --rhos 0.4 --methods $ARMS --no-dense \
  && $B --stage rows --rhos 0.2,0.4 --methods wanda_sp,flap --no-dense ) &
lane24=$!
wait $lane30 $lane24
$B --render
echo "end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"
