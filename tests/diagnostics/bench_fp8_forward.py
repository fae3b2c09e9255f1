"""The Hopper FP8 forward (issue #17: >= 1.0 PFLOP/s at head dims 128 and 256 from 4k keys,
non-causal) against flashcore's bfloat16 forward and torch SDPA's cuDNN bfloat16 kernel, in
the same process.

    python tests/diagnostics/bench_fp8_forward.py [--seqlens 4096,8192,16384] [--headdims 128,256]
                                                 [--pingpong both|on|off] [--no-check]
                                                 [--defines FC_DIAG_FP8_NO_TRANSPOSE,...]
                                                 [--bn 128,224] [--rounds N]

First a correctness check on a few small cases, of the default build and then of each
``--defines`` candidate's but the timing-only probes' (against the float64 attention of the
dequantised inputs, with the flash-attn rule in FP8: error at most twice that of the NumPy
emulation, flashcore.reference.fp8_forward, plus the bfloat16 output's rounding). Then, through
the public API on torch CUDA tensors (torch.float8_e4m3fn q, k, v with per-(batch, key head)
descales; bf16 q, k, v for the peers), GPU time by ``flashcore.bench.gpu_time`` (CUDA events
after warm-up, L2 flushed, median) at flash-attn's sizes: 16k tokens per batch, hidden 2048
(nheads = 2048 / d), non-causal and causal. TFLOP/s with flash-attn's count 4·b·h·s²·d (halved
for causal), the same count for all three. ``--pingpong``: the FP8 kernel with the consumers'
ping-pong on, off, or both (two columns). ``--defines``: the FP8 call again with each of these
NVRTC defines (the ``sm90_defines`` setting; cuda/flash_fwd_sm90.cu's FC_DIAG_FP8_NO_TRANSPOSE
and FC_DIAG_FP8_NO_PACK leave a piece out: timing only, wrong results; A+B: both), one
column each. ``--bn 128,224``: a column for each of these tiles at head dim 128 (128-key blocks
with 3 stages, the tile before the 192-key default; 224-key blocks with 2), with the largest
difference from the default kernel's output. ``--rounds N``: every column but the ``--bn``
ones timed N times, each round starting one column later (a place in a fixed order moved
identical kernels by up to 7% in session 42 of the performance log), the median reported; a
define that nothing reads (``FC_DIAG_CONTROL``) gives a control column of the default kernel.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import sys


def _arg(argv, name, default):
    return argv[argv.index(name) + 1] if name in argv else default


def check(torch, flashcore):
    """A few cases against the rule; prints one line each, returns whether all passed."""
    import numpy as np
    from flashcore.reference import fp8_dequantize, fp8_forward, naive_forward
    from flashcore.spec import forward_spec
    import ml_dtypes
    ok = True
    rng = np.random.default_rng(0)
    for b, sq, sk, h, hk, d, kw in ((2, 255, 1000, 4, 2, 128, {}),
                                    (1, 1000, 1000, 4, 1, 256, {"causal": True}),
                                    (2, 17, 600, 2, 2, 128, {"window_size": (128, 16)}),
                                    (1, 512, 512, 8, 2, 256, {})):
        q8s, ds = [], []
        for n, heads in ((sq, h), (sk, hk), (sk, hk)):
            x = rng.standard_normal((b, n, heads, d)) * 2.0
            amax = np.abs(x).reshape(b, n, hk, heads // hk, d).max(axis=(1, 3, 4))
            s = (amax / 448.0).astype(np.float32)
            q8s.append((x / np.repeat(s, heads // hk, 1)[:, None, :, None])
                       .astype(ml_dtypes.float8_e4m3fn))
            ds.append(s)
        exact = [fp8_dequantize(x, s, hk).astype(np.float64) for x, s in zip(q8s, ds)]
        want, _ = naive_forward(forward_spec(*exact, **kw), *exact)
        emul, _ = fp8_forward(forward_spec(*q8s, **kw), *q8s, tuple(ds))
        emul_err = np.abs(emul - want).max()
        t = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn) for x in q8s]
        td = [torch.from_numpy(s).cuda() for s in ds]
        out, _ = flashcore.attention_forward(*t, q_descale=td[0], k_descale=td[1],
                                             v_descale=td[2], **kw)
        err = np.abs(out.float().cpu().numpy() - want).max()
        bound = 2 * emul_err + np.abs(want).max() * 2.0 ** -8
        good = bool(np.isfinite(err) and err <= bound)
        ok &= good
        print(f"# check b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {kw or ''}: error {err:.4f}, "
              f"emulated {emul_err:.4f}, bound {bound:.4f}: {'ok' if good else 'FAILED'}")
    return ok


# (keys per block, stages) of the other tiles at head dim 128 (--bn): 128 keys, the tile before
# the 192-key default; 224, the largest whose V^T fits two 128-key chunks
_OTHER_TILES = {128: (128, 3), 224: (224, 2)}


def _other_tile(flashcore, x8, desc, causal, d, f, gpu_time, bn):
    """TFLOP/s of the call with ``bn``-key blocks at head dim 128 (nan elsewhere); prints the
    largest difference from the default kernel's output."""
    from flashcore.kernels import forward, plans
    if d != 128:
        return float("nan")

    def call():
        return flashcore.attention_forward(*x8, causal=causal, q_descale=desc[0],
                                           k_descale=desc[1], v_descale=desc[2])
    ref = call()[0].float()
    saved = forward._FP8_TILES[128]
    forward._FP8_TILES[128] = _OTHER_TILES[bn]
    plans.clear()        # (a tile table change is no setting: the launch plans do not see it)
    try:
        diff = float((call()[0].float() - ref).abs().max())
        t = gpu_time(call)
    finally:
        forward._FP8_TILES[128] = saved
        plans.clear()
    print(f"# bn{bn} causal={causal}: max |difference| from the default kernel {diff:.3g}")
    return f / t / 1e12


def main(argv):
    import torch
    import torch.nn.functional as F
    import flashcore
    from flashcore import config
    from flashcore.bench import (flops, fp8_quantise, gpu_time, random_arrays, sdpa_pinned,
                                 shape_for)

    seqlens = [int(x) for x in _arg(argv, "--seqlens", "4096,8192,16384").split(",")]
    headdims = [int(x) for x in _arg(argv, "--headdims", "128,256").split(",")]
    pp_modes = {"both": (True, False), "on": (True,), "off": (False,)}[
        _arg(argv, "--pingpong", "both")]
    rounds = int(_arg(argv, "--rounds", "1"))
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}; 16k tokens, hidden "
          "2048; TFLOP/s (flash-attn's count), GPU time through the public API")
    defines = [x for x in _arg(argv, "--defines", "").split(",") if x]
    if "--no-check" not in argv:
        if not check(torch, flashcore):
            print("# correctness check FAILED: the timings below are of a wrong kernel")
        for d_ in defines:          # the candidates too (not the timing-only probes)
            if "NO_TRANSPOSE" in d_ or "NO_PACK" in d_:
                continue
            print(f"# check with {d_}:")
            with config.override(sm90_defines=tuple(f"-D{x}" for x in d_.split("+"))):
                if not check(torch, flashcore):
                    print(f"# correctness check FAILED with {d_}")
    bns = [int(x) for x in _arg(argv, "--bn", "").split(",") if x]
    cols = [f"fp8 pp={'on' if p else 'off'}" for p in pp_modes] + [
        d_.replace("FC_DIAG_FP8_", "-") for d_ in defines] + [f"bn{bn}" for bn in bns] + [
        "bf16 flashcore", "bf16 cuDNN", "fp8/cuDNN"]
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} | " + " | ".join(f"{c:>14}" for c in cols))
    for d in headdims:
        for s in seqlens:
            b, _, h, _ = shape_for(s, d)
            x16 = random_arrays("torch", [(b, s, h, d)] * 3, seed=s + d)
            x8, desc = zip(*(fp8_quantise(x) for x in x16))
            xt = [x.transpose(1, 2) for x in x16]      # SDPA's (b, h, s, d)
            for causal in (False, True):
                f = flops(b, s, h, d, causal)

                def fp8_call(causal=causal):
                    return flashcore.attention_forward(*x8, causal=causal, q_descale=desc[0],
                                                       k_descale=desc[1], v_descale=desc[2])
                # (settings, call) of each column timed in rounds: the FP8 kernel per ping-pong
                # mode and per define set, flashcore's bf16 forward, SDPA cuDNN's
                impls = [(functools.partial(config.override, sm90_fwd_pingpong=pp), fp8_call)
                         for pp in pp_modes]
                impls += [(functools.partial(config.override, sm90_defines=tuple(
                    f"-D{x}" for x in d_.split("+"))), fp8_call) for d_ in defines]
                impls.append((contextlib.nullcontext,
                              lambda causal=causal: flashcore.attention_forward(
                                  *x16, causal=causal)))
                impls.append((functools.partial(sdpa_pinned, "sdpa_cudnn"),
                              lambda causal=causal: F.scaled_dot_product_attention(
                                  *xt, is_causal=causal)))
                times = [[] for _ in impls]
                for r in range(rounds):     # each round starts one column later (see above)
                    k = r % len(impls)
                    for i in list(range(k, len(impls))) + list(range(k)):
                        ctx, call = impls[i]
                        try:
                            with ctx():
                                times[i].append(gpu_time(call))
                        except Exception as e:   # no cuDNN attention in this torch / shape
                            if i != len(impls) - 1:
                                raise
                            print(f"# cuDNN: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:100]}")
                            times[i].append(float("nan"))
                tf = [f / statistics.median(ts) / 1e12 for ts in times]
                row = tf[:-2] + [_other_tile(flashcore, x8, desc, causal, d, f, gpu_time, bn)
                                 for bn in bns] + tf[-2:]
                row.append(max(row[:len(pp_modes)]) / row[-1])
                print(f"{d:>4} {s:>6} {str(causal):>6} | "
                      + " | ".join(f"{v:>14.1f}" for v in row[:-1]) + f" | {row[-1]:>14.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
