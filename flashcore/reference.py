"""The textbook computation and the helpers every backend shares (NumPy only, no GPU).

* ``naive_forward`` / ``naive_backward`` materialise the full score matrix: the oracle that
  every other result (the tiled NumPy path, the CUDA kernels) is judged against.
* ``round_to_dtype`` emulates a computation carried out in float16 / bfloat16 (the second
  reference of the flash-attn correctness rule).
* ``apply_rotary`` is the rotary embedding of the KV-cache path, and ``merge_states`` the
  merge of partial results through their log-sum-exp (split-KV's combine step), each written
  once for any array namespace (``xp``: NumPy or CuPy).
* ``_Scores`` turns a block of Q·Kᵀ into the final, masked scores: scale, softcap, ALiBi and
  the causal / sliding-window mask, the conventions of docs/how-it-works.md in one place.

The tiled FlashAttention algorithm itself is in :mod:`flashcore.backends.numpy_backend`.
"""
from __future__ import annotations

import numpy as np

__all__ = ["naive_forward", "naive_backward", "round_to_dtype", "apply_rotary", "merge_states",
           "round_e4m3", "fp8_dequantize", "fp8_forward"]


def round_to_dtype(x: np.ndarray, dtype: str | None) -> np.ndarray:
    """Round float32 values to float16 / bfloat16 precision (returned as float32).

    Used to emulate a computation carried out in the low precision (the second reference of
    the flash-attn correctness rule). bfloat16 is rounded to nearest-even on the bit pattern.
    """
    if dtype is None or dtype in ("float32", "float64"):
        return x
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        b = x.view(np.uint32).astype(np.uint64)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        return np.where(np.isnan(x), x, out)
    raise ValueError(f"cannot round to {dtype}")


class _Scores:
    """Everything needed to turn Q·Kᵀ of one sequence into the final, masked scores.

    ``slopes`` (ALiBi) has the scores' leading (head) dimensions, the last two (rows, columns)
    left out: (b, h) for scores (b, h, r, c), (b, hk, group) for grouped scores
    (b, hk, group, r, c); None without ALiBi.
    """

    def __init__(self, spec, sq: int, sk: int, slopes: np.ndarray | None):
        self.scale = spec.softmax_scale
        self.softcap = spec.softcap
        self.wl, self.wr = spec.window_left, spec.window_right
        self.sq, self.sk = sq, sk
        self.offset = sk - sq                # bottom-right alignment of the mask
        self.slopes = slopes

    def visible(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """(len(rows), len(cols)) boolean: query row i may see key column j."""
        i = rows[:, None] + self.offset
        j = cols[None, :]
        ok = np.ones((rows.size, cols.size), dtype=bool)
        if self.wl >= 0:
            ok &= j >= i - self.wl
        if self.wr >= 0:
            ok &= j <= i + self.wr
        return ok

    def block_visible(self, r0, r1, c0, c1) -> bool:
        """Whether any (row, col) in [r0, r1) x [c0, c1) is visible: used to skip blocks."""
        if r1 <= r0 or c1 <= c0:
            return False
        if self.wr >= 0 and c0 > (r1 - 1) + self.offset + self.wr:
            return False
        if self.wl >= 0 and c1 - 1 < r0 + self.offset - self.wl:
            return False
        return True

    def block_all_visible(self, r0, r1, c0, c1) -> bool:
        """Whether every (row, col) in [r0, r1) x [c0, c1) is visible: such a block needs no
        mask (as in the kernels, where only the blocks on the diagonal are masked)."""
        if self.wr >= 0 and c1 - 1 > r0 + self.offset + self.wr:
            return False
        if self.wl >= 0 and c0 < (r1 - 1) + self.offset - self.wl:
            return False
        return True

    def __call__(self, s_raw, rows, cols):
        """Raw Q·Kᵀ (..., r, c) -> (final scores with -inf where masked, tanh term or None).

        ``rows`` and ``cols`` are contiguous ranges of positions. ``s_raw`` is overwritten
        (it is always a fresh product): the scores are built in place."""
        s = s_raw
        s *= self.scale
        t = None
        if self.softcap:
            t = np.tanh(s / self.softcap)
            s = np.multiply(t, self.softcap, out=s)
        if self.slopes is not None:
            dist = np.abs(rows[:, None] + self.offset - cols[None, :]).astype(s.dtype)
            s -= self.slopes[..., None, None].astype(s.dtype) * dist
        if rows.size and cols.size and not self.block_all_visible(
                rows[0], rows[-1] + 1, cols[0], cols[-1] + 1):
            np.copyto(s, -np.inf, where=~self.visible(rows, cols))
        return s, t


def _bhsd(x):   # (b, s, h, d) -> (b, h, s, d) view
    return x.transpose(0, 2, 1, 3)


def _expand_kv(x, group):   # (b, hk, s, d) -> (b, h, s, d), query head i uses key head i // group
    return np.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x, group):  # (b, h, s, d) -> (b, hk, s, d), summing the heads that share a key head
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x.reshape(b, h // group, group, s, d).sum(axis=2)


def _slopes_for(spec, alibi_slopes, batch_index=None, batch=None):
    """ALiBi slopes as (batch, nheads) float64 (one row for ``batch_index``), or None."""
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, dtype=np.float64)
    if a.ndim == 1:
        a = np.broadcast_to(a[None, :], (batch if batch_index is None else 1, a.shape[0]))
    elif batch_index is not None:
        a = a[batch_index:batch_index + 1]
    return a


def _safe(m):
    """The running max as used in an exponent: a row that has seen only -inf uses 0, so that
    exp(-inf - 0) = 0 instead of exp(-inf - (-inf)) = NaN. The stored max stays -inf."""
    return np.where(np.isneginf(m), 0.0, m)


# --------------------------------------------------------------------------------------------
# The oracle: full score matrix
# --------------------------------------------------------------------------------------------

def _naive_probs(spec, q, k, v, slopes, r):
    """The whole probability matrix of dense (b, s, h, d) inputs, in (b, h, ...) order.

    Returns (qh, kh, vh, p, t, m, l): kh/vh expanded to the query heads, the tanh term of the
    softcap (or None), the row max and the row sum of exp(s - max). A row with no visible key
    has l = 0 and p = 0; a NaN score gives a NaN row (it is not "nothing visible")."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    qh = _bhsd(q).astype(ct)
    kh = _expand_kv(_bhsd(k).astype(ct), spec.group_size)
    vh = _expand_kv(_bhsd(v).astype(ct), spec.group_size)
    sq, sk = qh.shape[2], kh.shape[2]
    sc = _Scores(spec, sq, sk, slopes)
    s, t = sc(r(qh @ kh.swapaxes(-1, -2)), np.arange(sq), np.arange(sk))
    m = s.max(axis=-1, keepdims=True) if sk else np.full(s.shape[:-1] + (1,), -np.inf, ct)
    p = np.exp(s - _safe(m))
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = r(np.where(l != 0, p / np.where(l != 0, l, 1), 0.0))
    return qh, kh, vh, p, t, m, l


def _rounder(round_to):
    return (lambda x: round_to_dtype(x, round_to)) if round_to else (lambda x: x)


def dropout_factors(spec, rng_state, batch, sq, sk, batch_offset=0, ct=np.float64):
    """(batch, nheads, sq, sk) factors of attention dropout (flashcore.dropout's stream): 0 for
    a dropped probability, 1 / keep probability for a kept one; None without dropout. Batch
    entry z is sequence ``batch_offset + z`` of the call."""
    if not spec.dropout_p:
        return None
    from .dropout import factors
    bh = (batch_offset + np.arange(batch))[:, None] * spec.nheads + np.arange(spec.nheads)
    return factors(rng_state, spec.dropout_p, bh, np.arange(sq), np.arange(sk), ct)


def naive_forward(spec, q, k, v, slopes=None, round_to=None, rng_state=None, batch_offset=0):
    """Dense (b, s, h, d) inputs of one sequence length. Returns (out (b,sq,h,d), lse (b,h,sq)).

    ``round_to`` ('float16'/'bfloat16') rounds every intermediate like a low-precision
    computation would (scores after Q·Kᵀ, probabilities, output). With ``spec.dropout_p``,
    the probabilities are dropped by ``rng_state``'s stream (:func:`dropout_factors`; the
    lse is the undropped one's).
    """
    r = _rounder(round_to)
    _, _, vh, p, _, m, l = _naive_probs(spec, q, k, v, slopes, r)
    z = dropout_factors(spec, rng_state, p.shape[0], p.shape[2], p.shape[3], batch_offset, p.dtype.type)
    out = r((p if z is None else r(p * z)) @ vh)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l != 0, m + np.log(np.where(l != 0, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def round_e4m3(x):
    """``x`` rounded to float8_e4m3fn (round to nearest even; ml_dtypes), in x's dtype."""
    import ml_dtypes
    return x.astype(ml_dtypes.float8_e4m3fn).astype(x.dtype)


def fp8_dequantize(x, descale, nheads_k):
    """float8_e4m3fn ``x`` (b, s, h, d) as float32 values ``x * descale[b, h // (h / nheads_k)]``:
    FlashAttention-3's descales, float32 broadcastable to (batch, nheads_k) (None: 1), per key
    head; a query head takes the descale of the key head it attends with."""
    x32 = x.astype(np.float32)
    if descale is None:
        return x32
    b, _, h, _ = x.shape
    d = np.broadcast_to(np.asarray(descale, np.float32), (b, nheads_k))
    return x32 * np.repeat(d, h // nheads_k, axis=1)[:, None, :, None]


def fp8_forward(spec, q, k, v, descales=(None, None, None), slopes=None):
    """The FP8 forward emulated (FlashAttention-3's computation): q, k, v float8_e4m3fn (b, s,
    h, d), dequantised by ``descales`` (q, k, v; :func:`fp8_dequantize`); the scores in
    float32, P = exp(s - rowmax) rounded to e4m3 for the product with V (what an FP8 ``wgmma``
    takes), the row sums from the unrounded P. Returns (out float32 (b, sq, h, d), lse)."""
    qd, kd, vd = (fp8_dequantize(x, d, spec.nheads_k) for x, d in zip((q, k, v), descales))
    _, _, vh, p, _, m, l = _naive_probs(spec, qd, kd, vd, slopes, lambda x: x)
    with np.errstate(invalid="ignore"):
        pt = p * l                                          # exp(s - rowmax), max 1
    out = (round_e4m3(pt) @ vh) / np.where(l != 0, l, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l != 0, m + np.log(np.where(l != 0, l, 1)), -np.inf)[..., 0]
    return np.where(l != 0, out, 0.0).transpose(0, 2, 1, 3), lse


def naive_backward(spec, dout, q, k, v, slopes=None, round_to=None, rng_state=None,
                   batch_offset=0):
    """The textbook gradient, recomputed from q, k, v alone. Returns (dq, dk, dv).
    With dropout (factors Z): O = (P∘Z)V, so dV = (P∘Z)ᵀdO and dS = P∘(dP∘Z - rowsum(dO∘O))."""
    r = _rounder(round_to)
    g = spec.group_size
    qh, kh, vh, p, t, _, _ = _naive_probs(spec, q, k, v, slopes, r)
    z = dropout_factors(spec, rng_state, p.shape[0], p.shape[2], p.shape[3], batch_offset, p.dtype.type)
    doh = _bhsd(dout).astype(qh.dtype)
    pz = p if z is None else r(p * z)
    dv = pz.swapaxes(-1, -2) @ doh
    dp = r(doh @ vh.swapaxes(-1, -2))
    dpz = dp if z is None else dp * z
    ds = p * (dpz - (pz * dp).sum(axis=-1, keepdims=True))   # softmax Jacobian
    if t is not None:
        ds = ds * (1.0 - t * t)                              # d softcap·tanh(x/softcap) / dx
    ds = r(ds * spec.softmax_scale)
    dq = ds @ kh
    dk = ds.swapaxes(-1, -2) @ qh
    return (dq.transpose(0, 2, 1, 3), _sum_groups(dk, g).transpose(0, 2, 1, 3),
            _sum_groups(dv, g).transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------------------------
# Rotary embedding (the KV-cache path; NumPy or CuPy)
# --------------------------------------------------------------------------------------------

def apply_rotary(x, cos, sin, positions, interleaved, xp=np):
    """Rotary embedding of ``x`` (b, s, h, d) at integer ``positions`` (b, s).

    ``cos``/``sin`` are ``(seqlen_ro, rotary_dim / 2)``; the first ``rotary_dim`` channels
    rotate, the rest pass through. ``interleaved``: channel pairs (0, 1), (2, 3), ... (GPT-J);
    otherwise (i, i + rotary_dim/2) (GPT-NeoX). Computed in float32 (float64 for float64) and
    returned in x's dtype. ``xp`` is the array namespace (numpy or cupy).
    """
    ct = xp.float64 if x.dtype == xp.float64 else xp.float32
    r = 2 * cos.shape[1]
    c = cos[positions].astype(ct)[:, :, None, :]        # (b, s, 1, r/2)
    sn = sin[positions].astype(ct)[:, :, None, :]
    xr = x[..., :r].astype(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = xp.stack([x1 * c - x2 * sn, x1 * sn + x2 * c], axis=-1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., :r // 2], xr[..., r // 2:]
        rot = xp.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], axis=-1)
    return xp.concatenate([rot.astype(x.dtype), x[..., r:]], axis=-1)


# --------------------------------------------------------------------------------------------
# flash-attn's "S_dmask" (return_attn_probs=True): the probabilities, dropout encoded in signs
# --------------------------------------------------------------------------------------------

S_DMASK_BLOCK = 128   # key-block width of the encoding (the conformance shim's _get_block_size_n)


def merge_states(outs, lses, xp=np):
    """``(out, lse)`` of the attention over the union of the key sets of the partial results
    ``outs[i]`` (..., s, h, d) and ``lses[i]`` (..., h, s), validated beforehand (see
    :func:`flashcore.merge_attention_states`, which documents the rule). Computed in float32
    (float64 when an input is float64); out in the dtype of ``outs``. ``xp``: NumPy or CuPy."""
    ct = xp.float64 if xp.float64 in (outs[0].dtype, lses[0].dtype) else xp.float32
    L = xp.stack([xp.asarray(x).astype(ct) for x in lses])             # (n, ..., h, s)
    m = L.max(axis=0)
    m = xp.where(xp.isneginf(m), 0, m).astype(ct)
    ssum = xp.exp(L - m).sum(axis=0)
    lse = xp.where(ssum > 0, m + xp.log(xp.where(ssum > 0, ssum, 1)), -xp.inf).astype(ct)
    w = xp.exp(L - xp.where(xp.isneginf(lse), 0, lse))
    # a part with weight 0 contributes nothing, even if its out holds NaN/garbage
    out = sum(xp.where(xp.swapaxes(wi > 0, -1, -2)[..., None],
                       xp.swapaxes(wi, -1, -2)[..., None] * o.astype(ct), 0)
              for wi, o in zip(w, outs))
    return out.astype(outs[0].dtype), lse


def attn_probs_dmask(spec, q, k, slopes=None, rng_state=None, batch_offset=0,
                     block=S_DMASK_BLOCK):
    """flash-attn's third output of ``return_attn_probs=True`` for dense (b, s, h, d) inputs:
    (b, h, sq, sk) float64 with entry ``exp(s_ij - m_iJ)``, where J is key j's block of
    ``block`` keys and m_iJ the row's running max over blocks J..last (flash-attn's kernels walk
    the key blocks from the last to the first, so that is the max they had subtracted when they
    wrote block J); negative where dropout dropped the probability (-0.0 for a masked one).
    flash-attn's tests normalise it with exactly that convention; it is a test aid, computed
    here on the host."""
    ct = np.float64
    qh = _bhsd(q).astype(ct)
    kh = _expand_kv(_bhsd(k).astype(ct), spec.group_size)
    b, h, sq, sk = qh.shape[0], qh.shape[1], qh.shape[2], kh.shape[2]
    sc = _Scores(spec, sq, sk, slopes)
    s, _ = sc(qh @ kh.swapaxes(-1, -2), np.arange(sq), np.arange(sk))
    nb = -(-sk // block) if sk else 0
    out = np.zeros(s.shape, ct)
    if nb:
        pad = nb * block - sk
        sp = np.pad(s, [(0, 0)] * 3 + [(0, pad)], constant_values=-np.inf)
        bmax = sp.reshape(b, h, sq, nb, block).max(axis=-1)                 # (b, h, sq, nb)
        run = np.maximum.accumulate(bmax[..., ::-1], axis=-1)[..., ::-1]    # max over J..last
        m = np.repeat(run, block, axis=-1)[..., :sk]
        with np.errstate(invalid="ignore"):
            out = np.where(np.isneginf(s), 0.0, np.exp(s - _safe(m)))
    z = dropout_factors(spec, rng_state, b, sq, sk, batch_offset)
    if z is not None:
        out = np.where(z > 0, out, -out)
    return out
