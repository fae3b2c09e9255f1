"""The warp-specialised Hopper forward with persistent CTAs, for compute-sanitizer (a subset of
sanitize_driver.py that runs in seconds): 16-bit and FP8, tiles from one per CTA to three, of
different lengths (causal), with and without ping-pong.

    compute-sanitizer --tool racecheck python3 tests/diagnostics/sanitize_persistent.py
"""
import numpy as np
import cupy as cp

import flashcore
from flashcore import config

cp.cuda.set_allocator(None)
rng = np.random.default_rng(0)


def arr(shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype == "bfloat16":
        import ml_dtypes
        return cp.asarray(x.astype(ml_dtypes.bfloat16))
    if dtype == "e4m3":
        import ml_dtypes
        return cp.asarray(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))   # (the bits)
    return cp.asarray(x.astype(dtype))


n = 0
for pp in (True, False):
    with config.override(sm90_fwd_persistent=True, sm90_fwd_pingpong=pp,
                         sm90_fwd_d64_min_seqlen_k=0):
        for dt, sq, sk, hd, h, kw in (("bfloat16", 77, 93, 128, 4, {}),
                                      ("float16", 300, 130, 128, 4, {"causal": True}),
                                      ("bfloat16", 200, 700, 128, 4, {"window_size": (40, 7)}),
                                      ("bfloat16", 130, 300, 128, 140, {}),
                                      ("float16", 130, 300, 64, 140, {"causal": True}),
                                      ("bfloat16", 130, 200, 256, 140, {}),
                                      ("e4m3", 130, 300, 128, 140, {}),
                                      ("e4m3", 300, 333, 128, 40, {"causal": True})):
            q, k, v = arr((1, sq, h, hd), dt), arr((1, sk, 2, hd), dt), arr((1, sk, 2, hd), dt)
            flashcore.attention_forward(q, k, v, **kw)
            cp.cuda.Device().synchronize()
            n += 1
print(f"sanitize_persistent: {n} cases ran")
