"""flash-attn 2 compatible functions: code written for flash-attn runs by changing one import.

::

    # from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flashcore.flash_attn import flash_attn_func, flash_attn_varlen_func

Names, argument order, defaults, shapes and returns are flash-attn 2.x's
(``flash_attn/flash_attn_interface.py``). Differences, each refused or documented:

* ``dropout_p`` > 0 drops attention probabilities (training; flash-attn says the same: 0.0
  for evaluation) with flashcore's counter-based stream (:mod:`flashcore.dropout`), its state
  drawn from torch's generator of the tensors' device, so ``torch.manual_seed`` reproduces a
  run. With dropout, ``return_attn_probs=True`` returns as its third element the probabilities
  with the dropout pattern in their signs, in flash-attn's convention (for tests: computed on
  the host, see :func:`flashcore.reference.attn_probs_dmask`); without dropout, None.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``; the kernels never
  materialise the probabilities, so ``S_dmask`` (flash-attn's "for testing only") is None
  without dropout and, with it, the encoding above, recomputed on the host.
* ``block_table`` in ``flash_attn_varlen_func``: a paged KV cache (forward only).
* :func:`flash_attn_with_kvcache`: ``cache_batch_idx`` must be None; ``cache_leftpad``
  works with a contiguous cache (as in flash-attn, not with ``block_table``); a head dim
  that is no multiple of 8 is padded with zero columns, the caches included, and appended
  rows are copied back (what flash-attn does: a copy of the whole cache per call);
  a paged cache's page size may be any multiple of 16 (flash-attn 2: 256); the new keys must
  fit in the cache (checked); ``k_descale``/``v_descale`` (keyword only, FlashAttention-3's)
  with an FP8 (float8_e4m3fn) cache, read only.
* FlashAttention-3's FP8 forward: :func:`flash_attn_func` and :func:`flash_attn_varlen_func`
  take float8_e4m3fn q, k, v with keyword-only ``q_descale``, ``k_descale``, ``v_descale``
  (forward only; output bfloat16).

On torch tensors the results are differentiable (``flashcore.attention``'s autograd); the
functions also take NumPy and CuPy arrays (then without autograd).

The causal mask is aligned to the bottom-right corner of the score matrix. With
seqlen_q = 2 and seqlen_k = 5 (``x`` = kept, ``.`` = masked)::

    k:  0 1 2 3 4
    q0  x x x x .
    q1  x x x x x

and with seqlen_q = 5, seqlen_k = 2 the first three query rows see nothing (output 0,
lse = -inf)::

    k:  0 1
    q0  . .
    q1  . .
    q2  . .
    q3  x .
    q4  x x

``window_size=(left, right)`` (-1 = unbounded) keeps keys j with
``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``.
"""
from __future__ import annotations

from ._arrays import library_of
from .api import attention, attention_with_kvcache, draw_rng_state, varlen_attention
from .spec import as_flag

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
]


def _result(out, lse, return_attn_probs, probs=None):
    return (out, lse, probs) if return_attn_probs else out


def _dmask(q, k, dropout_p, rng_state, cu_seqlens=None, max_seqlens=None, **kw):
    """The third output of ``return_attn_probs=True`` when there is dropout: the probabilities
    with the dropout pattern in their signs, as flash-attn returns them for its tests
    (:func:`flashcore.reference.attn_probs_dmask`; computed on the host, a test aid); None
    without dropout (flash-attn's tests read it only then). Varlen (``cu_seqlens`` (q, k),
    ``max_seqlens``): (batch, nheads, max_seqlen_q, max_seqlen_k), sequence b in its top-left
    corner, zeros elsewhere (flash-attn's layout)."""
    if not dropout_p:
        return None
    import numpy as np
    import torch
    from .reference import attn_probs_dmask
    from .spec import forward_spec
    qh, kh = (x.detach().to(torch.float64).cpu().numpy() for x in (q, k))
    st = rng_state.cpu().numpy()
    slopes = kw.pop("alibi_slopes", None)
    if slopes is not None:
        slopes = slopes.detach().cpu().numpy().astype(np.float64)

    def encoded(a, b, sl, batch_offset=0):
        if sl is not None and sl.ndim == 1:
            sl = np.broadcast_to(sl[None], (a.shape[0], sl.shape[0]))
        spec = forward_spec(a, b, b, dropout_p=dropout_p, rng_state=st, **kw)
        return attn_probs_dmask(spec, a, b, slopes=sl, rng_state=st, batch_offset=batch_offset)

    if cu_seqlens is None:
        out = encoded(qh, kh, slopes)
    else:
        cq, ck = (x.detach().cpu().numpy().astype(np.int64) for x in cu_seqlens)
        out = np.zeros((len(cq) - 1, q.shape[1], *max_seqlens))
        for i in range(len(cq) - 1):
            sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[i:i + 1])
            p = encoded(qh[None, cq[i]:cq[i + 1]], kh[None, ck[i]:ck[i + 1]], sl, i)
            out[i, :, :p.shape[2], :p.shape[3]] = p[0]
    return torch.from_numpy(out).to(device=q.device, dtype=q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None):
    """Attention over padded batches; MQA/GQA when k, v have fewer heads than q.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k, v: (batch_size, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0; query head i
            uses key head i // (nheads // nheads_k).
        dropout_p: the probability of dropping an attention probability (training only).
        softmax_scale: scaling of q·kᵀ before the softmax; default 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask (see the module docstring).
        window_size: (left, right) sliding window, -1 = unbounded.
        softcap: > 0 replaces a score s by softcap·tanh(s / softcap); 0 disables it.
        alibi_slopes: (nheads,) or (batch_size, nheads), float32; adds
            ``-slope·|i + seqlen_k - seqlen_q - j|`` to the score of query i and key j.
        deterministic: bitwise reproducible backward.
        return_attn_probs: also return the log-sum-exp (and None, see below).
        q_descale, k_descale, v_descale: FlashAttention-3's FP8 forward (keyword only): with
            float8_e4m3fn q, k, v, float32 (batch_size, nheads_k) factors (None: 1; a
            per-tensor factor broadcasts), the inputs' values being ``x * descale``; forward
            only, output bfloat16 (see :func:`flashcore.attention_forward`).

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype (bfloat16 for FP8 inputs). With
        ``return_attn_probs=True``: ``(out, softmax_lse, S_dmask)``, softmax_lse float32
        (batch_size, nheads, seqlen_q), the natural-log log-sum-exp of each row of the final
        scores; S_dmask None without dropout, else the probabilities with the dropout
        pattern in their signs (see the module docstring).
    """
    return_attn_probs = as_flag("return_attn_probs", return_attn_probs)
    rng = draw_rng_state(q) if dropout_p and library_of(q) == "torch" else None
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         deterministic=deterministic, return_lse=True, dropout_p=dropout_p,
                         rng_state=rng, q_descale=q_descale, k_descale=k_descale,
                         v_descale=v_descale)
    probs = _dmask(q, k, dropout_p, rng, causal=causal, softmax_scale=softmax_scale,
                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes) \
        if return_attn_probs else None
    return _result(out, lse, return_attn_probs, probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with q, k, v stacked: qkv (batch_size, seqlen, 3, nheads, headdim).

    q, k, v are strided views of qkv (no copy). Returns out (batch_size, seqlen, nheads,
    headdim), or ``(out, softmax_lse (batch_size, nheads, seqlen), None)`` with
    ``return_attn_probs=True``.
    """
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with k, v stacked.

    q: (batch_size, seqlen_q, nheads, headdim); kv: (batch_size, seqlen_k, 2, nheads_k,
    headdim). Returns out like q, or ``(out, softmax_lse (batch_size, nheads, seqlen_q), None)``
    with ``return_attn_probs=True``.
    """
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, q_descale=None,
                           k_descale=None, v_descale=None):
    """Attention over packed variable-length sequences (no padding).

    Arguments:
        q: (total_q, nheads, headdim), the batch's query tokens one sequence after another.
        k, v: (total_k, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: (batch_size + 1,) int32, cumulative sequence lengths;
            sequence b holds rows cu_seqlens[b]:cu_seqlens[b+1].
        max_seqlen_q, max_seqlen_k: int, the longest query / key sequence.
        block_table: optional int32 (batch_size, max_blocks_per_seq): k and v are then a paged
            KV cache (num_blocks, page_size, nheads_k, headdim), page_size a multiple of 16,
            and cu_seqlens_k gives the key lengths; forward only (as in flash-attn).
        alibi_slopes: (nheads,) or (batch_size, nheads), float32.

    Other arguments as in :func:`flash_attn_func` (FP8 inputs with their descales: on the
    NumPy reference; the Hopper FP8 kernel takes dense calls only); the masks apply per
    sequence.

    Returns:
        out: (total_q, nheads, headdim), or ``(out, softmax_lse, None)`` with
        ``return_attn_probs=True``, softmax_lse float32 (nheads, total_q).
    """
    return_attn_probs = as_flag("return_attn_probs", return_attn_probs)
    rng = draw_rng_state(q) if dropout_p and library_of(q) == "torch" else None
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=causal, softmax_scale=softmax_scale,
                                window_size=window_size, softcap=softcap,
                                alibi_slopes=alibi_slopes, deterministic=deterministic,
                                return_lse=True, block_table=block_table, dropout_p=dropout_p,
                                rng_state=rng, q_descale=q_descale, k_descale=k_descale,
                                v_descale=v_descale)
    probs = _dmask(q, k, dropout_p, rng, (cu_seqlens_q, cu_seqlens_k),
                   (max_seqlen_q, max_seqlen_k), causal=causal, softmax_scale=softmax_scale,
                   window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes) if return_attn_probs else None
    return _result(out, lse, return_attn_probs, probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with q, k, v stacked: qkv (total, 3, nheads, headdim).

    cu_seqlens: (batch_size + 1,) int32 for queries and keys alike; max_seqlen: int.
    Returns out (total, nheads, headdim), or ``(out, softmax_lse (nheads, total), None)``.
    """
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with k, v stacked.

    q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim). Returns out like q,
    or ``(out, softmax_lse (nheads, total_q), None)`` with ``return_attn_probs=True``.
    """
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_descale=None, v_descale=None):
    """Incremental decoding with a KV cache; ``k_cache``/``v_cache`` are updated **in place**.

    If k and v are given they are written into the cache at positions ``cache_seqlens[b]``,
    ``cache_seqlens[b] + 1``, ... (the cache must have room), and attention runs over the first
    ``cache_seqlens[b] + seqlen_new`` keys of each sequence. ``cache_seqlens`` is not advanced.
    Inference only: no backward (torch results do not require grad).

    Arguments:
        q: (batch_size, seqlen, nheads, headdim)
        k_cache, v_cache: (batch_size, seqlen_cache, nheads_k, headdim), or with
            ``block_table`` a paged cache (num_blocks, page_block_size, nheads_k, headdim),
            page_block_size a multiple of 16.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim), appended to the cache.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2), q's dtype, rotary_dim a
            multiple of 16; only with k, v. The new keys are rotated at positions
            ``cache_seqlens, cache_seqlens + 1, ...``; q likewise when causal or local, else
            every query at position ``cache_seqlens``.
        cache_seqlens: int, or (batch_size,) int32: cached lengths before appending. None
            means the whole cache is valid (its capacity), as in flash-attn.
        cache_batch_idx: must be None (not implemented).
        cache_leftpad: optional (batch_size,) int32: sequence b's keys start at row
            ``cache_leftpad[b]`` (left padding). Contiguous caches only.
        block_table: optional (batch_size, max_num_blocks_per_seq) int32 (paged cache).
        softmax_scale: default 1 / sqrt(headdim).
        causal, window_size, softcap, alibi_slopes: as in :func:`flash_attn_func`, aligned
            to the bottom-right corner of each sequence's (new) cache.
        rotary_interleaved: True: rotate channel pairs (0, 1), (2, 3), ...; False: (i,
            i + rotary_dim / 2) (GPT-NeoX).
        num_splits: key-range splits (Flash-Decoding); 0 = heuristic, 1 = no split.
        return_softmax_lse: also return the log-sum-exp.
        k_descale, v_descale: FlashAttention-3's FP8 KV cache (keyword only): with
            float8_e4m3fn ``k_cache``/``v_cache`` (CuPy: uint8 arrays of float8_e4m3fn bits)
            and a float16/bfloat16 q, None (1.0) or float32 broadcastable to (batch_size,
            nheads_k); the cache's values are ``k_cache[b, t, h] * k_descale[b, h]``. Read
            only: k, v (appending) are refused with an FP8 cache. See
            :func:`flashcore.attention_with_kvcache`.

    Returns:
        out: (batch_size, seqlen, nheads, headdim), or ``(out, softmax_lse)`` with
        ``return_softmax_lse=True``, softmax_lse float32 (batch_size, nheads, seqlen).
    """
    return_softmax_lse = as_flag("return_softmax_lse", return_softmax_lse)
    if cache_batch_idx is not None:
        raise NotImplementedError("argument 'cache_batch_idx': flashcore does not implement it "
                                  "yet; expected None")
    if cache_seqlens is None and k is None and getattr(k_cache, "ndim", None) == 4:
        # flash-attn: no lengths means every cached row is valid
        cache_seqlens = (int(k_cache.shape[1]) if block_table is None or
                         getattr(block_table, "ndim", None) != 2 else
                         int(block_table.shape[1]) * int(k_cache.shape[1]))
    out, lse = attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, num_splits=num_splits, return_lse=True,
        cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_softmax_lse else out
