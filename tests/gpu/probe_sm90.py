"""Diagnose the Hopper forward (cuda/flash_fwd_sm90.cu) on structured inputs, part by part:
which of its products is wrong when the tests fail.

  lse with random Q, K        depends only on S = Q K^T      (the Q / K descriptors)
  O with Q = 0                P is uniform: O = mean of V    (the P V product, V descriptor)
  O with V one-hot rows       O[i, j] = P[i, j]              (S and P V together; a wrong V
                              (V[key j] = e_j)                descriptor permutes columns)
Prints max errors against NumPy (float64) for each probe, v0 and v1, head dims 64 and 128.

    python tests/gpu/probe_sm90.py
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
    print(f"{'variant':8} {'d':>4} | {'lse (S)':>10} {'O, Q=0 (PV)':>12} {'O, V one-hot':>13}")
    for pipelined in (False, True):
        forward.set_sm90(True, pipelined=pipelined)
        for d in (64, 128):
            b, s, h = 1, 128, 2
            scale = 1.0 / np.sqrt(d)
            q = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
            k = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
            v = rng.standard_normal((b, s, h, d)).astype(bf).astype(np.float64)
            dev = lambda x: cp.asarray(x.astype(bf))  # noqa: E731
            # 1. lse: S only
            _, l_ = flashcore.attention_forward(dev(q), dev(k), dev(v))
            _, rl = ref(q, k, v, scale)
            e_lse = float(np.abs(l_.get() - rl).max())
            # 2. Q = 0: uniform P, O = column means of V
            z = np.zeros_like(q)
            o, _ = flashcore.attention_forward(dev(z), dev(k), dev(v))
            ro, _ = ref(z, k, v, scale)
            e_pv = float(np.abs(o.get().astype(np.float64) - ro).max())
            # 3. V one-hot (key j -> unit vector j % d): O[i, j] = sum of P over keys = j mod d
            vo = np.zeros_like(v)
            for j in range(s):
                vo[:, j, :, j % d] = 1.0
            o, _ = flashcore.attention_forward(dev(q), dev(k), dev(vo))
            ro, _ = ref(q, k, vo, scale)
            e_oh = float(np.abs(o.get().astype(np.float64) - ro).max())
            print(f"{'v1' if pipelined else 'v0':8} {d:>4} | {e_lse:>10.2e} {e_pv:>12.2e} {e_oh:>13.2e}")
    forward.set_sm90(False, pipelined=False)
    print("bf16 round-off is ~1e-2 on O and ~1e-3 on lse; errors of order 1 locate the fault.")


if __name__ == "__main__":
    main()
