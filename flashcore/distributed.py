"""Context-parallel (ring) attention over ``torch.distributed``: a sequence split across ranks.

Each rank holds a shard of the sequence of q, k and v (``(batch, seqlen / world, heads,
headdim)``). The K/V shards travel around the ring of ranks (``batch_isend_irecv`` to the next
rank, from the previous one, the next shard in flight while the current one is attended to);
every rank attends its queries to each K/V shard with flashcore's forward, which returns the
log-sum-exp, and merges the partial results exactly through it, in float32 (float64 for
float64 inputs), so nothing is rounded per hop. The backward goes around the ring again: each
rank computes the gradient of each K/V shard's block from the final output and log-sum-exp
(the probabilities of a block are ``exp(s - lse)`` with the final lse, so the block gradients
are exact) and the dK/dV accumulators travel with their shard, home after the last hop.

Layouts, ``world`` = W ranks, the sequence cut into equal chunks:

* ``"contiguous"`` (default): rank r holds chunk r of W. Causal attention leaves rank r idle
  for the W - 1 - r hops whose keys are all in its future.
* ``"zigzag"``: the sequence is cut into 2W chunks and rank r holds chunks r and 2W - 1 - r, so
  every rank has the same causal work (:func:`shard` and :func:`unshard` convert).

Masks: full, causal, and sliding windows ``(left, right)``, causal or not (hops the window
cannot reach are skipped, blocks it cuts are cut to the queries and keys that see each other;
bottom-right alignment is top-left here: the shards of q and k/v have the same lengths). Transport is torch.distributed's (NCCL on GPUs, gloo on CPU): no transport
of flashcore's own.

Packed documents (varlen) take Llama 3's scheme instead, :func:`varlen_attention_all_gather`:
the K/V shards are all-gathered (its backward reduce-scatters dK/dV), and each rank attends its
query rows, cut at the document boundaries, to the keys of their documents, with flashcore's
varlen attention.
"""
from __future__ import annotations

from .api import attention_backward, attention_forward, varlen_attention
from .spec import as_flag

__all__ = ["ring_attention", "varlen_attention_all_gather", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


def _chunks(layout: str, world: int, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in order (chunks of equal length)."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)


def shard(x, world: int, rank: int, layout: str = "zigzag", dim: int = 1):
    """Rank ``rank``'s shard of the full-sequence tensor ``x`` (sequence along ``dim``)."""
    _check_layout(layout)
    n = len(_chunks(layout, world, 0)) * world
    if x.shape[dim] % n:
        raise ValueError(f"argument 'x': expected a sequence length divisible by {n} "
                         f"({layout} over {world} ranks), got {x.shape[dim]}")
    parts = x.chunk(n, dim=dim)
    import torch
    return torch.cat([parts[c] for c in _chunks(layout, world, rank)], dim=dim)


def unshard(shards, layout: str = "zigzag", dim: int = 1):
    """The full-sequence tensor from every rank's shard (``shards[r]``: rank r's)."""
    _check_layout(layout)
    import torch
    world = len(shards)
    per = len(_chunks(layout, world, 0))
    parts = [None] * (per * world)
    for r, s in enumerate(shards):
        for c, piece in zip(_chunks(layout, world, r), s.chunk(per, dim=dim)):
            parts[c] = piece
    return torch.cat(parts, dim=dim)


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"argument 'layout': expected one of {LAYOUTS}, got {layout!r}")


def _ring_peers(dist, group):
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    return world, rank, nxt, prv


def _start_rotation(dist, group, tensors, nxt, prv):
    """Send ``tensors`` to the next rank and receive the previous rank's into new buffers;
    returns (buffers, requests): wait on the requests before reading the buffers."""
    import torch
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)


def _blocks(layout, world, rank, src, window, m):
    """For the queries of ``rank`` and the K/V shard of ``src`` (sub-chunks of ``m`` rows):
    the blocks to compute, as (q sub-chunk, k sub-chunk, q rows, k rows, options). ``window``
    (left, right) is the global window (-1: unbounded; causal is right = 0). A block no query
    of which sees a key is left out: with a window, whole hops are skipped.

    With D = the distance from the key chunk's start to the query chunk's (a multiple of m),
    key j of the block is visible to query i iff ``i + D - left <= j <= i + D + right``. Kept
    whole when ``D - left <= 0 <= D + right``: the block's own window is ``(left - D,
    right + D)``. When the lower edge cuts it (e = D - left > 0), queries [0, m - e) see keys
    [e, m) only: that square, window ``(0, left + right)``; when the upper edge does
    (f = -(D + right) > 0), queries [f, m) see keys [0, m - f) only: window
    ``(left + right, 0)`` (-1 where the window is unbounded). No block has a query that sees
    none of its keys, so no sub-call computes a fully masked row."""
    left, right = window
    out = []
    full = slice(0, m)
    for i, qc in enumerate(_chunks(layout, world, rank)):
        for j, kc in enumerate(_chunks(layout, world, src)):
            d = (qc - kc) * m
            lo = d - left if left >= 0 else None        # key >= query + lo
            hi = d + right if right >= 0 else None      # key <= query + hi
            if (lo is not None and lo > m - 1) or (hi is not None and hi < -(m - 1)):
                continue                                # nothing visible
            wl = -1 if lo is None else max(-lo, 0)
            wr = -1 if hi is None else max(hi, 0)
            if lo is not None and lo > 0:      # queries [0, m - lo) see keys [lo, m) only
                out.append((i, j, slice(0, m - lo), slice(lo, m),
                            dict(window_size=(0, -1 if hi is None else hi - lo))))
            elif hi is not None and hi < 0:    # queries [-hi, m) see keys [0, m + hi) only
                out.append((i, j, slice(-hi, m), slice(0, m + hi),
                            dict(window_size=(-1 if lo is None else hi - lo, 0))))
            else:
                out.append((i, j, full, full, dict(window_size=(wl, wr))))
    return out


def _hop_blocks(layout, world, rank, src, window, m):
    """:func:`_blocks` in this rank's local rows: (q rows, k rows, options), slices over the
    rank's ``per * m`` query rows and over the ``per * m`` rows of the K/V shard of ``src``.
    A block whose every query sees every key is unmasked (window (-1, -1)), and unmasked
    blocks side by side -- the same rows of one side, adjacent rows of the other, which are
    adjacent in memory too -- become one call: with the zig-zag layout every hop but the
    diagonal one is then a single call (one query chunk against the whole shard, or the whole
    shard's queries against one key chunk) instead of two."""
    left, right = window
    qch, kch = _chunks(layout, world, rank), _chunks(layout, world, src)
    blocks = []
    for i, j, qr, kr, opts in _blocks(layout, world, rank, src, window, m):
        qa, qb = qch[i] * m + qr.start, qch[i] * m + qr.stop        # global rows [qa, qb)
        ka, kb = kch[j] * m + kr.start, kch[j] * m + kr.stop
        full = (left < 0 or ka >= qb - 1 - left) and (right < 0 or kb - 1 <= qa + right)
        blocks.append([slice(i * m + qr.start, i * m + qr.stop),
                       slice(j * m + kr.start, j * m + kr.stop),
                       dict(window_size=(-1, -1)) if full else opts, full])
    joined = True
    while joined:
        joined = False
        for a, b in ((a, b) for a in blocks for b in blocks if a is not b and a[3] and b[3]):
            if a[0] == b[0] and a[1].stop == b[1].start:
                a[1] = slice(a[1].start, b[1].stop)
            elif a[1] == b[1] and a[0].stop == b[0].start:
                a[0] = slice(a[0].start, b[0].stop)
            else:
                continue
            blocks.remove(b)
            joined = True
            break
    return [(qr, kr, opts) for qr, kr, opts, _ in blocks]


def _forward(q, k, v, group, layout, window, softmax_scale, softcap=0.0):
    import torch
    import torch.distributed as dist
    world, rank, nxt, prv = _ring_peers(dist, group)
    m = q.shape[1] // len(_chunks(layout, world, 0))
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    # the merged output (float32/64) and lse of the local queries, nothing seen yet
    acc = (q.new_zeros(q.shape, dtype=ct),
           q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=ct))
    cur = (k.contiguous(), v.contiguous())
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step < world - 1:
            pending = _start_rotation(dist, group, cur, nxt, prv)
        hop_forward(acc, q, cur[0], cur[1], _hop_blocks(layout, world, rank, src, window, m),
                    softmax_scale, softcap)
        if pending is not None:
            bufs, reqs = pending
            for r in reqs:
                r.wait()
            cur = tuple(bufs)
    return acc


def hop_forward(acc, q, k, v, blocks, softmax_scale, softcap=0.0):
    """One hop's local work: each block (query rows, key rows, mask options) of ``blocks``
    (:func:`_hop_blocks`) attends those rows of the local q to those of the held K/V shard and
    merges the result into ``acc`` (output, lse of the local queries) through the lse, in
    float32 (float64 for float64 inputs): the forward writes its partial output in float32, so
    nothing is rounded to 16 bits before the merge. (The single-GPU benchmark of the chunked
    schedule runs exactly this.) ``softcap`` acts on each score alone, so a block applies it
    as the whole call would."""
    import torch
    ao, al = acc
    ct = ao.dtype
    for qr, kr, opts in blocks:
        o, lse = attention_forward(q[:, qr].contiguous(), k[:, kr].contiguous(),
                                   v[:, kr].contiguous(), softmax_scale=softmax_scale,
                                   softcap=softcap,
                                   out_dtype=None if ct is torch.float64 else torch.float32,
                                   **opts)
        _merge_into(ao[:, qr], al[..., qr], o.to(ct), lse.to(ct))


def _merge_into(ao, al, o, lse):
    """Merge the partial result (o, lse) into the running one (ao, al) in place (views of the
    accumulators): lse' = log(exp(al) + exp(lse)), ao' = ao + w (o - ao) with w = exp(lse -
    lse'), the weight of the new part. One pass over the outputs (``lerp_``) where the general
    :func:`flashcore.merge_attention_states` makes several; the weights are computed on the
    small lse tensors. A row that neither part saw keeps out 0 and lse -inf (w = 0)."""
    import torch
    new = torch.logaddexp(al, lse)
    w = torch.where(torch.isneginf(new), torch.zeros_like(new), torch.exp(lse - new))
    ao.lerp_(o, w.transpose(1, 2).unsqueeze(-1))
    al.copy_(new)


def _backward(dout, q, k, v, out, lse, group, layout, window, softmax_scale, softcap=0.0):
    import torch
    import torch.distributed as dist
    world, rank, nxt, prv = _ring_peers(dist, group)
    m = q.shape[1] // len(_chunks(layout, world, 0))
    dout = dout.contiguous()
    dq = torch.zeros_like(q, dtype=lse.dtype)
    cur = [k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=lse.dtype),
           torch.zeros_like(v, dtype=lse.dtype)]
    for step in range(world):
        src = (rank - step) % world
        kc, vc, dkc, dvc = cur
        pending = None
        if step < world - 1:       # the next shard's k, v come while this one is worked on
            pending = _start_rotation(dist, group, [kc, vc], nxt, prv)
        for qr, kr, opts in _hop_blocks(layout, world, rank, src, window, m):
            g = attention_backward(dout[:, qr].contiguous(), q[:, qr].contiguous(),
                                   kc[:, kr].contiguous(), vc[:, kr].contiguous(),
                                   out[:, qr].contiguous(), lse[..., qr].contiguous(),
                                   softmax_scale=softmax_scale, softcap=softcap, **opts)
            dq[:, qr].add_(g[0])
            dkc[:, kr].add_(g[1])
            dvc[:, kr].add_(g[2])
        # this shard's gradient accumulators go on with it (home after the last hop)
        gbufs, greqs = _start_rotation(dist, group, [dkc, dvc], nxt, prv)
        for r in greqs:
            r.wait()
        if pending is not None:
            bufs, reqs = pending
            for r in reqs:
                r.wait()
            cur = [bufs[0], bufs[1], gbufs[0], gbufs[1]]
        else:
            cur = [kc, vc, gbufs[0], gbufs[1]]
    return dq.to(q.dtype), cur[2].to(k.dtype), cur[3].to(v.dtype)


_FN: list = []


def _function():
    if _FN:
        return _FN[0]
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, group, layout, window, softmax_scale, softcap):
            out, lse = _forward(q, k, v, group, layout, window, softmax_scale, softcap)
            out = out.to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (group, layout, window, softmax_scale, softcap)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _backward(dout, q, k, v, out, lse, *ctx.args)
            return dq, dk, dv, None, None, None, None, None

    _FN.append(RingAttention)
    return RingAttention


def ring_attention(q, k, v, group=None, *, causal: bool = False, softmax_scale=None,
                   window_size=(-1, -1), softcap: float = 0.0, layout: str = "contiguous",
                   return_lse: bool = False):
    """Attention of this rank's query shard over the whole sequence, whose K/V shards are held
    by the ranks of ``group`` (the default group when None); differentiable through autograd.

    q: ``(batch, seqlen_local, nheads, headdim)``, k and v ``(batch, seqlen_local, nheads_k,
    headdim)`` (GQA as in :func:`flashcore.attention`), every rank's shard of the same length,
    laid out as ``layout`` says (``"contiguous"``: rank r holds the r-th of W equal chunks;
    ``"zigzag"``: chunks r and 2W-1-r of 2W, see :func:`shard`). ``causal`` masks every key
    after its query in the global sequence; ``window_size=(left, right)`` keeps the keys from
    ``left`` before to ``right`` after each query (-1: unbounded; with causal, right is 0),
    global positions as in :func:`flashcore.attention` (hops the window cannot reach are
    skipped). ``softcap`` as in :func:`flashcore.attention`. (ALiBi needs each block's
    distance in its bias, which the kernels' calls do not take: not supported here; the
    all-gather variant takes it.) Returns this rank's output shard (like q), and with
    ``return_lse`` the float32 log-sum-exp ``(batch, nheads, seqlen_local)``.
    """
    import torch
    import torch.distributed as dist
    _check_layout(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(x).__name__}")
    causal = as_flag("causal", causal)
    return_lse = as_flag("return_lse", return_lse)
    softcap = _softcap(softcap)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcore.distributed.ring_attention: torch.distributed is not "
                           "initialised (call torch.distributed.init_process_group first)")
    if k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"argument 'k': expected shards of q's length {q.shape[1]} (and v like "
                         f"k), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    per = 2 if layout == "zigzag" else 1
    if q.shape[1] % per:
        raise ValueError(f"argument 'q': a zigzag shard holds two equal chunks: expected an "
                         f"even local length, got {q.shape[1]}")
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"argument 'window_size': expected a pair (left, right) of ints >= -1, "
                        f"got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"argument 'window_size': expected ints >= -1 (-1: unbounded), got "
                         f"{(left, right)}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = _function().apply(q, k, v, group, layout, (left, right), float(softmax_scale),
                                 softcap)
    return (out, lse) if return_lse else out


def _softcap(softcap) -> float:
    """The validated softcap (checked before any communication, as every argument)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) \
            or not 0.0 <= float(softcap) < float("inf"):
        raise ValueError(f"argument 'softcap': expected a finite float >= 0 (0: none), got "
                         f"{softcap!r}")
    return float(softcap)


_GATHER: list = []


def _all_gather_function():
    """Differentiable all-gather along dim 0: the backward sums every rank's gradient of the
    gathered tensor and hands each rank its own rows (reduce-scatter; all-reduce where the
    backend has no reduce-scatter, as gloo)."""
    if _GATHER:
        return _GATHER[0]
    import torch
    import torch.distributed as dist

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.contiguous()
            world = dist.get_world_size(group)
            out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
            dist.all_gather_into_tensor(out, x, group=group)
            ctx.group, ctx.rows = group, x.shape[0]
            return out

        @staticmethod
        def backward(ctx, g):
            g = g.contiguous()
            rank, n = dist.get_rank(ctx.group), ctx.rows
            if dist.get_backend(ctx.group) == "nccl":
                mine = g.new_empty((n,) + tuple(g.shape[1:]))
                dist.reduce_scatter_tensor(mine, g, group=ctx.group)
                return mine, None
            g = g.clone()
            dist.all_reduce(g, group=ctx.group)
            return g[rank * n:(rank + 1) * n].contiguous(), None

    _GATHER.append(AllGather)
    return AllGather


def _local_documents(cu, lo, hi, causal):
    """Cut the query rows [lo, hi) of a packed sequence (document b spans cu[b]:cu[b+1]) at the
    document boundaries. Returns (cu_q, cu_k, key_lo, key_hi, max_q, max_k): local cu_seqlens
    of the query segments and of their keys (the document's rows from its start up to the
    segment's end when causal, the whole document otherwise) within the key rows
    [key_lo, key_hi) of the packed sequence."""
    seg_q, seg_k, first, last = [], [], None, None
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        a, z = max(s, lo), min(e, hi)
        if a >= z:
            continue
        kz = z if causal else e
        seg_q.append(z - a)
        seg_k.append(kz - s)
        first = s if first is None else first
        last = kz
    if first is None:
        return [0], [0], lo, lo, 0, 0
    cq, ck = [0], [0]
    for n in seg_q:
        cq.append(cq[-1] + n)
    for n in seg_k:
        ck.append(ck[-1] + n)
    return cq, ck, first, last, max(seg_q), max(seg_k)


def varlen_attention_all_gather(q, k, v, cu_seqlens, group=None, *, causal: bool = False,
                                softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0,
                                alibi_slopes=None):
    """Attention over packed documents whose tokens are split across the ranks of ``group``
    (Llama 3's context parallelism): differentiable through autograd.

    q: ``(tokens_local, nheads, headdim)``, k and v ``(tokens_local, nheads_k, headdim)``: rank
    r holds rows ``[r * tokens_local, (r + 1) * tokens_local)`` of the packed sequence (every
    rank the same count). ``cu_seqlens``: the documents of the whole packed sequence, int32
    ``(documents + 1,)``, the same on every rank; it is read on the host (a list, a NumPy array
    or a CPU tensor costs no sync). A document may span ranks. The K/V shards are all-gathered
    (the backward sums dK/dV back to their ranks); each rank runs flashcore's varlen attention
    of its query segments over their documents' keys. ``causal`` and a causal ``window_size``
    (left, 0) align per document; a window with keys to the right needs causal=False and is
    not supported here yet. ``softcap`` as in :func:`flashcore.attention`; ``alibi_slopes``
    (float32 ``(nheads,)``) with ``causal=True``, where each segment's call sees its keys up to
    its last query, so the bias's distances are the document's (without causal a segment
    that ends before its document does would see them shifted: refused). Returns this rank's
    output rows (like q).
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    from ._arrays import library_of, to_host
    causal = as_flag("causal", causal)
    if tuple(window_size) != (-1, -1) and not causal:
        raise NotImplementedError("argument 'window_size': a sliding window across ranks is "
                                  "supported with causal=True (window (left, 0)); expected "
                                  "causal=True or window_size=(-1, -1)")
    softcap = _softcap(softcap)
    if alibi_slopes is not None:
        if not causal:
            raise NotImplementedError("argument 'alibi_slopes': across ranks with causal=True "
                                      "only (a segment's distances to its document's later keys "
                                      "are not the call's); expected causal=True or None")
        if getattr(alibi_slopes, "ndim", None) != 1 or alibi_slopes.shape[0] != q.shape[1]:
            raise ValueError(f"argument 'alibi_slopes': expected a float32 array of shape "
                             f"({q.shape[1]},) (one slope per query head), got "
                             f"{getattr(alibi_slopes, 'shape', type(alibi_slopes).__name__)}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcore.distributed.varlen_attention_all_gather: torch.distributed "
                           "is not initialised (call torch.distributed.init_process_group first)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[0]
    cu = np.asarray(to_host(cu_seqlens) if library_of(cu_seqlens) else cu_seqlens, np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != n * world or (np.diff(cu) < 0).any():
        raise ValueError(f"argument 'cu_seqlens': expected non-decreasing offsets from 0 to the "
                         f"packed length {n * world} ({world} ranks x {n} rows), got "
                         f"{cu.tolist()[:8]}{'...' if cu.size > 8 else ''}")
    gather = _all_gather_function()
    k_all = gather.apply(k, group)
    v_all = gather.apply(v, group)
    cq, ck, klo, khi, mq, mk = _local_documents(cu, rank * n, (rank + 1) * n, causal)
    dev = q.device
    cu_q = torch.tensor(cq, dtype=torch.int32, device=dev)
    cu_k = torch.tensor(ck, dtype=torch.int32, device=dev)
    return varlen_attention(q, k_all[klo:khi], v_all[klo:khi], cu_q, cu_k, mq, mk,
                            causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
