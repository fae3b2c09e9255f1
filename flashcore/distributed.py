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

Masks: full or causal (bottom-right alignment is top-left here: the shards of q and k/v have
the same lengths). Transport is torch.distributed's (NCCL on GPUs, gloo on CPU): no transport
of flashcore's own.
"""
from __future__ import annotations

from .api import attention_backward, attention_forward, merge_attention_states

__all__ = ["ring_attention", "shard", "unshard"]

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


def _blocks(layout, world, rank, src, causal):
    """For the queries of ``rank`` and the K/V shard of ``src``: the (q sub-chunk, k sub-chunk,
    causal?) pairs to compute; a pair whose keys are all in the queries' future is left out."""
    out = []
    for i, qc in enumerate(_chunks(layout, world, rank)):
        for j, kc in enumerate(_chunks(layout, world, src)):
            if causal and kc > qc:
                continue
            out.append((i, j, causal and kc == qc))
    return out


def _forward(q, k, v, group, layout, causal, softmax_scale):
    import torch
    import torch.distributed as dist
    world, rank, nxt, prv = _ring_peers(dist, group)
    per = len(_chunks(layout, world, 0))
    qs = q.chunk(per, dim=1)
    acc = [None] * per          # (out fp32/64, lse) per q sub-chunk
    cur = (k.contiguous(), v.contiguous())
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step < world - 1:
            pending = _start_rotation(dist, group, cur, nxt, prv)
        ks, vs = cur[0].chunk(per, dim=1), cur[1].chunk(per, dim=1)
        for i, j, diag in _blocks(layout, world, rank, src, causal):
            o, lse = attention_forward(qs[i], ks[j], vs[j], causal=diag,
                                       softmax_scale=softmax_scale)
            ct = torch.float64 if o.dtype == torch.float64 else torch.float32
            if acc[i] is None:
                acc[i] = (o.to(ct), lse.to(ct))
            else:
                acc[i] = merge_attention_states([acc[i][0], o.to(ct)], [acc[i][1], lse.to(ct)])
        if pending is not None:
            bufs, reqs = pending
            for r in reqs:
                r.wait()
            cur = tuple(bufs)
    outs = [a[0] for a in acc]
    lses = [a[1] for a in acc]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def _backward(dout, q, k, v, out, lse, group, layout, causal, softmax_scale):
    import torch
    import torch.distributed as dist
    world, rank, nxt, prv = _ring_peers(dist, group)
    per = len(_chunks(layout, world, 0))
    qs, dos = q.chunk(per, dim=1), dout.contiguous().chunk(per, dim=1)
    os_ = out.chunk(per, dim=1)
    lses = [x.contiguous() for x in lse.chunk(per, dim=-1)]
    dq = torch.zeros_like(q, dtype=lse.dtype)
    dqs = dq.chunk(per, dim=1)
    cur = [k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=lse.dtype),
           torch.zeros_like(v, dtype=lse.dtype)]
    for step in range(world):
        src = (rank - step) % world
        kc, vc, dkc, dvc = cur
        pending = None
        if step < world - 1:       # the next shard's k, v come while this one is worked on
            pending = _start_rotation(dist, group, [kc, vc], nxt, prv)
        ks, vs = kc.chunk(per, dim=1), vc.chunk(per, dim=1)
        dks, dvs = dkc.chunk(per, dim=1), dvc.chunk(per, dim=1)
        for i, j, diag in _blocks(layout, world, rank, src, causal):
            g = attention_backward(dos[i].contiguous(), qs[i].contiguous(), ks[j].contiguous(),
                                   vs[j].contiguous(), os_[i].contiguous(), lses[i],
                                   causal=diag, softmax_scale=softmax_scale)
            dqs[i].add_(g[0])
            dks[j].add_(g[1])
            dvs[j].add_(g[2])
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
        def forward(ctx, q, k, v, group, layout, causal, softmax_scale):
            out, lse = _forward(q, k, v, group, layout, causal, softmax_scale)
            out = out.to(q.dtype)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = (group, layout, causal, softmax_scale)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _backward(dout, q, k, v, out, lse, *ctx.args)
            return dq, dk, dv, None, None, None, None

    _FN.append(RingAttention)
    return RingAttention


def ring_attention(q, k, v, group=None, *, causal: bool = False, softmax_scale=None,
                   layout: str = "contiguous", return_lse: bool = False):
    """Attention of this rank's query shard over the whole sequence, whose K/V shards are held
    by the ranks of ``group`` (the default group when None); differentiable through autograd.

    q: ``(batch, seqlen_local, nheads, headdim)``, k and v ``(batch, seqlen_local, nheads_k,
    headdim)`` (GQA as in :func:`flashcore.attention`), every rank's shard of the same length,
    laid out as ``layout`` says (``"contiguous"``: rank r holds the r-th of W equal chunks;
    ``"zigzag"``: chunks r and 2W-1-r of 2W, see :func:`shard`). ``causal`` masks every key
    after its query in the global sequence. Returns this rank's output shard (like q), and
    with ``return_lse`` the float32 log-sum-exp ``(batch, nheads, seqlen_local)``.
    """
    import torch
    import torch.distributed as dist
    _check_layout(layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"argument '{name}': expected a torch.Tensor, got {type(x).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcore.distributed.ring_attention: torch.distributed is not "
                           "initialised (call torch.distributed.init_process_group first)")
    if not isinstance(causal, bool):
        raise TypeError(f"argument 'causal': expected a bool, got {type(causal).__name__}")
    if k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"argument 'k': expected shards of q's length {q.shape[1]} (and v like "
                         f"k), got k {tuple(k.shape)}, v {tuple(v.shape)}")
    per = 2 if layout == "zigzag" else 1
    if q.shape[1] % per:
        raise ValueError(f"argument 'q': a zigzag shard holds two equal chunks: expected an "
                         f"even local length, got {q.shape[1]}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = _function().apply(q, k, v, group, layout, causal, float(softmax_scale))
    return (out, lse) if return_lse else out
