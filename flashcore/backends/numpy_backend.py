"""The NumPy backend: the reference algorithm, readable, and the default with no GPU.

Two paths compute the same function:

* ``naive_forward`` / ``naive_backward`` materialise the full score matrix: the textbook
  computation, the oracle every other result is judged against.
* ``tiled_forward`` / ``tiled_backward`` are the FlashAttention algorithm step by step, the
  way the CUDA kernels do it: blocks of queries against blocks of keys, a running max and a
  running sum, the partial output rescaled whenever the max grows, the log-sum-exp (LSE) kept
  instead of the probabilities, and a backward that recomputes the probabilities block by block
  from the LSE. Blocks that the causal mask or the window hide entirely are skipped.

The tiled path copies its inputs once into (batch, kv heads, group, seq, dim) order (the query
heads that share a key head side by side: GQA without repeating K and V) and works on one
sequence at a time with all its heads at once, in tiles of 256 x 256: each step is one batched
NumPy operation and each product a BLAS-sized matrix multiply, with BLAS on one thread
(threadpoolctl). A large call spreads its (sequence, key head) units over the CPU's cores, as
the CUDA grid spreads its blocks over the SMs: the tiles of each unit are the same, in the
same order, so the result is too. float16/bfloat16/float32 inputs are computed in float32,
float64 in float64. Varlen batches are processed one sequence at a time. The oracle and the
helpers every backend shares (``naive_*``, ``round_to_dtype``, ``apply_rotary``) live in
:mod:`flashcore.reference`: import them from there.

Decoding with a KV cache (``kvcache_forward``) is the same computation after two plain steps:
the new keys and values (rotated, with rotary) are written into the cache in place, then the
visible keys of each sequence are gathered (from its rows, or from its pages through the block
table) and attended one sequence at a time.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import os
import threading

import numpy as np

from ..reference import (_bhsd, _expand_kv, _safe, _Scores, _slopes_for, apply_rotary,
                         fp8_dequantize, fp8_forward, merge_states, naive_backward,
                         naive_forward, round_e4m3)
from .base import Backend, register

__all__ = [
    "NumpyBackend", "tiled_forward", "tiled_backward", "kvcache_append", "kvcache_gather",
    "kvcache_forward", "partial_forward", "paged_gather",
]


# --------------------------------------------------------------------------------------------
# Tiles and their pieces
# --------------------------------------------------------------------------------------------

#: Tile sizes of the NumPy path: large enough that each product is a BLAS-sized matrix
#: multiply (a 64 x 64 tile spent most of its time in NumPy's per-call overhead), small enough
#: that a tile of scores for all heads of a sequence stays a few MB.
BLOCK_Q = BLOCK_K = 256


def _grouped(x, nheads_k, ct):
    """(b, s, h, d) -> (b, nheads_k, group, s, d), contiguous, in the compute type ``ct``.

    Query head i = kv head i // group, position i % group: the heads that share a key head sit
    side by side, so one key block serves the whole group through broadcasting (never copied
    per query head). For k and v (h = nheads_k) the group axis has length 1."""
    b, s, h, d = x.shape
    heads = np.ascontiguousarray(_bhsd(x), dtype=ct)          # (b, h, s, d)
    return heads.reshape(b, nheads_k, h // nheads_k, s, d)


def _ungrouped(x):   # (b, hk, group, s, ...) -> (b, h, s, ...)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _tile_dropout(spec, rng_state, z, heads, g, rows, cols, ct):
    """Dropout factors of one (key heads, g, rows, cols) tile of sequence z, ``heads`` a slice
    of the key heads (None without dropout)."""
    if not spec.dropout_p:
        return None
    from ..dropout import factors
    bh = z * spec.nheads + np.arange(heads.start * g, heads.stop * g).reshape(-1, g)
    return factors(rng_state, spec.dropout_p, bh, rows, cols, ct)


def _group_slopes(slopes, z, hk, g, heads):
    """ALiBi slopes of sequence z's key heads ``heads``, (key heads, g), or None."""
    return None if slopes is None else np.asarray(slopes[z]).reshape(hk, g)[heads]


# --------------------------------------------------------------------------------------------
# Over the CPU's cores: (sequence, key head) units, like the CUDA grid's blocks
# --------------------------------------------------------------------------------------------

#: From this many floating-point operations (4·b·h·s_q·s_k·d, a few ms of work) a call's units
#: are spread over a thread pool; below it they run on the calling thread.
PARALLEL_MIN_FLOPS = 1e8


class _OneBlasThread:
    """BLAS on one thread while a call's tiles run (process-wide, through threadpoolctl;
    concurrent and nested users share one limit, the last one out restores the original).

    The units are the parallelism: NumPy releases the GIL in its matrix products and
    element-wise loops. BLAS threading inside each tile's small product (256 x 256 x d)
    instead synchronises its threads once per product: thousands of times a call, and on a
    machine whose cores are busy each synchronisation waits for a descheduled thread (measured
    5-9x slower than one thread on a loaded 2-core machine)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._controller = None
        self._limited = None

    @staticmethod
    def available() -> bool:
        return importlib.util.find_spec("threadpoolctl") is not None

    def __enter__(self):
        with self._lock:
            if self._users == 0:
                if self._controller is None:
                    from threadpoolctl import ThreadpoolController
                    self._controller = ThreadpoolController()
                self._limited = self._in_control(
                    lambda: self._controller.limit(limits=1, user_api="blas"))
            self._users += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._in_control(self._limited.restore_original_limits)
                self._limited = None

    def _in_control(self, action):
        """action() as the thread in control of the BLAS libraries' thread counts. threadpoolctl
        (3.8) lets one thread at a time change a pthreads OpenBLAS's count and silently ignores
        the others: a limit set by one caller would then never be restored by the last one out
        (another thread). The changes are serialised by our lock; control is taken for the
        change and given up after it."""
        clears = [c.clear_controlling_thread for c in self._controller.lib_controllers
                  if hasattr(c, "clear_controlling_thread")]
        for clear in clears:
            clear(force=True)
        try:
            return action()
        finally:
            for clear in clears:
                clear()


_ONE_BLAS_THREAD = _OneBlasThread()


def _workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _for_each_unit(fn, batch, nheads_k, flops):
    """Run ``fn(z, heads)`` over every sequence z, ``heads`` a slice of the key heads (their
    query heads come with them). The units write disjoint parts of the outputs and each runs
    its tiles in order: however they are scheduled, a call gives the same bits run after run
    (``deterministic`` holds).

    * A large call with at least one unit per core: one key head per unit, over a thread pool
      of one worker per core, BLAS on one thread.
    * A small call: every head of a sequence at once on the calling thread, BLAS on one thread
      (its small products gain nothing from BLAS's threads and lose much on a busy machine).
    * A large call with fewer units than cores (or no threadpoolctl): every head of a sequence
      at once on the calling thread, with BLAS's threads as they are: the products' own
      threads are then the only parallelism there is."""
    workers = _workers()
    units = batch * nheads_k
    large = flops >= PARALLEL_MIN_FLOPS and workers > 1
    if not _ONE_BLAS_THREAD.available() or (large and units < workers):
        for z in range(batch):
            fn(z, slice(0, nheads_k))
        return
    with _ONE_BLAS_THREAD:
        if not large:
            for z in range(batch):
                fn(z, slice(0, nheads_k))
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            running = [pool.submit(fn, z, slice(j, j + 1))
                       for z in range(batch) for j in range(nheads_k)]
            for r in running:
                r.result()              # re-raises a unit's exception


# --------------------------------------------------------------------------------------------
# The FlashAttention algorithm, tile by tile
# --------------------------------------------------------------------------------------------

def tiled_forward(spec, q, k, v, slopes=None, block_q=BLOCK_Q, block_k=BLOCK_K, rng_state=None,
                  batch_offset=0, p_e4m3=False):
    """FlashAttention forward on dense (b, s, h, d) inputs. Returns (out, lse).

    Per sequence and key heads (with the query heads of their groups): every step below is one
    batched operation over (key heads, group) of (block_q, block_k) score tiles. Dropout
    (``spec.dropout_p``) scales the probabilities that multiply V, not the row sums: the lse
    is the undropped one. ``p_e4m3`` (the FP8 forward): the probabilities that multiply V are
    rounded to float8_e4m3fn, as an FP8 ``wgmma`` takes them; the row sums are not."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qg = _grouped(q, hk, ct)              # (b, hk, g, sq, d)
    kg = _grouped(k, hk, ct)              # (b, hk, 1, sk, d)
    vg = _grouped(v, hk, ct)
    out = np.zeros((b, hk, g, sq, d), ct)
    lse = np.full((b, hk, g, sq), -np.inf, ct)

    def attend(z, heads):                 # sequence z, key heads `heads`
        sc = _Scores(spec, sq, sk, _group_slopes(slopes, z, hk, g, heads))
        qz, kz, vz = qg[z, heads], kg[z, heads], vg[z, heads]
        n = qz.shape[0]
        for r0 in range(0, sq, block_q):
            r1 = min(r0 + block_q, sq)
            rows = np.arange(r0, r1)
            qi = qz[:, :, r0:r1]                            # (n, g, rows, d)
            m = np.full((n, g, r1 - r0, 1), -np.inf, ct)   # running max of the scores
            l = np.zeros((n, g, r1 - r0, 1), ct)           # running sum of exp(score - m)
            acc = np.zeros((n, g, r1 - r0, d), ct)         # running, unnormalised output
            for c0 in range(0, sk, block_k):
                c1 = min(c0 + block_k, sk)
                if not sc.block_visible(r0, r1, c0, c1):
                    continue                                 # hidden by the mask: skip, don't mask
                kj, vj = kz[:, :, c0:c1], vz[:, :, c0:c1]
                s, _ = sc(qi @ kj.swapaxes(-1, -2), rows, np.arange(c0, c1))
                m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
                m_safe = _safe(m_new)
                p = np.exp(np.subtract(s, m_safe, out=s), out=s)
                alpha = np.exp(m - m_safe)                   # rescales what was summed so far
                l = alpha * l + p.sum(axis=-1, keepdims=True)
                acc *= alpha
                zf = _tile_dropout(spec, rng_state, batch_offset + z, heads, g, rows,
                                   np.arange(c0, c1), ct)
                if p_e4m3:
                    p = round_e4m3(p)
                acc += (p if zf is None else p * zf) @ vj
                m = m_new
            seen = l != 0   # NaN scores give NaN, not "saw nothing"
            with np.errstate(divide="ignore", invalid="ignore"):
                out[z, heads, :, r0:r1] = np.where(seen, acc / np.where(seen, l, 1), 0.0)
                lse[z, heads, :, r0:r1] = np.where(seen, m + np.log(np.where(seen, l, 1)),
                                                   -np.inf)[..., 0]

    _for_each_unit(attend, b, hk, 4.0 * b * h * sq * sk * d)
    return _ungrouped(out).transpose(0, 2, 1, 3), _ungrouped(lse)


def tiled_backward(spec, dout, q, k, v, out, lse, slopes=None, block_q=BLOCK_Q, block_k=BLOCK_K,
                   rng_state=None, batch_offset=0):
    """FlashAttention backward: P recomputed per block from the LSE. Returns (dq, dk, dv).

    Layout as in :func:`tiled_forward`. dK and dV of a key block sum over the query heads of
    its group inside the matrix product: the group and row axes of P (and dS) merge into one."""
    ct = np.float64 if q.dtype == np.float64 else np.float32
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    qg, dog, og = (_grouped(x, hk, ct) for x in (q, dout, out))       # (b, hk, g, sq, d)
    kg, vg = _grouped(k, hk, ct), _grouped(v, hk, ct)                # (b, hk, 1, sk, d)
    lse = np.asarray(lse, ct).reshape(b, hk, g, sq)
    D = (dog * og).sum(axis=-1)                          # rowsum(dO ∘ O) = rowsum(P ∘ dP)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)   # fully masked row: P = exp(-inf) = 0
    dq = np.zeros((b, hk, g, sq, d), ct)
    dk = np.zeros((b, hk, sk, d), ct)
    dv = np.zeros((b, hk, sk, d), ct)

    def grads(z, heads):                  # sequence z, key heads `heads`
        sc = _Scores(spec, sq, sk, _group_slopes(slopes, z, hk, g, heads))
        qz, doz, kz, vz = qg[z, heads], dog[z, heads], kg[z, heads], vg[z, heads]
        lz, Dz = lse_safe[z, heads], D[z, heads]
        dqz, dkz, dvz = dq[z, heads], dk[z, heads], dv[z, heads]     # views: written in place
        nk = qz.shape[0]
        for c0 in range(0, sk, block_k):                 # one key block: dK_j, dV_j stay "on chip"
            c1 = min(c0 + block_k, sk)
            cols = np.arange(c0, c1)
            kj, vj = kz[:, :, c0:c1], vz[:, :, c0:c1]               # (nk, 1, cols, d)
            for r0 in range(0, sq, block_q):
                r1 = min(r0 + block_q, sq)
                if not sc.block_visible(r0, r1, c0, c1):
                    continue
                n = g * (r1 - r0)                        # rows of the group, merged
                qi, doi = qz[:, :, r0:r1], doz[:, :, r0:r1]          # (nk, g, rows, d)
                s, t = sc(qi @ kj.swapaxes(-1, -2), np.arange(r0, r1), cols)
                p = np.exp(np.subtract(s, lz[:, :, r0:r1, None], out=s), out=s)
                zf = _tile_dropout(spec, rng_state, batch_offset + z, heads, g,
                                   np.arange(r0, r1), cols, ct)
                pz = p if zf is None else p * zf
                dvz[:, c0:c1] += pz.reshape(nk, n, -1).swapaxes(-1, -2) @ doi.reshape(nk, n, d)
                dp = doi @ vj.swapaxes(-1, -2)
                if zf is not None:
                    dp *= zf
                ds = p * (dp - Dz[:, :, r0:r1, None])
                if t is not None:
                    ds *= 1.0 - t * t
                ds *= spec.softmax_scale
                dkz[:, c0:c1] += ds.reshape(nk, n, -1).swapaxes(-1, -2) @ qi.reshape(nk, n, d)
                dqz[:, :, r0:r1] += ds @ kj

    _for_each_unit(grads, b, hk, 10.0 * b * h * sq * sk * d)
    return (_ungrouped(dq).transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3),
            dv.transpose(0, 2, 1, 3))


# --------------------------------------------------------------------------------------------
# Decoding with a KV cache: append (rotary) in place, gather, attend
# --------------------------------------------------------------------------------------------

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


def partial_forward(spec, q, k, v, slopes, c0, c1, keep=None):
    """Attention of dense (1, sq, h, d) q over keys ``c0:c1`` only, of (1, sk, hk, d) k, v.

    Masks and ALiBi use the keys' positions in the whole sequence (sk keys). One partial
    result of split-KV decoding: merged through the LSE it gives the full attention.
    ``keep``: None, or bool (sk,): keys where it is False are masked out as well.
    """
    ct = np.float64 if q.dtype == np.float64 else np.float32
    g = spec.group_size
    qh = _bhsd(q).astype(ct)
    kh = _expand_kv(_bhsd(k[:, c0:c1]).astype(ct), g)
    vh = _expand_kv(_bhsd(v[:, c0:c1]).astype(ct), g)
    sq, sk = qh.shape[2], k.shape[1]
    sc = _Scores(spec, sq, sk, slopes)
    s, _ = sc(qh @ kh.swapaxes(-1, -2), np.arange(sq), np.arange(c0, c1))
    if keep is not None:
        s = np.where(np.asarray(keep[c0:c1], bool), s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if c1 > c0 else np.full(s.shape[:-1] + (1,), -np.inf, ct)
    p = np.exp(s - _safe(m))
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(l != 0, (p @ vh) / np.where(l != 0, l, 1), 0.0)
        lse = np.where(l != 0, m + np.log(np.where(l != 0, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def kvcache_forward(spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                    block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None,
                    attend=None, cache_leftpad=None, k_descale=None, v_descale=None,
                    key_mask=None):
    """The reference KV-cache decoding step on NumPy arrays. Returns ``(out, lse)``.

    1. With k, v: rotate k (rotary), write k, v into the cache in place at cache_seqlens.
    2. Rotate q (at cache_seqlens + i with causal or a window, else at cache_seqlens).
    3. Per sequence b: gather its cache_seqlens[b] + seqlen_new keys and values (from the
       pages named by block_table when paged) and attend. With ``num_splits > 1`` the keys are
       cut into that many chunks, attended separately and merged through their LSE (the
       split-KV scheme of the kernels); otherwise ``attend(spec, q, k, v, slopes)`` (default
       :func:`tiled_forward`) runs on the whole sequence.

    ``cache_leftpad`` (flash-attn's): sequence b's keys are rows ``cache_leftpad[b]`` to
    ``cache_seqlens[b] + seqlen_new`` of its cache (masks and ALiBi count from its first key);
    the new keys are still written, and rotated, at rows ``cache_seqlens[b] + t``.

    ``key_mask`` (bool (batch, capacity)): key t of sequence b (from row 0 of its cache) is
    attended only where ``key_mask[b, t]``; such calls are computed by :func:`partial_forward`
    (split as above when ``num_splits > 1``), whatever ``attend`` is.

    An FP8 cache (``spec.fp8``: float8_e4m3fn, read only): each sequence's gathered keys and
    values are dequantised to float32, ``x * descale[b, key head]`` (``k_descale``/``v_descale``
    None or broadcastable to (batch, nheads_k); :func:`flashcore.reference.fp8_dequantize`),
    then attended as above.
    """
    a = spec.attn
    attend = attend or (lambda sp, q_, k_, v_, sl: tiled_forward(sp, q_, k_, v_, sl))
    batch, sq = a.batch, a.seqlen_q
    if spec.cache_seqlens_int is not None:
        before = np.full((batch,), spec.cache_seqlens_int, np.int64)
    else:
        before = np.asarray(cache_seqlens).astype(np.int64)
    lp = np.zeros((batch,), np.int64) if cache_leftpad is None else \
        np.asarray(cache_leftpad).astype(np.int64)
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
        first = int(lp[b])
        kb = kvcache_gather(spec, k_cache, b, n, block_table)[None, first:]
        vb = kvcache_gather(spec, v_cache, b, n, block_table)[None, first:]
        if spec.fp8:          # (float32 values: the descales of sequence b's key heads)
            kb, vb = (fp8_dequantize(x, None if d is None else _descale_row(d, a, b), a.nheads_k)
                      for x, d in ((kb, k_descale), (vb, v_descale)))
        keep = None if key_mask is None else np.asarray(key_mask)[b, first:n]
        n -= first
        slopes = _slopes_for(a, alibi_slopes, b)
        if spec.num_splits > 1 and n:
            step = -(-n // spec.num_splits)
            parts = [partial_forward(a, q[b:b + 1], kb, vb, slopes, c0, min(c0 + step, n), keep)
                     for c0 in range(0, n, step)]
            o, l = merge_states([p[0] for p in parts], [p[1] for p in parts])
        elif keep is not None:
            o, l = partial_forward(a, q[b:b + 1], kb, vb, slopes, 0, n, keep)
        else:
            o, l = attend(a, q[b:b + 1], kb, vb, slopes)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _descale_row(d, a, b):
    """Row b of a descale broadcastable to (batch, nheads_k): (1, nheads_k)."""
    return np.broadcast_to(np.asarray(d, np.float32), (a.batch, a.nheads_k))[b:b + 1]


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------

def paged_gather(cache, block_table, cu_seqlens_k, page_size):
    """The packed (cu_seqlens_k[-1], h_k, d) keys (or values) of a paged cache: row
    ``cu_seqlens_k[b] + t`` is row ``t % page_size`` of block ``block_table[b, t // page_size]``."""
    ck = np.asarray(cu_seqlens_k, np.int64)
    bt = np.asarray(block_table, np.int64)
    rows = []
    for b in range(bt.shape[0]):
        t = np.arange(ck[b + 1] - ck[b])
        rows.append(bt[b, t // page_size] * page_size + t % page_size)
    flat = cache.reshape(-1, *cache.shape[2:])
    return flat[np.concatenate(rows) if rows else np.zeros(0, np.int64)]


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
    dtypes = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn")
    supports_kvcache = True
    supports_fp8_kvcache = True

    def __init__(self, path: str = "tiled", block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
        self.path, self.block_q, self.block_k = path, block_q, block_k

    def info(self):
        return {"numpy": np.__version__}

    def _fwd(self, spec, q, k, v, slopes, rng_state=None, batch_offset=0, descales=None):
        if descales is not None:     # float8_e4m3fn inputs: dequantised, P rounded to e4m3
            if self.path == "naive":
                return fp8_forward(spec, q, k, v, descales, slopes)
            q, k, v = (fp8_dequantize(x, d, spec.nheads_k) for x, d in zip((q, k, v), descales))
            return tiled_forward(spec, q, k, v, slopes, self.block_q, self.block_k,
                                 batch_offset=batch_offset, p_e4m3=True)
        if self.path == "naive":
            return naive_forward(spec, q, k, v, slopes, rng_state=rng_state,
                                 batch_offset=batch_offset)
        return tiled_forward(spec, q, k, v, slopes, self.block_q, self.block_k, rng_state,
                             batch_offset)

    def _bwd(self, spec, dout, q, k, v, out, lse, slopes, rng_state=None, batch_offset=0):
        if self.path == "naive":
            return naive_backward(spec, dout, q, k, v, slopes, rng_state=rng_state,
                                  batch_offset=batch_offset)
        return tiled_backward(spec, dout, q, k, v, out, lse, slopes, self.block_q, self.block_k,
                              rng_state, batch_offset)

    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                block_table=None, out_fp32=False, rng_state=None, descales=None,
                fp8_out="bfloat16"):
        """``descales`` (q, k, v; each None or float32 broadcastable to (batch, nheads_k)) with
        float8_e4m3fn inputs, whose output is ``fp8_out``."""
        if block_table is not None:      # varlen over a paged cache: gather, then as packed
            k, v = (paged_gather(x, block_table, cu_seqlens_k, spec.page_size) for x in (k, v))
            spec = dataclasses.replace(spec, page_size=0, num_blocks=0, total_k=k.shape[0])
        fp8 = spec.dtype == "float8_e4m3fn"
        if fp8 and descales is None:
            descales = (None, None, None)
        odt = _out_dtype(fp8_out) if fp8 else \
            np.dtype(np.float32) if out_fp32 else _out_dtype(spec.dtype)
        lse_dt = np.float64 if spec.dtype == "float64" else np.float32
        if not spec.varlen:
            out, lse = self._fwd(spec, q, k, v, _slopes_for(spec, alibi_slopes, batch=spec.batch),
                                 rng_state, descales=descales if fp8 else None)
            return out.astype(odt), lse.astype(lse_dt)
        out = np.zeros(q.shape, odt)
        lse = np.full((spec.nheads, q.shape[0]), -np.inf, lse_dt)
        for i, sq_, sk_ in _per_sequence(spec, cu_seqlens_q, cu_seqlens_k):
            # (FP8: sequence i takes row i of each descale)
            ds = None if not fp8 else tuple(
                None if d is None else np.broadcast_to(d, (spec.batch, spec.nheads_k))[i:i + 1]
                for d in descales)
            o, l = self._fwd(spec, q[None, sq_], k[None, sk_], v[None, sk_],
                             _slopes_for(spec, alibi_slopes, i), rng_state, i, descales=ds)
            out[sq_] = o[0]
            lse[:, sq_] = l[0]
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None):
        if not spec.varlen:
            dq, dk, dv = self._bwd(spec, dout, q, k, v, out, lse,
                                   _slopes_for(spec, alibi_slopes, batch=spec.batch), rng_state)
            return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
        dq, dk, dv = (np.zeros(x.shape, x.dtype) for x in (q, k, v))
        for i, sq_, sk_ in _per_sequence(spec, cu_seqlens_q, cu_seqlens_k):
            g = self._bwd(spec, dout[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_],
                          out[None, sq_], lse[None, :, sq_], _slopes_for(spec, alibi_slopes, i),
                          rng_state, i)
            dq[sq_], dk[sk_], dv[sk_] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv

    def forward_kvcache(self, spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                        block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None,
                        cache_leftpad=None, k_descale=None, v_descale=None, key_mask=None):
        """:func:`kvcache_forward` with this backend's path; out in q's dtype. FP8 caches:
        float8_e4m3fn (ml_dtypes) arrays, dequantised by ``k_descale``/``v_descale``."""
        out, lse = kvcache_forward(spec, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                   block_table=block_table, rotary_cos=rotary_cos,
                                   rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                                   attend=self._fwd, cache_leftpad=cache_leftpad,
                                   k_descale=k_descale, v_descale=v_descale,
                                   key_mask=key_mask)
        lse_dt = np.float64 if spec.attn.dtype == "float64" else np.float32
        return out.astype(_out_dtype(spec.attn.dtype)), lse.astype(lse_dt)


register(NumpyBackend())
