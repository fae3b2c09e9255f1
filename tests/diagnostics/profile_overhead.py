"""Where the per-call host time goes (cProfile over many tiny calls): a diagnostic. The calls
are flashcore.bench.tiny_calls' forward+backward steps (1 x 128 x 2 x 64 bf16, causal), CuPy
and torch."""
import cProfile
import pstats
import sys

import torch

from flashcore.bench import tiny_calls

calls, _ = tiny_calls()

for name, fn in (("cupy", calls["cupy_fwdbwd"]), ("torch", calls["torch_fwdbwd"])):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    print(f"===== {name} forward+backward, 300 calls")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(14)
