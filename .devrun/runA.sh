#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
o=$OUT; t0=$(date +%s)
timeout 270 python3 -m pytest tests -m gpu -q -rfE -n 8 -p no:cacheprovider --maxfail=30 > $o/tests.log 2>&1
echo "tests rc=$? $(tail -1 $o/tests.log) t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
grep -E "^(FAILED|ERROR)" $o/tests.log | head -20 >> $o/summary.txt
timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_torch_gpu.py -k "bad_index or cuda_graph_decode_in_place" > $o/sanitizer.log 2>&1
echo "sanitizer rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' $o/sanitizer.log | tail -3 | tr '\n' ' ') t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
timeout 60 python3 tests/gpu/bench_callpath.py profile > $o/profile.log 2>&1
echo "profile rc=$? t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
cat $o/summary.txt
