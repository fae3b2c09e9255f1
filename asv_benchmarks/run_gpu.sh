#!/usr/bin/env bash
# Run flashcore's asv suite on the GPU machine (no network), publish the HTML, and hand the
# results back through $OUT. Run from anywhere inside the checkout:
#
#     asv_benchmarks/run_gpu.sh                 # the whole suite
#     asv_benchmarks/run_gpu.sh -b Throughput   # extra arguments go to `asv run`
#     ASV_GROUPS='^bench_attention_gpu.Ratio;^bench_attention_gpu.Throughput' asv_benchmarks/run_gpu.sh
#     ASV_COMMIT=<hash of the tree being measured> asv_benchmarks/run_gpu.sh
#
# Measured on the H200 (2026-11-29): install + kernel warm-up + the Ratio group (72 benchmarks)
# took about 7 minutes, so the whole suite needs several 10-minute device calls: use
# ASV_GROUPS (each group saves its results when it ends) and one call per group or two.
#
# Needs: the asv wheels of shared/wheels/asv copied into .whl/ (an ignored folder, so that
# they travel with the working tree) unless asv is already installed; the repository's .git.
# Environment: ASV_MACHINE (default nvidia-h200: one name across sessions, so results line
# up), PYTHON (default python3), ASV_WHEELS (default .whl).
set -euo pipefail

# The checkout may belong to another user than the one running (a copied tree): let git read it.
git config --global --add safe.directory '*' 2>/dev/null || true
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$ROOT"
# A copied checkout may carry a .git without history (the device machine's does): asv needs the
# commits, so restore them from a bundle made beforehand with
#     git bundle create .whl/repo.bundle <branch>    (an ignored folder that travels)
# A copied .git may also be stale (seen on the device machine: its HEAD was an older commit
# than the working tree). Name the commit the tree is at with ASV_COMMIT=<hash>; it is taken
# from the bundle (every branch in it, whatever its name) when the copied .git lacks it.
COMMIT=${ASV_COMMIT:-HEAD}
if ! git rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1; then
  bundle=${ASV_BUNDLE:-.whl/repo.bundle}
  if [ -f "$bundle" ]; then
    git fetch -q "$bundle" '+refs/heads/*:refs/bundle/*'
  fi
  if ! git rev-parse -q --verify "$COMMIT^{commit}" >/dev/null 2>&1; then
    echo "run_gpu.sh: this checkout lacks $COMMIT, and no bundle at $bundle holds it" >&2
    exit 2
  fi
fi
COMMIT=$(git rev-parse "$COMMIT^{commit}")
echo "run_gpu.sh: results are recorded for commit $COMMIT"
PY=${PYTHON:-python3}
MACHINE=${ASV_MACHINE:-nvidia-h200}
WHEELS=${ASV_WHEELS:-.whl}

# asv itself: installed outside the checkout (asv clears PYTHONPATH for the benchmarks, which
# only need flashcore, torch and CuPy from the interpreter's own site-packages).
if ! command -v asv >/dev/null 2>&1; then
    SITE=${TMPDIR:-/tmp}/flashcore-asv-site
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
fi

# flashcore into the interpreter the benchmarks run in (setuptools only, offline).
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c "import flashcore; print('flashcore backends:', flashcore.available_backends())"

# Compile every kernel configuration in parallel first: the suite then loads them from disk.
# (ASV_WARM=0 skips it: for a group, such as the decode benchmarks, whose few kernels compile
# within the benchmarks' own timeouts.)
if [ "${ASV_WARM:-1}" != 0 ]; then
  "$PY" asv_benchmarks/warm_kernel_cache.py || echo "run_gpu.sh: warming the kernel cache failed (see above); the benchmarks will compile as they go"
fi

cd asv_benchmarks
asv machine --yes --machine "$MACHINE" >/dev/null
status=0
hand_back() {
  if [ -n "${OUT:-}" ] && [ -d results/"$MACHINE" ]; then
    # The device tool returns at most 8 files, at most two folders down: hand back this
    # commit's result file, machine.json and benchmarks.json (the older results are the
    # repository's own; copying them too pushed the new one past the limit once).
    mkdir -p "$OUT/asv"
    cp results/benchmarks.json results/"$MACHINE"/machine.json \
       results/"$MACHINE"/"${COMMIT:0:8}"-*.json "$OUT/asv/" 2>/dev/null || true
  fi
}
# asv saves results when a run ends: run the suite in groups (ASV_GROUPS, ';'-separated regexes
# run one after another), so that a time limit loses at most the group in flight.
if [ -n "${ASV_GROUPS:-}" ]; then
  IFS=';' read -ra groups <<<"$ASV_GROUPS"
  for g in "${groups[@]}"; do
    asv run --environment "existing:$(command -v "$PY")" --set-commit-hash "$COMMIT" \
        --machine "$MACHINE" --show-stderr -b "$g" "$@" || status=$?
    hand_back
  done
else
  asv run --environment "existing:$(command -v "$PY")" --set-commit-hash "$COMMIT" \
      --machine "$MACHINE" --show-stderr "$@" || status=$?
fi
asv publish

if [ -n "${OUT:-}" ]; then
    hand_back
    echo "run_gpu.sh: results copied to \$OUT/asv (commit them under asv_benchmarks/results/$MACHINE/, benchmarks.json one level up)"
fi
exit $status
