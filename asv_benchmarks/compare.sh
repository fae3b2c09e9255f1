#!/usr/bin/env bash
# Benchmark regression check on the GPU machine: runs the asv suite's ratio and wall-clock
# groups on the commit under test (through run_gpu.sh: offline install, results recorded for
# the commit and handed back through $OUT), then compares every figure with the newest
# committed result of the same benchmark and parameters (asv_benchmarks/compare.py), prints
# each change beyond 5%, and exits non-zero on a regression (a figure 5% worse, or one that
# the baseline had and this run lost).
#
# To call it from tests/gpu/check.sh, after the quick benchmark there (one line; its report
# goes to "$out/asv_compare.txt" and into the summary):
#
#     OUT="$out" bash asv_benchmarks/compare.sh > "$out/asv_compare.txt" 2>&1; asv_rc=$?
#     cat "$out/asv/compare.txt"          # the verdict (the log ends with asv's own table)
#
# and count asv_rc != 0 as a failure in its exit status (check.sh does both). Run from anywhere in the checkout:
#
#     bash asv_benchmarks/compare.sh                       # the default groups
#     ASV_COMPARE_GROUPS='DecodeWallClock' bash asv_benchmarks/compare.sh
#     ASV_COMPARE_ONLY=1 bash asv_benchmarks/compare.sh    # no run: compare existing results
#
# Environment:
#   ASV_COMPARE_GROUPS  ';'-separated asv -b regexes, one asv run each (default: the Ratio and
#                       DecodeRatio groups, then DecodeWallClock and TrainStepWallClock; add
#                       'DecodeGraphReplay' for the CUDA-graph decode figures)
#   ASV_COMPARE_FACTOR  the threshold (default 1.05)
#   ASV_COMPARE_ONLY=1  skip the run, compare the results already in results/$ASV_MACHINE
#   ASV_COMMIT, ASV_MACHINE, ASV_WHEELS, ASV_WARM, PYTHON: as for run_gpu.sh (read it)
# Extra arguments go to `asv run` (e.g. --quick).
#
# Exit status: 0 no regression; 1 a regression (or an asv run that failed); 2 no results for
# the commit. The run needs several minutes per group (the Ratio group alone took about 7 on
# the H200, kernel warm-up included): within a 10-minute device call, name fewer groups.
set -uo pipefail
git config --global --add safe.directory '*' 2>/dev/null || true
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
PY=${PYTHON:-python3}
MACHINE=${ASV_MACHINE:-nvidia-h200}
FACTOR=${ASV_COMPARE_FACTOR:-1.05}
GROUPS_DEFAULT='^bench_attention_gpu\.Ratio\.;^bench_decode_gpu\.DecodeRatio\.;^bench_decode_gpu\.DecodeWallClock\.;^bench_attention_gpu\.TrainStepWallClock\.'
BENCH_GROUPS=${ASV_COMPARE_GROUPS:-$GROUPS_DEFAULT}   # (not GROUPS: a bash builtin array)

run_rc=0
if [ "${ASV_COMPARE_ONLY:-0}" != 1 ]; then
  ASV_GROUPS="$BENCH_GROUPS" ASV_MACHINE="$MACHINE" bash asv_benchmarks/run_gpu.sh "$@"
  run_rc=$?
  [ $run_rc = 0 ] || echo "compare.sh: the asv run exited $run_rc (failed benchmarks above)"
fi
# run_gpu.sh may have restored the commit from a bundle: resolve it afterwards
COMMIT=$(git rev-parse "${ASV_COMMIT:-HEAD}^{commit}") || exit 2

# The regexes of the groups, joined, select the benchmarks compared.
bench_re=$(printf %s "$BENCH_GROUPS" | tr ';' '|')
report=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT/asv" && report="$OUT/asv/compare.txt"; fi
"$PY" asv_benchmarks/compare.py --machine "$MACHINE" --commit "$COMMIT" --factor "$FACTOR" \
    --bench "$bench_re" | tee "$report"
cmp_rc=${PIPESTATUS[0]}

# asv's own table, for the record (it takes larger as worse for every benchmark, ratios too,
# and needs the tabulate package: informative only, never the verdict).
SITE=${TMPDIR:-/tmp}/flashcore-asv-site          # where run_gpu.sh installs asv
if ! command -v asv >/dev/null 2>&1 && [ -x "$SITE/bin/asv" ]; then
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
fi
if command -v asv >/dev/null 2>&1; then
  base=$("$PY" - "$MACHINE" "$COMMIT" <<'PY'
import json, os, subprocess, sys
machine, commit = sys.argv[1], sys.argv[2]
d = os.path.join("asv_benchmarks", "results", machine)
files = subprocess.run(["git", "ls-files", d], capture_output=True, text=True).stdout.split()
best = None
for f in files:
    if f.endswith("machine.json") or os.path.basename(f).startswith(commit[:8]):
        continue
    r = json.load(open(f))
    if best is None or r.get("date", 0) > best[0]:
        best = (r.get("date", 0), r.get("commit_hash", ""))
print(best[1] if best else "")
PY
)
  if [ -n "$base" ]; then
    (cd asv_benchmarks && asv compare --machine "$MACHINE" --factor "$FACTOR" --split \
        "$base" "$COMMIT" 2>&1 | head -80) || true
  fi
fi

[ "$cmp_rc" = 2 ] && exit 2
[ "$cmp_rc" != 0 ] && exit 1
[ "$run_rc" != 0 ] && exit 1
exit 0
