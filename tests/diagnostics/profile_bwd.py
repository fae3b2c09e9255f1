"""One forward + backward at the ANCHORS size for Nsight Compute (tests/gpu: profiling aid).
    ncu --clock-control none -k regex:dkdv --launch-skip 2 --launch-count 1 python3 tests/diagnostics/profile_bwd.py 128 4096"""
import sys

import cupy

import flashcore
from flashcore.bench import random_arrays, shape_for

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
s = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
b, _, h, _ = shape_for(s, d)
q, k, v, do = random_arrays("cupy", [(b, s, h, d)] * 4, seed=0, dtype="float16")
for _ in range(3):
    o, l = flashcore.attention_forward(q, k, v, causal=causal)
    flashcore.attention_backward(do, q, k, v, o, l, causal=causal)
cupy.cuda.Device().synchronize()
print("done")
