#!/usr/bin/env bash
# The GPU check: the GPU test group, a quick benchmark against torch SDPA (flash and cuDNN
# backends, same run), and one summary line. Run from the repository root on a GPU machine:
#     bash tests/gpu/check.sh [quick|full|tests|bench|asv]
# It ends with the decode table through the public API and an asv run of this commit compared
# with the newest committed results (asv_benchmarks/compare.sh; ASV=0 skips it). The whole of it
# takes longer than one 10-minute device call, so it runs in parts too: `tests` the test group
# only, `bench` the benchmarks (quick's sizes) and the decode table only, `asv` the asv compare
# only; the three in turn do what `quick` does.
# On compute capability 9.0 the suite runs with the default kernels (the Hopper family where it
# applies), then the Ampere-class suite and fuzz tests again with FLASHCORE_SM90=0 and
# FLASHCORE_SM90_BWD=0, so that both families are checked on an H100/H200.
# Logs go to $OUT (or ./gpu-check-out). A machine without network that lacks the test
# dependencies (hypothesis, pytest-xdist, ml_dtypes) gets them from the wheels in
# $FLASHCORE_TEST_WHEELS (default .whl/test, an ignored folder that travels with the tree).
set -uo pipefail
mode=${1:-full}
case "$mode" in quick|full|tests|bench|asv) ;;
  *) echo "check.sh: unknown mode '$mode' (quick, full, tests, bench or asv)" >&2; exit 2;;
esac
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
# (FLASHCORE_SM90_DEFINES: the whole check against a candidate's build, e.g. before a timing
# define's change becomes the default)
[ -n "${FLASHCORE_SM90_DEFINES:-}" ] && echo "FLASHCORE_SM90_DEFINES=$FLASHCORE_SM90_DEFINES" | tee "$out/defines.txt"

wheels=${FLASHCORE_TEST_WHEELS:-.whl/test}
for mod in hypothesis xdist ml_dtypes; do
  if ! python3 -c "import $mod" 2>/dev/null && [ -d "$wheels" ]; then
    python3 -m pip install -q --no-index --find-links "$wheels" --break-system-packages \
      "$(case $mod in xdist) echo pytest-xdist;; ml_dtypes) echo ml-dtypes;; *) echo $mod;; esac)" 2>&1 | tail -2
  fi
done

workers=${FLASHCORE_TEST_WORKERS:-8}
xdist=""
if python3 -c "import xdist" 2>/dev/null; then
  xdist="-n $workers"
  # Each worker computes NumPy references: one BLAS thread each, or the workers' thread pools
  # oversubscribe the cores (a worker per core is the parallelism wanted here).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} \
         MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
fi
t0=$(date +%s)
tests_rc=0; tests_line="not run (mode $mode)"
if [ "$mode" != bench ] && [ "$mode" != asv ]; then
timeout ${GPU_TEST_TIMEOUT:-1800} python3 -m pytest tests -m gpu -q -rfE $xdist -p no:cacheprovider --maxfail=40 ${GPU_TEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log" | tail -60
tests_rc=${PIPESTATUS[0]}
tests_line=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$out/gpu_tests.log" | tail -1)
if python3 -c "import cupy, sys; sys.exit(cupy.cuda.Device().compute_capability != '90')" 2>/dev/null; then
  FLASHCORE_SM90=0 FLASHCORE_SM90_BWD=0 timeout ${GPU_TEST_TIMEOUT:-1800} python3 -m pytest \
      tests/gpu/test_cupy_gpu.py tests/gpu/test_fuzz_gpu.py -m gpu -q -rfE $xdist -p no:cacheprovider \
      --maxfail=40 2>&1 | tee "$out/gpu_tests_ampere.log" | tail -30
  rc2=${PIPESTATUS[0]}
  [ "$tests_rc" = 0 ] && tests_rc=$rc2
  tests_line="$tests_line; Ampere family (FLASHCORE_SM90=0): $(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$out/gpu_tests_ampere.log" | tail -1)"
fi
fi
t1=$(date +%s)
if [ "$mode" = tests ]; then
  echo "SUMMARY tests: ${tests_line:-none} (rc $tests_rc, $((t1 - t0)) s)"
  exit $tests_rc
fi

bench_rc=0
if [ "$mode" != asv ]; then
if [ "$mode" = quick ] || [ "$mode" = bench ]; then
  seqs="1024 4096 16384"; dims="64 128 256"
else
  seqs="512 1024 2048 4096 8192 16384"; dims="64 128 256"
fi
python3 - <<'PY' 2>&1 | tee "$out/kernels.txt"
# registers and local memory (spills) of the main kernels as the device's NVRTC builds them
import cupy, flashcore.jit as jit
from flashcore.kernels import forward, backward
cc = int(cupy.cuda.Device().compute_capability)
for d in (64, 128, 256):
    for src, names in (("flash_fwd.cu", [forward.kernel_name("bfloat16", d, c, False, False) for c in (False, True)]),
                       ("flash_bwd.cu", [n for n in backward.instantiations() if "dkdv" in n and f"fc_bf16, {d}," in n][:2])):
        for n in names:
            k = jit.get_kernel(src, n, 0, cc)
            print(f"{n}: regs {k.num_regs}, local {k.local_size_bytes} B, smem static {k.shared_size_bytes}")
PY
python3 -m flashcore.bench --overhead 2>&1 | tee "$out/overhead.log"
python3 -m flashcore.bench --seqlen $seqs --headdim $dims --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
python3 - "$out/bench.json" <<'PY' | tee "$out/summary.txt"
import json, math, sys
rows = json.load(open(sys.argv[1]))
def gm(xs):
    xs = [x for x in xs if x and not math.isnan(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
for mode in ("fwd", "fwdbwd"):
    for peer in ("sdpa_flash", "sdpa_cudnn"):
        r = [x.get(f"cupy_{mode}_tflops", float("nan")) / x.get(f"{peer}_{mode}_tflops", float("nan")) for x in rows]
        print(f"{mode:7s} flashcore/{peer}: geomean {gm(r):.2f}x  min {min(r):.2f}x  max {max(r):.2f}x")
PY
# what users pay per decoding step, through the public API (GPU time, host loop, graph replay)
python3 -m flashcore.bench --decode 2>&1 | tee "$out/decode.log"
fi
# asv on this commit, compared with the newest committed results: regressions beyond 5% fail
asv_rc=0
if [ "${ASV:-1}" != 0 ] && [ "$mode" != bench ]; then
  OUT="$out" bash asv_benchmarks/compare.sh > "$out/asv_compare.txt" 2>&1; asv_rc=$?
  # the verdict (every change beyond 5%, the holes in the history), not the tail of the log,
  # which ends with asv's own informative table
  if [ -s "$out/asv/compare.txt" ]; then cat "$out/asv/compare.txt"; else tail -15 "$out/asv_compare.txt"; fi
fi
echo "SUMMARY${FLASHCORE_SM90_DEFINES:+ [$FLASHCORE_SM90_DEFINES]} tests: ${tests_line:-none} (rc $tests_rc, $((t1 - t0)) s); bench rc $bench_rc; asv compare rc $asv_rc; $(head -1 "$out/summary.txt" 2>/dev/null)"
exit $(( tests_rc != 0 || bench_rc != 0 || asv_rc != 0 ))
