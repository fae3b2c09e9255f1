"""The NumPy backend: the reference algorithm, readable, and the default with no GPU.

Two paths compute the same function:

* ``naive_forward`` / ``naive_backward`` materialise the full score matrix: the textbook
  computation, the oracle every other result is judged against.
* ``tiled_forward`` / ``tiled_backward`` are the FlashAttention algorithm step by step, the
  way the CUDA kernels do it: blocks of queries against blocks of keys, a running max and a
  running sum, the partial output rescaled whenever the max grows, the log-sum-exp (LSE) kept
  instead of the probabilities, and a backward that recomputes the probabilities block by block
  from the LSE. Blocks that the causal mask or the window hide entirely are skipped.

Arrays are handled in (batch, heads, seq, dim) order internally (views of the
(batch, seq, heads, dim) inputs). float16/bfloat16/float32 inputs are computed in float32,
float64 in float64. Varlen batches are processed one sequence at a time.

Decoding with a KV cache (``kvcache_forward``) is the same computation after two plain steps:
the new keys and values (rotated, with rotary) are written into the cache in place, then the
visible keys of each sequence are gathered (from its rows, or from its pages through the block
table) and attended one sequence at a time.
"""
from __future__ import annotations

import numpy as np

from ..spec import AttentionSpec
from .base import Backend, register

__all__ = [
    "NumpyBackend", "naive_forward", "naive_backward", "tiled_forward", "tiled_backward",
    "round_to_dtype", "apply_rotary", "kvcache_append", "kvcache_gather", "kvcache_forward",
    "partial_forward",
]


# --------------------------------------------------------------------------------------------
# Helpers shared by both paths: the score of a (query block, key block) pair
# --------------------------------------------------------------------------------------------

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
    """Everything needed to turn Q·Kᵀ of one sequence into the final, masked scores."""

    def __init__(self, spec: AttentionSpec, sq: int, sk: int, slopes: np.ndarray | None):
        self.scale = spec.softmax_scale
        self.softcap = spec.softcap
        self.wl, self.wr = spec.window_left, spec.window_right
        self.sq, self.sk = sq, sk
        self.offset = sk - sq                # bottom-right alignment of the mask
        self.slopes = slopes                 # (b, h) or None

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

    def __call__(self, s_raw, rows, cols):
        """Raw Q·Kᵀ (b, h, r, c) -> (final scores with -inf where masked, tanh term or None)."""
        s = s_raw * self.scale
        t = None
        if self.softcap:
            t = np.tanh(s / self.softcap)
            s = self.softcap * t
        if self.slopes is not None:
            dist = np.abs(rows[:, None] + self.offset - cols[None, :]).astype(s.dtype)
            s = s - self.slopes[:, :, None, None].astype(s.dtype) * dist
        s = np.where(self.visible(rows, cols), s, -np.inf)
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


def naive_forward(spec, q, k, v, slopes=None, round_to=None):
    """Dense (b, s, h, d) inputs of one sequence length. Returns (out (b,sq,h,d), lse (b,h,sq)).

    ``round_to`` ('float16'/'bfloat16') rounds every intermediate like a low-precision
    computation would (scores after Q·Kᵀ, probabilities, output).
    """
    r = _rounder(round_to)
    _, _, vh, p, _, m, l = _naive_probs(spec, q, k, v, slopes, r)
    out = r(p @ vh)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l != 0, m + np.log(np.where(l != 0, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def naive_backward(spec, dout, q, k, v, slopes=None, round_to=None):
    """The textbook gradient, recomputed from q, k, v alone. Returns (dq, dk, dv)."""
    r = _rounder(round_to)
    g = spec.group_size
    qh, kh, vh, p, t, _, _ = _naive_probs(spec, q, k, v, slopes, r)
    doh = _bhsd(dout).astype(qh.dtype)
    dv = p.swapaxes(-1, -2) @ doh
    dp = r(doh @ vh.swapaxes(-1, -2))
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))   # softmax Jacobian
    if t is not None:
        ds = ds * (1.0 - t * t)                              # d softcap·tanh(x/softcap) / dx
    ds = r(ds * spec.softmax_scale)
    dq = ds @ kh
    dk = ds.swapaxes(-1, -2) @ qh
    return (dq.transpose(0, 2, 1, 3), _sum_groups(dk, g).transpose(0, 2, 1, 3),
            _sum_groups(dv, g).transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------------------------
# The FlashAttention algorithm, tile by tile
# --------------------------------------------------------------------------------------------

def tiled_forward(spec, q, k, v, slopes=None, block_q=64, block_k=64):
    """FlashAttention forward on dense (b, s, h, d) inputs. Returns (out, lse)."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    g = spec.group_size
    qh = _bhsd(q).astype(ct)
    kh = _bhsd(k).astype(ct)
    vh = _bhsd(v).astype(ct)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    sc = _Scores(spec, sq, sk, slopes)
    out = np.zeros((b, h, sq, d), ct)
    lse = np.full((b, h, sq), -np.inf, ct)
    for r0 in range(0, sq, block_q):
        r1 = min(r0 + block_q, sq)
        rows = np.arange(r0, r1)
        qi = qh[:, :, r0:r1]
        m = np.full((b, h, r1 - r0, 1), -np.inf, ct)     # running max of the scores
        l = np.zeros((b, h, r1 - r0, 1), ct)             # running sum of exp(score - m)
        acc = np.zeros((b, h, r1 - r0, d), ct)           # running, unnormalised output
        for c0 in range(0, sk, block_k):
            c1 = min(c0 + block_k, sk)
            if not sc.block_visible(r0, r1, c0, c1):
                continue                                 # hidden by the mask: skip, don't mask
            kj = _expand_kv(kh[:, :, c0:c1], g)
            vj = _expand_kv(vh[:, :, c0:c1], g)
            s, _ = sc(qi @ kj.swapaxes(-1, -2), rows, np.arange(c0, c1))
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            p = np.exp(s - _safe(m_new))
            alpha = np.exp(m - _safe(m_new))             # rescales what was summed so far
            l = alpha * l + p.sum(axis=-1, keepdims=True)
            acc = alpha * acc + p @ vj
            m = m_new
        seen = l != 0   # NaN scores give NaN, not "saw nothing"
        with np.errstate(divide="ignore", invalid="ignore"):
            out[:, :, r0:r1] = np.where(seen, acc / np.where(seen, l, 1), 0.0)
            lse[:, :, r0:r1] = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def tiled_backward(spec, dout, q, k, v, out, lse, slopes=None, block_q=64, block_k=64):
    """FlashAttention backward: P recomputed per block from the LSE. Returns (dq, dk, dv)."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    g = spec.group_size
    qh, kh, vh = _bhsd(q).astype(ct), _bhsd(k).astype(ct), _bhsd(v).astype(ct)
    doh, oh = _bhsd(dout).astype(ct), _bhsd(out).astype(ct)
    lse = np.asarray(lse, ct)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    sc = _Scores(spec, sq, sk, slopes)
    D = (doh * oh).sum(axis=-1)                          # rowsum(dO ∘ O) = rowsum(P ∘ dP)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)   # fully masked row: P = exp(-inf) = 0
    dq = np.zeros((b, h, sq, d), ct)
    dk = np.zeros((b, h, sk, d), ct)
    dv = np.zeros((b, h, sk, d), ct)
    for c0 in range(0, sk, block_k):                     # one key block: dK_j, dV_j stay "on chip"
        c1 = min(c0 + block_k, sk)
        cols = np.arange(c0, c1)
        kj = _expand_kv(kh[:, :, c0:c1], g)
        vj = _expand_kv(vh[:, :, c0:c1], g)
        for r0 in range(0, sq, block_q):
            r1 = min(r0 + block_q, sq)
            if not sc.block_visible(r0, r1, c0, c1):
                continue
            rows = np.arange(r0, r1)
            qi, doi = qh[:, :, r0:r1], doh[:, :, r0:r1]
            s, t = sc(qi @ kj.swapaxes(-1, -2), rows, cols)
            p = np.exp(s - lse_safe[:, :, r0:r1, None])
            dv[:, :, c0:c1] += p.swapaxes(-1, -2) @ doi
            dp = doi @ vj.swapaxes(-1, -2)
            ds = p * (dp - D[:, :, r0:r1, None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * spec.softmax_scale
            dk[:, :, c0:c1] += ds.swapaxes(-1, -2) @ qi
            dq[:, :, r0:r1] += ds @ kj
    return (dq.transpose(0, 2, 1, 3), _sum_groups(dk, g).transpose(0, 2, 1, 3),
            _sum_groups(dv, g).transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------------------------
# Decoding with a KV cache: append (rotary) in place, gather, attend
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


def _cache_rows(spec, block_table, b, positions):
    """Where key positions of sequence b live: an index tuple into a cache array."""
    if not spec.paged:
        return (b, positions)
    ps = spec.page_size
    return (np.asarray(block_table[b])[positions // ps], positions % ps)


def kvcache_append(spec, k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Write k, v (b, s_new, hk, d) into the cache in place at rows cache_seqlens[b] + t."""
    before = np.asarray(cache_seqlens, np.int64)
    for b in range(spec.attn.batch):
        idx = _cache_rows(spec, block_table, b, before[b] + np.arange(spec.seqlen_new))
        k_cache[idx] = k[b]
        v_cache[idx] = v[b]


def kvcache_gather(spec, cache, b, length, block_table=None):
    """The first ``length`` keys (or values) of sequence b, dense: (length, hk, d)."""
    return cache[_cache_rows(spec, block_table, b, np.arange(length))]


def partial_forward(spec, q, k, v, slopes, c0, c1):
    """Attention of dense (1, sq, h, d) q over keys ``c0:c1`` only, of (1, sk, hk, d) k, v.

    Masks and ALiBi use the keys' positions in the whole sequence (sk keys). One partial
    result of split-KV decoding: merged through the LSE it gives the full attention.
    """
    ct = np.float64 if q.dtype == np.float64 else np.float32
    g = spec.group_size
    qh = _bhsd(q).astype(ct)
    kh = _expand_kv(_bhsd(k[:, c0:c1]).astype(ct), g)
    vh = _expand_kv(_bhsd(v[:, c0:c1]).astype(ct), g)
    sq, sk = qh.shape[2], k.shape[1]
    sc = _Scores(spec, sq, sk, slopes)
    s, _ = sc(qh @ kh.swapaxes(-1, -2), np.arange(sq), np.arange(c0, c1))
    m = s.max(axis=-1, keepdims=True) if c1 > c0 else np.full(s.shape[:-1] + (1,), -np.inf, ct)
    p = np.exp(s - _safe(m))
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l != 0, (p @ vh) / np.where(l != 0, l, 1), 0.0)
        lse = np.where(l != 0, m + np.log(np.where(l != 0, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def kvcache_forward(spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                    block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None,
                    attend=None):
    """The reference KV-cache decoding step on NumPy arrays. Returns ``(out, lse)``.

    1. With k, v: rotate k (rotary), write k, v into the cache in place at cache_seqlens.
    2. Rotate q (at cache_seqlens + i with causal or a window, else at cache_seqlens).
    3. Per sequence b: gather its cache_seqlens[b] + seqlen_new keys and values (from the
       pages named by block_table when paged) and attend. With ``num_splits > 1`` the keys are
       cut into that many chunks, attended separately and merged through their LSE (the
       split-KV scheme of the kernels); otherwise ``attend(spec, q, k, v, slopes)`` (default
       :func:`tiled_forward`) runs on the whole sequence.
    """
    a = spec.attn
    attend = attend or (lambda sp, q_, k_, v_, sl: tiled_forward(sp, q_, k_, v_, sl))
    batch, sq = a.batch, a.seqlen_q
    if spec.cache_seqlens_int is not None:
        before = np.full((batch,), spec.cache_seqlens_int, np.int64)
    else:
        before = np.asarray(cache_seqlens).astype(np.int64)
    rotary = rotary_cos is not None
    if spec.appends:
        if rotary:
            pos = before[:, None] + np.arange(spec.seqlen_new)[None, :]
            k = apply_rotary(k, rotary_cos, rotary_sin, pos, spec.rotary_interleaved)
        kvcache_append(spec, k_cache, v_cache, k, v, before, block_table)
    if rotary:
        pos = before[:, None] + (np.arange(sq)[None, :] if spec.rotary_per_row else
                                 np.zeros((1, sq), np.int64))
        q = apply_rotary(q, rotary_cos, rotary_sin, pos, spec.rotary_interleaved)
    after = before + spec.seqlen_new

    ct = np.float64 if a.dtype == "float64" else np.float32
    out = np.zeros((batch, sq, a.nheads, a.headdim), ct)
    lse = np.full((batch, a.nheads, sq), -np.inf, ct)
    for b in range(batch):
        n = int(after[b])
        kb = kvcache_gather(spec, k_cache, b, n, block_table)[None]
        vb = kvcache_gather(spec, v_cache, b, n, block_table)[None]
        slopes = _slopes_for(a, alibi_slopes, b)
        if spec.num_splits > 1 and n:
            from ..api import merge_attention_states
            step = -(-n // spec.num_splits)
            parts = [partial_forward(a, q[b:b + 1], kb, vb, slopes, c0, min(c0 + step, n))
                     for c0 in range(0, n, step)]
            o, l = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
        else:
            o, l = attend(a, q[b:b + 1], kb, vb, slopes)
        out[b], lse[b] = o[0], l[0]
    return out, lse


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------

def _per_sequence(spec, cu_q, cu_k):
    cq, ck = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    for i in range(spec.batch):
        yield i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])


def _out_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # noqa: F401  (only reached when the input already was bfloat16)
        return np.dtype("bfloat16")
    return np.dtype(dtype)


class NumpyBackend(Backend):
    """Runs the tiled FlashAttention algorithm in NumPy (``path='naive'`` for the oracle)."""

    name = "numpy"
    libraries = ("numpy",)
    dtypes = ("float16", "bfloat16", "float32", "float64")
    supports_kvcache = True

    def __init__(self, path: str = "tiled", block_q: int = 64, block_k: int = 64):
        self.path, self.block_q, self.block_k = path, block_q, block_k

    def info(self):
        return {"numpy": np.__version__}

    def _fwd(self, spec, q, k, v, slopes):
        if self.path == "naive":
            return naive_forward(spec, q, k, v, slopes)
        return tiled_forward(spec, q, k, v, slopes, self.block_q, self.block_k)

    def _bwd(self, spec, dout, q, k, v, out, lse, slopes):
        if self.path == "naive":
            return naive_backward(spec, dout, q, k, v, slopes)
        return tiled_backward(spec, dout, q, k, v, out, lse, slopes, self.block_q, self.block_k)

    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None):
        odt = _out_dtype(spec.dtype)
        lse_dt = np.float64 if spec.dtype == "float64" else np.float32
        if not spec.varlen:
            out, lse = self._fwd(spec, q, k, v, _slopes_for(spec, alibi_slopes, batch=spec.batch))
            return out.astype(odt), lse.astype(lse_dt)
        out = np.zeros(q.shape, odt)
        lse = np.full((spec.nheads, q.shape[0]), -np.inf, lse_dt)
        for i, sq_, sk_ in _per_sequence(spec, cu_seqlens_q, cu_seqlens_k):
            o, l = self._fwd(spec, q[None, sq_], k[None, sk_], v[None, sk_],
                             _slopes_for(spec, alibi_slopes, i))
            out[sq_] = o[0]
            lse[:, sq_] = l[0]
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None):
        if not spec.varlen:
            dq, dk, dv = self._bwd(spec, dout, q, k, v, out, lse,
                                   _slopes_for(spec, alibi_slopes, batch=spec.batch))
            return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
        dq, dk, dv = (np.zeros(x.shape, x.dtype) for x in (q, k, v))
        for i, sq_, sk_ in _per_sequence(spec, cu_seqlens_q, cu_seqlens_k):
            g = self._bwd(spec, dout[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_],
                          out[None, sq_], lse[None, :, sq_], _slopes_for(spec, alibi_slopes, i))
            dq[sq_], dk[sk_], dv[sk_] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv

    def forward_kvcache(self, spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                        block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None):
        """:func:`kvcache_forward` with this backend's path; out in q's dtype."""
        out, lse = kvcache_forward(spec, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   block_table=block_table, rotary_cos=rotary_cos,
                                   rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                                   attend=self._fwd)
        lse_dt = np.float64 if spec.attn.dtype == "float64" else np.float32
        return out.astype(_out_dtype(spec.attn.dtype)), lse.astype(lse_dt)


register(NumpyBackend())
