"""Attention dropout's random stream: one definition, shared by the NumPy reference and the CUDA
kernels (``cuda/flash_dropout.cuh`` computes the same function), so that CPU and GPU drop the
same probabilities and the backward regenerates the forward's mask with nothing stored.

The stream is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC'11; the generator torch and flash-attn use), counter-based: the bits of a probability depend
only on its coordinates and on the call's ``rng_state``, an int64 pair ``(seed, offset)``.

Probability (batch b, query head h, query row i, key column j) of a call with ``nheads`` query
heads -- rows and columns counted from the start of the sequence (varlen: b is the sequence
index, i and j positions inside it) -- is kept iff ``r16 >= threshold``, where

* key     = (seed mod 2^32, (seed >> 32) xor (offset >> 32)),
* counter = (8 * (i >> 4) + (i & 7), 4 * (j >> 4) + ((j >> 1) & 3), b * nheads + h,
  offset mod 2^32),
* r16     = bits 16 * (j & 1) .. + 15 of output word ``2 * ((i >> 3) & 1) + ((j >> 3) & 1)`` of
  Philox(counter, key).

(One Philox call thus covers a 2 x 4 group of a 16 x 16 tile: rows r, r + 8 and columns c,
c + 1, c + 8, c + 9. A GPU thread holds exactly such a group of the scores in the forward's
mma fragments (rows g, g + 8; columns 2t, 2t + 1 of two adjacent 8-column tiles), and half of
one in the backward's transposed fragments, the other half held by its neighbour lane; so
both passes draw one call per 8 probabilities.)
``threshold = min(round(p * 65536), 65535)``, so the drop probability is ``threshold / 65536``
(``p`` to within 2^-17), and a kept probability is scaled by ``65536 / (65536 - threshold)``,
the exact inverse of the keep probability: the expectation is the undropped attention.
"""
from __future__ import annotations

import numpy as np

__all__ = ["threshold", "keep_scale", "keep_mask", "factors", "philox4x32"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def threshold(p: float) -> int:
    """The 16-bit threshold of drop probability ``p`` (0 <= p < 1): r16 < threshold drops."""
    return min(int(round(float(p) * 65536)), 65535)


def keep_scale(p: float) -> float:
    """The factor of a kept probability: 1 / (the exact keep probability of the threshold)."""
    return 65536.0 / (65536 - threshold(p))


def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of broadcastable uint32-valued arrays (held as uint64). Returns 4 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _LO for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(int(k0) & 0xFFFFFFFF), np.uint64(int(k1) & 0xFFFFFFFF)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _LO, (k1 + _W1) & _LO
        p0, p1 = _M0 * c0, _M1 * c2          # (32 x 32 -> 64 bits, exact in uint64)
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _LO, (p0 >> _S32) ^ c3 ^ k1, p0 & _LO)
    return c0, c1, c2, c3


def _key_offset(rng_state):
    seed, offset = (int(x) & 0xFFFFFFFFFFFFFFFF for x in np.asarray(rng_state).reshape(2))
    return seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF, offset & 0xFFFFFFFF


def keep_mask(rng_state, p: float, bh, rows, cols) -> np.ndarray:
    """Boolean keep mask of shape ``bh.shape + (len(rows), len(cols))``: ``bh`` an int array of
    ``b * nheads + h`` values, ``rows``/``cols`` the query rows and key columns (sequence
    positions)."""
    k0, k1, off = _key_offset(rng_state)
    thr = threshold(p)
    bh = np.asarray(bh, np.int64)
    rows = np.asarray(rows, np.int64)
    cols = np.asarray(cols, np.int64)
    if thr == 0:
        return np.ones(bh.shape + (rows.size, cols.size), bool)
    ctr0 = 8 * (rows >> 4) + (rows & 7)
    ctr1 = 4 * (cols >> 4) + ((cols >> 1) & 3)
    u0, where0 = np.unique(ctr0, return_inverse=True)
    u1, where1 = np.unique(ctr1, return_inverse=True)
    words = philox4x32(u0[:, None], u1[None, :], bh[..., None, None], off, k0, k1)
    w = np.stack(words, axis=-1)                       # (..., u0, u1, 4)
    wi = 2 * ((rows[:, None] >> 3) & 1) + ((cols[None, :] >> 3) & 1)
    sel = w[..., where0[:, None], where1[None, :], wi]  # (..., rows, cols)
    r16 = (sel >> (16 * (cols & 1)).astype(np.uint64)) & np.uint64(0xFFFF)
    return r16 >= np.uint64(thr)


def factors(rng_state, p: float, bh, rows, cols, dtype=np.float64) -> np.ndarray:
    """The factors of :func:`keep_mask`'s probabilities: 0 where dropped, :func:`keep_scale`
    where kept (same shape)."""
    dt = np.dtype(dtype).type
    return np.where(keep_mask(rng_state, p, bh, rows, cols), dt(keep_scale(p)), dt(0.0))
