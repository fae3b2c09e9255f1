"""Attention dropout's random stream: one definition, shared by the NumPy reference and the CUDA
kernels (``cuda/flash_dropout.cuh`` computes the same function), so that CPU and GPU drop the
same probabilities and the backward regenerates the forward's mask with nothing stored.

The stream is Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC'11; the generator torch and flash-attn use) with 7 rounds, as flash-attn draws it (7 is the
fewest rounds with which Philox4x32 passes the BigCrush battery), counter-based: the bits of a
probability depend only on its coordinates and on the call's ``rng_state``, an int64 pair
``(seed, offset)``.

Probability (batch b, query head h, query row i, key column j) of a call with ``nheads`` query
heads -- rows and columns counted from the start of the sequence (varlen: b is the sequence
index, i and j positions inside it) -- is kept iff ``r8 >= threshold``, where

* key     = (seed mod 2^32, (seed >> 32) xor (offset >> 32)),
* counter = (4 * (i >> 4) + ((i >> 1) & 3), 4 * (j >> 4) + ((j >> 1) & 3), b * nheads + h,
  offset mod 2^32),
* r8      = byte ``2 * (i & 1) + (j & 1)`` of output word ``2 * ((i >> 3) & 1) + ((j >> 3) & 1)``
  of Philox(counter, key).

(One Philox call thus covers a 4 x 4 group of a 16 x 16 tile: queries i, i + 1, i + 8, i + 9 and
keys j, j + 1, j + 8, j + 9. A GPU thread holds half of such a group in the mma fragments of
either orientation (scores with rows = queries, as the forward computes them, or rows = keys, as
the backward's dK/dV kernels do), its neighbour lane the other half; each lane of a pair draws
the call of one of two tiles and they swap halves, so every pass draws one call per 16
probabilities.)

``threshold = round(p * 256)``, at least 1 for ``p > 0`` and at most 255: the drop probability
is ``threshold / 256`` -- ``p`` rounded to a multiple of 1/256, as flash-attn rounds it (8 random
bits per probability; :func:`effective_p` gives it) -- and a kept probability is scaled by
``1 / (1 - p)``, as flash-attn scales it (its own tests rebuild the output that way from the
returned mask). So the output's expectation is the undropped attention times
``(1 - effective_p(p)) / (1 - p)``, which differs from 1 by at most ``d / (1 - p)`` with
``d = |effective_p(p) - p|`` <= 1/512 (1/256 for p below 1/512): 0.2% at p = 0.1.
"""
from __future__ import annotations

import numpy as np

__all__ = ["threshold", "keep_scale", "effective_p", "keep_mask", "factors", "philox4x32",
           "ROUNDS"]

ROUNDS = 7   # Philox rounds of the stream

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def threshold(p: float) -> int:
    """The 8-bit threshold of drop probability ``p`` (0 <= p < 1): r8 < threshold drops."""
    p = float(p)
    if p <= 0.0:
        return 0
    return min(max(int(round(p * 256)), 1), 255)


def keep_scale(p: float) -> float:
    """The factor of a kept probability: ``1 / (1 - p)`` (flash-attn's)."""
    return 1.0 / (1.0 - float(p))


def effective_p(p: float) -> float:
    """The drop probability that dropout ``p`` applies: ``p`` rounded to a multiple of 1/256
    (at least 1/256 when ``p > 0``), as flash-attn rounds it."""
    return threshold(p) / 256.0


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = ROUNDS):
    """Philox4x32 (``rounds`` rounds; the stream's :data:`ROUNDS` by default, Random123's 10 for
    its known answers) of broadcastable uint32-valued arrays (held as uint64). Returns 4 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _LO for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(int(k0) & 0xFFFFFFFF), np.uint64(int(k1) & 0xFFFFFFFF)
    for r in range(rounds):
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
    ctr0 = 4 * (rows >> 4) + ((rows >> 1) & 3)
    ctr1 = 4 * (cols >> 4) + ((cols >> 1) & 3)
    u0, where0 = np.unique(ctr0, return_inverse=True)
    u1, where1 = np.unique(ctr1, return_inverse=True)
    words = philox4x32(u0[:, None], u1[None, :], bh[..., None, None], off, k0, k1)
    w = np.stack(words, axis=-1)                       # (..., u0, u1, 4)
    wi = 2 * ((rows[:, None] >> 3) & 1) + ((cols[None, :] >> 3) & 1)
    sel = w[..., where0[:, None], where1[None, :], wi]  # (..., rows, cols)
    byte = 2 * (rows[:, None] & 1) + (cols[None, :] & 1)
    r8 = (sel >> (8 * byte).astype(np.uint64)) & np.uint64(0xFF)
    return r8 >= np.uint64(thr)


def factors(rng_state, p: float, bh, rows, cols, dtype=np.float64) -> np.ndarray:
    """The factors of :func:`keep_mask`'s probabilities: 0 where dropped, :func:`keep_scale`
    where kept (same shape)."""
    dt = np.dtype(dtype).type
    return np.where(keep_mask(rng_state, p, bh, rows, cols), dt(keep_scale(p)), dt(0.0))
