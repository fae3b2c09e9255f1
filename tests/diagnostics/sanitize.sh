#!/usr/bin/env bash
# compute-sanitizer over every kernel (tests/diagnostics/sanitize_driver.py): memcheck, racecheck,
# synccheck, initcheck. Fails on any report. Run from the repository root on a GPU machine.
set -uo pipefail
out=${OUT:-sanitize-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$cs" ] || { echo "compute-sanitizer not found"; exit 2; }
python3 tests/diagnostics/sanitize_driver.py || exit 1          # compile everything outside the tools
fail=0
for tool in memcheck racecheck synccheck initcheck; do
  extra=""
  [ $tool = memcheck ] && extra="--leak-check no"
  [ $tool = racecheck ] && extra="--racecheck-report all"
  "$cs" --tool $tool $extra --error-exitcode 99 --target-processes all \
      python3 tests/diagnostics/sanitize_driver.py >"$out/sanitize_$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.log" | tail -1)
  echo "sanitize $tool: rc $rc; ${summary:-no summary line}"
  [ $rc -eq 0 ] || fail=1
done
exit $fail
