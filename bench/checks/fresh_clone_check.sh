#!/usr/bin/env bash
# The README's test command on a fresh clone of main, as CI runs it: clone, `make test` (venv + install
# from the project's own files + the suite), then record the pytest summary and the machine in
# results/reliability/fresh-clone.json.  Usage: bench/checks/fresh_clone_check.sh [REF]   (default: main)
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
ref="${1:-main}"
# a sibling of the checkout, so ../shared/data (real data, real-model tests) is found as in CI
work="$(mktemp -d "$(dirname "$repo")/fresh-clone-XXXXXX")"
git clone -q --branch "$ref" "$repo" "$work"
commit="$(git -C "$work" rev-parse --short HEAD)"
start=$(date +%s)
(cd "$work" && make test) >"$work.log" 2>&1
rc=$?
secs=$(( $(date +%s) - start ))
summary="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$work.log" | tail -1 | tr -d '=' | xargs)"
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
python3 - "$repo/results/reliability/fresh-clone.json" <<PY
import json, sys
json.dump({"ref": "$ref", "commit": "$commit", "command": "make test", "rc": $rc, "seconds": $secs,
           "summary": "$summary", "cpu": "$cpu", "cores": $(nproc), "date": "$(date -u +%FT%TZ)"},
          open(sys.argv[1], "w"), indent=1)
PY
tail -30 "$work.log"
echo "log: $work.log"
exit $rc
