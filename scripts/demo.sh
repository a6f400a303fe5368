#!/usr/bin/env bash
# The demo command: set up ./.venv, then run AllGather CP=4 on a tiny Qwen3 with 4 CPU processes
# and compare it with CP=1 within a tolerance (examples/demo_all_gather.py; its options pass
# through, e.g. --seq-len 128). It runs in the current folder (the dump goes to ./cp_dump). When
# the tolerance is not met it exits with status 1 after one `FAIL:` line, without torchrun's
# report of the failed ranks (kept in a log file it names).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bash "$repo/scripts/setup_venv.sh"
export OMP_NUM_THREADS=1
log=$(mktemp "${TMPDIR:-/tmp}/cpcompile_demo.XXXXXX")
status=0
"$repo/.venv/bin/torchrun" --standalone --nproc-per-node 4 "$repo/examples/demo_all_gather.py" "$@" 2>"$log" || status=$?
if [ "$status" -eq 0 ]; then
  cat "$log" >&2
  rm -f "$log"
  exit 0
fi
if grep -q '^FAIL: ' "$log"; then
  grep '^FAIL: ' "$log" >&2
else  # a crash, not a verdict: show its end
  tail -n 40 "$log" >&2
fi
echo "(every rank's output and torchrun's report: $log)" >&2
exit "$status"
