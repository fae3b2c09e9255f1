#!/usr/bin/env bash
# session driver (not committed): GPU tests, then the call-path benchmarks, new and old code
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
o=$OUT; t0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader > $o/summary.txt
timeout ${T1:-230} python3 -m pytest tests/gpu/test_torch_gpu.py tests/gpu/test_decode_gpu.py tests/test_kvcache.py -m gpu -q -rfE -n 8 -p no:cacheprovider --maxfail=30 > $o/tests1.log 2>&1
echo "tests1 rc=$? $(tail -1 $o/tests1.log) t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
timeout ${T2:-150} python3 -m pytest tests -m gpu -q -rfE -n 8 -p no:cacheprovider --maxfail=30 --deselect tests/gpu/test_torch_gpu.py --ignore=tests/gpu/test_torch_gpu.py --ignore=tests/gpu/test_decode_gpu.py --ignore=tests/test_kvcache.py > $o/tests2.log 2>&1
echo "tests2 rc=$? $(tail -1 $o/tests2.log) t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
timeout ${T3:-200} python3 tests/gpu/bench_callpath.py ${SECTIONS:-decode tiny llama generate} --json $o/bench_new.json > $o/bench_new.log 2>&1
echo "bench new rc=$? t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
if [ -n "${OLD:-}" ]; then
  git worktree add -f /tmp/old $OLD > /dev/null 2>&1
  FLASHCORE_TORCH_NATIVE=sync PYTHONPATH=/tmp/old timeout ${T4:-120} python3 tests/gpu/bench_callpath.py tiny llama --json $o/bench_old.json > $o/bench_old.log 2>&1
  echo "bench old rc=$? t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
fi
grep -h "section=" $o/bench_new.log $o/bench_old.log 2>/dev/null | cut -c1-900 >> $o/summary.txt
cat $o/summary.txt
