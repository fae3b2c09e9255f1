#!/usr/bin/env bash
# One device call (under 10 minutes on the H200) that checks and measures work written since
# the last GPU run: the GPU test suite (Hopper kernels included), a fault locator for the
# Hopper forward, the torch per-call cost, the benchmark with and without the Hopper
# kernels (same run, peers included), and decoding. $OUT receives two files (the device tool
# returns at most 8): summary.txt, appended after every step (so a time limit loses only the
# step in flight), and logs.tgz with every log at the end (the candidates' steps also copy
# each command's whole log there as it ends).
# Two device calls (each under 10 minutes):
#     STEPS="tests probe" bash tests/diagnostics/triage.sh       (the default)
#     STEPS="overhead bench decode" bash tests/diagnostics/triage.sh
# Other steps: sanitize (tests/diagnostics/sanitize.sh), profile (cProfile of the per-call host path),
# candidates and candidates2 (timing-only defines against the default build, each step one
# device call of at most 9 minutes with every command under its own limit: candidates the
# Hopper forward's and forward+backward's variants, FWD_VARIANTS / FWDBWD_VARIANTS naming them,
# after the GPU bit tests BITS_K selects; candidates2 dropout, FP8 and the d128 timeline),
# conformance (flash-attn's own test file FA_TEST, the cases of FA_CASES, written beforehand on
# a CPU machine by flash_attn_conformance.py --write-cases), endtoend (bench_callpath.py's
# E2E_SECTIONS, default "llama compile"), decodesweep (sweep_decode.py at batch 1 / 128k, paged
# 256, the split counts of SWEEP_SPLITS) and steptimeline (probe_step_timeline.py).
set -uo pipefail
final=${OUT:-triage-out}
out=$(mktemp -d)
mkdir -p "$final"
sum="$final/summary.txt"
: > "$sum"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${STEPS:-tests probe}
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 )) s] $*" >> "$sum"; }
# (name, limit in s, lines of its output kept in the summary, command): the candidates' steps
cand() {
  local name=$1 limit=$2 lines=$3; shift 3
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  note "$name (rc $?)"; tail -"$lines" "$out/$name.txt" >> "$sum"
  # (the whole log, in case the call's limit cuts the tarball)
  cp "$out/$name.txt" "$final/$name.txt" 2>/dev/null
}

for step in $steps; do
  case $step in
  tests)
    FLASHCORE_TEST_WORKERS=${FLASHCORE_TEST_WORKERS:-12} GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-300} \
      OUT="$out/tests" bash tests/gpu/check.sh tests > "$out/tests.txt" 2>&1
    note "tests"; grep -E "SUMMARY|FAILED|ERROR" "$out/tests.txt" | tail -25 >> "$sum"
    ;;
  probe)
    timeout 200 python3 tests/diagnostics/probe_sm90.py > "$out/probe_sm90.txt" 2>&1
    note "probe_sm90"; tail -16 "$out/probe_sm90.txt" >> "$sum"
    ;;
  overhead)
    timeout 60 python3 -m flashcore.bench --overhead > "$out/overhead.txt" 2>&1
    note "overhead"; tail -16 "$out/overhead.txt" >> "$sum"
    ;;
  bench)
    for variant in ${BENCH_FAMILIES:-ampere v0 v1}; do
      args=(--seqlen ${BENCH_SEQS:-4096 16384} --headdim ${BENCH_DIMS:-64 128} --family "$variant")
      timeout ${BENCH_TIMEOUT:-120} python3 -m flashcore.bench "${args[@]}" \
          --json "$out/bench_$variant.json" > "$out/bench_$variant.txt" 2>&1
      note "bench $variant"
      tail -12 "$out/bench_$variant.txt" >> "$sum"
    done
    ;;
  sanitize)
    OUT="$out/sanitize" timeout ${SANITIZE_TIMEOUT:-240} bash tests/diagnostics/sanitize.sh > "$out/sanitize.txt" 2>&1
    note "sanitize (rc $?)"; tail -6 "$out/sanitize.txt" >> "$sum"
    ;;
  profile)
    timeout 90 python3 tests/diagnostics/profile_overhead.py > "$out/profile.txt" 2>&1
    note "profile_overhead"; head -70 "$out/profile.txt" >> "$sum"
    ;;
  decode)
    timeout 90 python3 tests/diagnostics/bench_decode.py > "$out/decode.txt" 2>&1
    note "decode"; tail -12 "$out/decode.txt" >> "$sum"
    ;;
  candidates)
    # FWD_VARIANTS: the forward's builds to time against the default (ws+DEFINE[+DEFINE] each);
    # BITS_K: a pytest -k expression selecting the GPU bit tests to run first (none if empty)
    if [ -n "${BITS_K:-}" ]; then
      cand bits 150 6 python3 -m pytest tests/gpu/test_sm90_gpu.py -m gpu -q -p no:cacheprovider \
          -k "$BITS_K"
    fi
    cand fwd_variants 280 70 python3 tests/diagnostics/bench_fwd_variants.py \
        --seqlen 2048 4096 16384 --headdim 64 128 256 --rounds 2 --variants ws \
        ${FWD_VARIANTS:-ws+FC_DIAG_NO_SOFTMAX_FENCE ws+FC_DIAG_PP_CHAIN}
    cand fwdbwd 120 20 python3 tests/diagnostics/bench_fwd_variants.py --mode fwdbwd \
        --seqlen 4096 16384 --headdim 64 128 256 --causal no --variants ws \
        ${FWDBWD_VARIANTS:-ws+FC_DIAG_NO_SOFTMAX_FENCE}
    ;;
  candidates2)
    cand dropout 150 40 python3 tests/diagnostics/bench_dropout.py --defines \
        FC_DIAG_SOFTMAX_FENCE_DROPOUT
    cand fp8 200 30 python3 tests/diagnostics/bench_fp8_forward.py --pingpong on --headdims \
        128,256 --seqlens 4096,16384 \
        --defines FC_DIAG_SOFTMAX_FENCE,FC_DIAG_SOFTMAX_FENCE+FC_DIAG_POLY_EVERY=4
    cand timeline 80 40 python3 tests/diagnostics/probe_timeline.py --headdim 128 \
        --seqlen 2048 16384
    ;;
  conformance)
    cand conformance ${CONF_TIMEOUT:-330} 45 python3 tests/diagnostics/flash_attn_conformance.py \
        "${FA_TEST:?set FA_TEST to the path of flash-attn 2 tests/test_flash_attn.py}" \
        --cases "${FA_CASES:?set FA_CASES to a file of --write-cases}" --out "$final/conformance" \
        --timeout $(( ${CONF_TIMEOUT:-330} - 20 )) --case-timeout ${CONF_CASE_TIMEOUT:-120} --rerun-oom \
        --pytest-args -n ${CONF_WORKERS:-12}
    ;;
  endtoend)
    cand endtoend ${E2E_TIMEOUT:-300} 30 python3 tests/diagnostics/bench_callpath.py \
        ${E2E_SECTIONS:-llama compile}
    ;;
  decodesweep)
    cand decodesweep 120 20 python3 tests/diagnostics/sweep_decode.py --batches 1 \
        --caches 131072 --page-size 256 --more-configs --top 8 \
        --splits ${SWEEP_SPLITS:-8,12,16,20,24,32,48}
    ;;
  steptimeline)
    cand steptimeline 90 20 python3 tests/diagnostics/probe_step_timeline.py
    ;;
  esac
done
tar czf "$final/logs.tgz" -C "$out" . 2>/dev/null
cat "$sum"
