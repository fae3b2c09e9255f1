"""Diagnose the Hopper forward (cuda/flash_fwd_sm90.cu) on structured inputs, part by part:
which of its products is wrong when the tests fail.

  lse with random Q, K        depends only on S = Q K^T      (the Q / K descriptors)
  O with Q = 0                P is uniform: O = mean of V    (the P V product, V descriptor)
  O with V one-hot rows       O[i, j] = P[i, j]              (S and P V together; a wrong V
                              (V[key j] = e_j)                descriptor permutes columns)
Prints max errors against NumPy (float64) for each probe, v0 and v1, head dims 64, 128, 256,
under each descriptor convention (default, and -DFC_WGMMA_MN_SWAP: LBO/SBO of the M/N-major
operands swapped, see cuda/wgmma.cuh); then the Hopper backward's gradients against the
GPU-verified Ampere backward's on the same inputs (d128), under each convention.

    python tests/diagnostics/probe_sm90.py
"""
from __future__ import annotations

import numpy as np


def ref(q, k, v, scale):
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l_ = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / l_, v)
    return o, (np.log(l_) + m)[..., 0]


def main():
    import cupy as cp
    import ml_dtypes
    import flashcore
    from flashcore.kernels import forward

    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    conventions = {"default": [], "mn-swap": ["-DFC_WGMMA_MN_SWAP"]}
    print(f"{'convention':10} {'variant':8} {'d':>4} | {'lse (S)':>10} {'O, Q=0 (PV)':>12} "
          f"{'O, V one-hot':>13}")
    for conv, defines in conventions.items():
        forward.set_sm90_defines(defines)
        for pipelined in (False, True):
            forward.set_sm90(True, pipelined=pipelined)
            for d in (64, 128, 256):
                if pipelined and d == 256:
                    continue
                b, s, h = 1, 128, 2
                scale = 1.0 / np.sqrt(d)
                q = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
                k = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
                v = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
                dev = lambda x: cp.asarray(x.astype(bf))  # noqa: E731
                _, l_ = flashcore.attention_forward(dev(q), dev(k), dev(v))      # 1. S only
                _, rl = ref(q, k, v, scale)
                e_lse = float(np.abs(l_.get() - rl).max())
                z = np.zeros_like(q)                                             # 2. P uniform
                o, _ = flashcore.attention_forward(dev(z), dev(k), dev(v))
                ro, _ = ref(z, k, v, scale)
                e_pv = float(np.abs(o.get().astype(np.float64) - ro).max())
                vo = np.zeros_like(v)                                            # 3. V one-hot
                for j in range(s):
                    vo[:, j, :, j % d] = 1.0
                o, _ = flashcore.attention_forward(dev(q), dev(k), dev(vo))
                ro, _ = ref(q, k, vo, scale)
                e_oh = float(np.abs(o.get().astype(np.float64) - ro).max())
                print(f"{conv:10} {'v1' if pipelined else 'v0':8} {d:>4} | {e_lse:>10.2e} "
                      f"{e_pv:>12.2e} {e_oh:>13.2e}")
    forward.set_sm90(False, pipelined=False)

    # The Hopper backward against the Ampere one (same inputs, Ampere forward).
    from flashcore.kernels import backward
    b, s, h, hk, d = 2, 300, 6, 2, 128
    q, k, v, do = (cp.asarray(rng.standard_normal(sh).astype(bf)) for sh in
                   ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)))
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    backward.set_sm90(False)
    ref_g = [x.get().astype(np.float64) for x in
             flashcore.attention_backward(do, q, k, v, out, lse, causal=True)]
    print(f"{'convention':10} backward d128 | max |Hopper - Ampere| for dq, dk, dv "
          f"(max |Ampere|: {', '.join(f'{np.abs(r).max():.2g}' for r in ref_g)})")
    for conv, defines in conventions.items():
        forward.set_sm90_defines(defines)
        backward.set_sm90(True)
        g = flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
        errs = [float(np.abs(x.get().astype(np.float64) - r).max()) for x, r in zip(g, ref_g)]
        print(f"{conv:10} {'':14} | " + "  ".join(f"{e:.2e}" for e in errs))
    backward.set_sm90(False)
    forward.set_sm90_defines([])
    print("bf16 round-off is ~1e-2 on O and gradients, ~1e-3 on lse; errors of order 1 locate "
          "the fault (and the convention that removes it).")


if __name__ == "__main__":
    main()
