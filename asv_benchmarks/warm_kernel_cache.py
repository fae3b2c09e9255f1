"""Compile every kernel configuration the asv suite uses, in parallel, before the suite runs.

A cold NVRTC compile takes seconds to tens of seconds per configuration; the benchmarks would
otherwise pay it one after the other (and inside their timeouts). Each configuration is
compiled in its own process, all at once, into flashcore's kernel cache (``config.cache_dir``),
which the benchmark processes then load from. Exits 0 with a message where the CuPy backend is missing.

    python asv_benchmarks/warm_kernel_cache.py [--jobs N]
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time

HEADDIMS = (64, 128, 256)
CAUSAL = (False, True)

ONE = """
import sys, cupy, ml_dtypes, flashcore
hd, causal = int(sys.argv[1]), sys.argv[2] == "True"
rng = cupy.random.default_rng(0)
q, k, v, do = (rng.standard_normal((1, 1024, 2, hd), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
               for _ in range(4))
out, lse = flashcore.attention_forward(q, k, v, causal=causal)
flashcore.attention_backward(do, q, k, v, out, lse, causal=causal)
cupy.cuda.Device().synchronize()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    args = ap.parse_args()
    import flashcore
    why = flashcore.available_backends().get("cupy")
    if why:
        print(f"warm_kernel_cache: nothing to do, the CuPy backend is unavailable: {why}")
        return 0
    configs = list(itertools.product(HEADDIMS, CAUSAL))
    t0 = time.perf_counter()
    running, failed = [], []
    for hd, causal in configs:
        while len(running) >= args.jobs:
            running = [p for p in running if _reap(p, failed)]
            time.sleep(0.1)
        p = subprocess.Popen([sys.executable, "-c", ONE, str(hd), str(causal)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        p.config = (hd, causal)
        running.append(p)
    for p in running:
        p.wait()
        _reap(p, failed)
    print(f"warm_kernel_cache: {len(configs) - len(failed)}/{len(configs)} configurations "
          f"(headdim x causal, forward and backward) ready in {time.perf_counter() - t0:.1f} s")
    for (hd, causal), log in failed:
        print(f"  headdim {hd} causal {causal} failed:\n{log}")
    return 1 if failed else 0


def _reap(p, failed) -> bool:
    """True while ``p`` runs; records its log in ``failed`` if it ended badly."""
    if p.poll() is None:
        return True
    if p.returncode != 0:
        failed.append((p.config, p.stdout.read()))
    return False


if __name__ == "__main__":
    sys.exit(main())
