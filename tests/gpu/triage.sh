#!/usr/bin/env bash
# One device call (under 10 minutes on the H200) that checks and measures work written since
# the last GPU run: the GPU test suite (Hopper kernels included), a fault locator for the
# Hopper forward, the torch per-call cost breakdown, the benchmark with and without the Hopper
# kernels (same run, peers included), and decoding. $OUT receives two files (the device tool
# returns at most 8): summary.txt and logs.tgz with every log.
#     bash tests/gpu/triage.sh
set -uo pipefail
final=${OUT:-triage-out}
out=$(mktemp -d)
mkdir -p "$final"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }

FLASHCORE_TEST_WORKERS=${FLASHCORE_TEST_WORKERS:-12} GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-240} \
  OUT="$out/tests" bash tests/gpu/check.sh tests > "$out/tests.txt" 2>&1
echo "tests done at $(elapsed) s" >> "$out/times.txt"
timeout 60 python3 tests/gpu/probe_sm90.py > "$out/probe_sm90.txt" 2>&1
timeout 60 python3 tests/gpu/overhead_breakdown.py 500 > "$out/overhead.txt" 2>&1
echo "probe/overhead done at $(elapsed) s" >> "$out/times.txt"
for variant in ampere v0 v1; do
  args=(--seqlen 1024 4096 16384 --headdim 64 128)
  env=()
  if [ "$variant" != ampere ]; then args+=(--sm90 "$variant"); env=(FLASHCORE_SM90_BWD=1); fi
  env "${env[@]}" timeout 100 python3 -m flashcore.bench "${args[@]}" \
      --json "$out/bench_$variant.json" > "$out/bench_$variant.txt" 2>&1
done
echo "bench done at $(elapsed) s" >> "$out/times.txt"
timeout 80 python3 tests/gpu/bench_decode.py > "$out/decode.txt" 2>&1
echo "decode done at $(elapsed) s" >> "$out/times.txt"

{
  echo "== tests";    grep -E "SUMMARY|FAILED|ERROR" "$out/tests.txt" | tail -15
  echo "== probe";    cat "$out/probe_sm90.txt" | tail -8
  echo "== overhead"; cat "$out/overhead.txt" | tail -16
  for variant in ampere v0 v1; do
    echo "== bench $variant"
    python3 - "$out/bench_$variant.json" <<'PY' 2>/dev/null || echo "(no results)"
import json, math, sys
rows = json.load(open(sys.argv[1]))
for mode in ("fwd", "fwdbwd"):
    for peer in ("sdpa_flash", "sdpa_cudnn"):
        r = [x[f"cupy_{mode}_tflops"] / x[f"{peer}_{mode}_tflops"] for x in rows
             if x.get(f"cupy_{mode}_tflops") and x.get(f"{peer}_{mode}_tflops")]
        if r:
            gm = math.exp(sum(map(math.log, r)) / len(r))
            print(f"{mode:7s} vs {peer}: geomean {gm:.2f}x  min {min(r):.2f}  max {max(r):.2f}")
PY
  done
  echo "== decode";   tail -12 "$out/decode.txt"
  echo "== times";    cat "$out/times.txt"
} | tee "$out/summary.txt"
cp "$out/summary.txt" "$final/summary.txt"
tar czf "$final/logs.tgz" -C "$out" .
