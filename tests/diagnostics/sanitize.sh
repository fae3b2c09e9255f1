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
# initcheck does not count the TMA unit's stores (cp.async.bulk.tensor) as initialising global
# memory: after the Hopper forward stores O that way, the backward's preprocess kernel reading O
# is reported as an uninitialised read (runs 130-131 of docs/performance-log.md: 256 reports a
# launch, all there; 0 with O stored from the registers). So initcheck runs on the build that
# stores O from the registers (FC_DIAG_O_STG), every other kernel as it is; memcheck, racecheck
# and synccheck run on the default build.
for tool in memcheck racecheck synccheck initcheck; do
  extra=""
  defines=${FLASHCORE_SM90_DEFINES:-}
  [ $tool = memcheck ] && extra="--leak-check no"
  [ $tool = racecheck ] && extra="--racecheck-report all"
  if [ $tool = initcheck ]; then
    defines="$defines -DFC_DIAG_O_STG"
    FLASHCORE_SM90_DEFINES="$defines" python3 tests/diagnostics/sanitize_driver.py > /dev/null || exit 1
  fi
  FLASHCORE_SM90_DEFINES="$defines" "$cs" --tool $tool $extra --error-exitcode 99 \
      --target-processes all --show-backtrace no \
      python3 tests/diagnostics/sanitize_driver.py >"$out/sanitize_$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.log" | tail -1)
  echo "sanitize $tool: rc $rc; ${summary:-no summary line}"
  # where the reports came from: counts by the driver's section and kernel
  [ $rc -eq 0 ] || { fail=1; python3 tests/diagnostics/sanitize_summary.py "$out/sanitize_$tool.log" | head -20; }
done
exit $fail
