#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
o=$OUT; t0=$(date +%s)
timeout ${TB:-330} python3 tests/gpu/bench_callpath.py ${SECTIONS:-decode tiny llama generate compile} --json $o/bench.json > $o/bench.log 2>&1
echo "bench rc=$? t=$(( $(date +%s) - t0 ))" >> $o/summary.txt
grep -h "section=\|failed" $o/bench.log | cut -c1-1200 >> $o/summary.txt
cat $o/summary.txt
