"""What the torch route costs the host per call, with or without the device (issue #14).

    python tests/diagnostics/probe_route.py [--real [--no-launch]] [--calls N] [--rounds R]
                                            [--cases A,B,...] [--profile CASE]

The tiny training step (1 x 128 x 2 x 64 bf16, causal, q, k, v distinct) through the public
API -- ``flashcore.attention`` -> the autograd Function -> the ``flashcore::fwd`` /
``flashcore::bwd`` ops -> their kernels' launch-plan replay -- timed in a host loop, µs per
call, the best of R interleaved rounds of up to N calls each, beside:

* ``nothing_*``: a do-nothing ``torch.autograd.Function`` (its forward allocates the output,
  its backward returns the incoming gradient three times): the floor of any Function route;
* ``sdpa_*``: ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors, torch
  choosing its backend (stubbed: CPU tensors, so the figure includes a CPU kernel's
  arithmetic); ``sdpa1_*``: one query and one key, SDPA's dispatch and autograd with next to
  no arithmetic;
* ``op_fwd`` / ``op_bwd``: the two ops called directly, and the pieces of a replay (the
  launch-plan key and lookup, the allocations, ``Plan.run``);
* ``tf_decode`` / ``tf_decode_mask``: a forward's 8 decoding layers through the transformers
  integration's attention function (transformers' (b, h, s, d) tensors, batch 1, 16 query
  heads over 4, head dim 128, a 576-token cache), without and with the all-ones mask that
  ``generate`` passes (int64, through the registered mask function twice a forward, as
  transformers calls it); ``tf_direct``: the same lengths, then the read op's implementation
  called directly (the route's own Python left out);
* ``fc_decode`` / ``op_decode``: one decoding step (batch 1, one query token, 32 query heads
  over 8 kv heads, head dim 128, a 4k cache, ``cache_seqlens`` a tensor) through
  ``flashcore.attention_with_kvcache`` and through the ``flashcore::kvcache_read`` op directly;
  ``fc_decode_paged`` / ``op_decode_paged``: the same over the cache as 16 pages of 256 tokens
  with an int32 block table.

Default (stubbed; runs on a machine without a GPU): the tensors are CPU tensors and only the
device is stubbed, at the lowest level: ``Tensor.is_cuda`` reads True, the plans' CUDA context
and ``cuLaunchKernel`` are no-ops (``flashcore.kernels.device.driver()``), torch's raw stream is
0. The plans themselves are recorded through the real ``plans.record``/``Plan.build`` from a
stand-in backend that offers what the CUDA launchers offer for this call (the forward: one
launch; the backward: preprocess, dK/dV, dQ convert, and two scratch buffers; decoding: one
launch). Everything above
the launch -- public function, option handling, the Function, dispatch, key, lookup,
allocations, struct copy and packing -- runs for real. The clock is the process's CPU time
(time spent descheduled on a shared machine is not counted); the backward runs on the calling
thread (CPU tensors), so the autograd engine's hand-off to a device thread is not in it.

``--real``: CUDA tensors, nothing stubbed, wall-clock time, each round ending in a
synchronisation; ``--real --no-launch``: CUDA tensors and torch's allocator, ``cuLaunchKernel``
a no-op (the host cost with the driver's launch left out). ``--cases`` times only the cases
named; ``--profile CASE`` prints cProfile's top entries for one case (e.g. ``fc_step``).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
import types

import torch

import flashcore
from flashcore.backends import torch_backend, torch_ops
from flashcore.bench import per_call_us_interleaved
from flashcore.kernels import device, plans
from flashcore.kernels.params import make_params

SHAPE = (1, 128, 2, 64)


# --------------------------------------------------------------------------------------------
# The device stub
# --------------------------------------------------------------------------------------------

_CONTEXT = 0x5EED      # the stand-in CUDA context: what plans and the replay compare
_FAKE_KERNEL = types.SimpleNamespace(ptr=0xC0DE)


def _no_launch(*_):
    return 0        # (cuLaunchKernel's CUDA_SUCCESS)


class _StubDriver:
    """flashcore.kernels.device.driver()'s stand-in: no launch, one context."""
    launch = staticmethod(_no_launch)
    current_context = staticmethod(lambda: _CONTEXT)
    primary_context = staticmethod(lambda device_id: _CONTEXT)
    set_current_context = staticmethod(lambda ctx: None)


def stub_device():
    """Tensors read as CUDA tensors, the driver calls and the stream lookup as no-ops."""
    torch.Tensor.is_cuda = property(lambda self: True)
    stub = _StubDriver()
    device.driver = lambda: stub
    device._TORCH_STREAM[:] = [lambda index: 0]
    from flashcore.integrations import transformers as fct
    fct._CAPTURING[:] = [lambda: False]     # (the stream capture test: a CPU build has none)


class _StandInBackend:
    """Allocates what the torch backend allocates and offers the launches the CUDA launchers
    would offer for a dense, causal, non-deterministic call (flashcore.kernels.forward /
    backward), with the struct holding the call's addresses."""

    @staticmethod
    def forward(spec, q, k, v, **_):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((spec.batch, spec.nheads, spec.seqlen_q), dtype=torch.float32,
                          device=q.device)
        params = make_params(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(),
                             lse=lse.data_ptr(), batch=spec.batch, nheads=spec.nheads,
                             headdim=spec.headdim, seqlen_q=spec.seqlen_q,
                             seqlen_k=spec.seqlen_k, softmax_scale=spec.softmax_scale)
        plans.offer(plans.Piece([(_FAKE_KERNEL, (1, spec.nheads, spec.batch), (128,), 0)],
                                params))
        return out, lse

    @staticmethod
    def backward(spec, dout, q, k, v, out, lse, **_):
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        rows = spec.batch * spec.nheads * spec.seqlen_q
        params = make_params(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(),
                             lse=lse.data_ptr(), dout=dout.data_ptr(), dq=dq.data_ptr(),
                             dk=dk.data_ptr(), dv=dv.data_ptr(), dq_accum=1, dsoftmax_sum=2,
                             batch=spec.batch, nheads=spec.nheads, headdim=spec.headdim)
        grid = (1, spec.nheads, spec.batch)
        plans.offer(plans.Piece([(_FAKE_KERNEL, grid, (128,), 0),      # preprocess
                                 (_FAKE_KERNEL, grid, (256,), 100000),  # dK/dV
                                 (_FAKE_KERNEL, grid, (128,), 0)],      # dQ convert
                                params, {"dsoftmax_sum": rows * 4,
                                         "dq_accum": rows * spec.headdim * 4}))
        return dq, dk, dv

    @staticmethod
    def forward_kvcache(spec, q, k_cache, v_cache, k, v, *, cache_seqlens, block_table=None,
                        **_):
        a = spec.attn
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((a.batch, a.nheads, a.seqlen_q), dtype=torch.float32, device=q.device)
        params = make_params(q=q.data_ptr(), k=k_cache.data_ptr(), v=v_cache.data_ptr(),
                             o=out.data_ptr(), lse=lse.data_ptr(),
                             cache_seqlens=cache_seqlens.data_ptr(),
                             block_table=None if block_table is None else block_table.data_ptr(),
                             batch=a.batch,
                             nheads=a.nheads, nheads_k=a.nheads_k, headdim=a.headdim,
                             seqlen_q=a.seqlen_q, softmax_scale=a.softmax_scale)
        plans.offer(plans.Piece([(_FAKE_KERNEL, (a.batch * a.nheads_k, 1, 8), (128,), 100000)],
                                params))
        return out, lse


@contextlib.contextmanager
def recording_stand_in():
    """The first call of a layout records its plan from the stand-in backend (the real
    backend would compute on the CPU and offer nothing)."""
    backend, choose, choose_kv = torch_ops._BACKEND, torch_ops.choose, torch_ops.choose_kvcache
    torch_ops._BACKEND, torch_ops.choose = _StandInBackend(), (lambda *a, **k: None)
    torch_ops.choose_kvcache = lambda *a, **k: None
    try:
        yield
    finally:
        torch_ops._BACKEND, torch_ops.choose = backend, choose
        torch_ops.choose_kvcache = choose_kv


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------

class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout


def cases(device):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(*SHAPE, device=device, dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    F = torch.nn.functional
    ops = torch_ops.torch_ops()
    scale = 1 / math.sqrt(SHAPE[-1])
    opts = (0, 0, True, scale, -1, 0, 0.0, False)
    with torch.no_grad():
        o, lse = ops.fwd.default(q, k, v, opts)

    def fc_fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def fc_fwd_grad():
        flashcore.attention(qg, kg, vg, causal=True)

    def fc_step():
        out = flashcore.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def nothing_fwd_grad():
        _Nothing.apply(qg, kg, vg)

    def nothing_step():
        out = _Nothing.apply(qg, kg, vg)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def sdpa_step():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        torch.autograd.grad(out, (qt, kt, vt), dot)

    # one query and one key: SDPA's dispatch and autograd with next to no arithmetic (what
    # sdpa_* costs on CPU tensors is mostly a CPU kernel's)
    q1, k1, v1 = (x[:, :, :1].detach().clone().requires_grad_() for x in (qt, kt, vt))
    do1 = dot[:, :, :1].contiguous()

    def sdpa1_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q1, k1, v1, is_causal=True)

    def sdpa1_step():
        out = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True)
        torch.autograd.grad(out, (q1, k1, v1), do1)

    fwd_op, bwd_op = ops.fwd.default, ops.bwd.default

    def op_fwd():
        with torch.no_grad():
            fwd_op(q, k, v, opts)

    def op_bwd():
        with torch.no_grad():
            bwd_op(do, q, k, v, o, lse, opts)

    # one decoding step (#14's cell: batch 1, one query token, 32 query heads over 8 kv heads,
    # head dim 128, a cache of 4k tokens, cache_seqlens an int32 tensor of the device)
    dq_ = torch.randn(1, 1, 32, 128, device=device, dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 4096, 8, 128, device=device, dtype=torch.bfloat16)
              for _ in range(2))
    lens = torch.full((1,), 4096, dtype=torch.int32, device=device)

    def fc_decode():
        flashcore.attention_with_kvcache(dq_, kc, vc, cache_seqlens=lens)

    # the same step over a paged cache (pages of 256 tokens, the block table an int32 tensor
    # of the device): what the block table adds on the host (#14: +4-5 µs on the device's
    # host in session 41, 0.9 µs stubbed)
    kp, vp = (x.view(16, 256, 8, 128) for x in (kc, vc))
    table = torch.arange(16, dtype=torch.int32, device=device).view(1, 16)

    def fc_decode_paged():
        flashcore.attention_with_kvcache(dq_, kp, vp, cache_seqlens=lens, block_table=table)

    kv_read = ops.kvcache_read.default
    dscale = 1 / math.sqrt(128)

    def op_decode():
        kv_read(dq_, kc, vc, lens, (0, False, False, dscale, -1, -1, 0.0, 0))

    def op_decode_paged():
        kv_read(dq_, kp, vp, lens, (0, False, False, dscale, -1, -1, 0.0, 0), table)

    # the transformers route's decoding step (#14's dynamic-cache generate): flashcore's
    # attention function on transformers' (b, h, s, d) tensors, batch 1, 16 query heads over
    # 4, head dim 128, a 576-token cache; a forward's 8 layers a call, its position_ids and
    # mask new each forward (as in a model: the layers share what is computed from them).
    # tf_direct: the lengths shared alike, then the read op's implementation called directly
    # (none of the route's Python); the floor of the route above the plan's key.
    from flashcore.integrations import transformers as fct
    tq = torch.randn(1, 16, 1, 128, device=device, dtype=torch.bfloat16)
    tk, tv = (torch.randn(1, 4, 576, 128, device=device, dtype=torch.bfloat16)
              for _ in range(2))
    pos0 = torch.full((1, 1), 575, dtype=torch.int64, device=device)
    mask0 = torch.ones(1, 576, dtype=torch.int64, device=device)     # (as generate passes it)
    layer = types.SimpleNamespace(is_causal=True)
    tscale = 128 ** -0.5
    read_opts = [0.0, 0.0, 1.0, tscale, -1.0, 0.0, 0.0, 0.0, 1.0]

    def tf_decode():
        pos = pos0.clone()
        for _ in range(8):
            fct.flashcore_attention_forward(layer, tq, tk, tv, None, scaling=tscale,
                                            position_ids=pos)

    def tf_decode_mask():
        pos, mask = pos0.clone(), mask0.clone()
        # (the mask function, twice, as transformers calls it for a forward)
        mask = fct.padding_mask(attention_mask=fct.padding_mask(attention_mask=mask,
                                                                kv_length=576), kv_length=576)
        for _ in range(8):
            fct.flashcore_attention_forward(layer, tq, tk, tv, mask, scaling=tscale,
                                            position_ids=pos)

    def tf_direct():
        pos = pos0.clone()
        for _ in range(8):
            lens = fct._per_forward(pos, ("lens", 576, 1), fct._lens_from_positions, pos, 1,
                                    576)
            torch_ops._kvcache_read_impl(tq, tk, tv, lens, read_opts)

    return {"fc_fwd": fc_fwd, "sdpa_fwd": sdpa_fwd, "sdpa1_fwd": sdpa1_fwd,
            "fc_fwd_grad": fc_fwd_grad, "nothing_fwd_grad": nothing_fwd_grad,
            "fc_step": fc_step, "nothing_step": nothing_step, "sdpa_step": sdpa_step,
            "sdpa1_step": sdpa1_step, "op_fwd": op_fwd, "op_bwd": op_bwd,
            "fc_decode": fc_decode, "op_decode": op_decode, "fc_decode_paged": fc_decode_paged,
            "op_decode_paged": op_decode_paged, "tf_decode": tf_decode,
            "tf_decode_mask": tf_decode_mask, "tf_direct": tf_direct}, \
        (q, k, v, do, o, lse)


def pieces(tensors):
    """The parts of a replay, each alone, as the ops' kernels do them."""
    q, k, v, do, o, lse = tensors
    layout = torch_backend.layout
    cfg = flashcore.config.get()
    scale = 1 / math.sqrt(SHAPE[-1])
    fopts = [0.0, 0.0, 1.0, scale, -1.0, 0.0, 0.0, 0.0]    # the options as the ops receive them

    def key_fwd():
        return ("fwd", layout(q), layout(k), layout(v), layout(None), layout(None),
                layout(None), tuple(fopts), cfg, layout(None), False, 0.0, layout(None))

    def key_bwd():
        return ("bwd", layout(do), layout(q), layout(k), layout(v), layout(o), layout(lse),
                layout(None), layout(None), layout(None), tuple(fopts), cfg, 0.0, layout(None))
    fwd_plan = plans.lookup(key_fwd())
    bwd_plan = plans.lookup(key_bwd())
    if fwd_plan is None or bwd_plan is None:
        print("warning: the pieces' keys find no plan (the ops' keys changed?)", file=sys.stderr)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), 0, 0, 0, 0, 0)
    bptrs = (do.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
             lse.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, 0, 0, 0)
    dev = q.device
    f32, cf = torch.float32, torch.contiguous_format

    def alloc(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        return t, t.data_ptr()
    out = {
        "layout(q)": lambda: layout(q),
        "key_fwd": key_fwd,
        "key+lookup_fwd": lambda: plans.lookup(key_fwd()),
        "key+lookup_bwd": lambda: plans.lookup(key_bwd()),
        "allocs_fwd": lambda: (torch.empty_like(q, memory_format=cf),
                               q.new_empty(*SHAPE[:1], SHAPE[2], SHAPE[1], dtype=f32)),
        "allocs_bwd": lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
        "alloc_scratch": lambda: alloc(SHAPE[0] * SHAPE[2] * SHAPE[1] * (SHAPE[3] + 1) * 4),
    }
    if fwd_plan is not None and bwd_plan is not None:
        out["run_fwd_plan"] = lambda: fwd_plan.run(ptrs, 0, alloc)
        out["run_bwd_plan"] = lambda: bwd_plan.run(bptrs, 0, alloc)
    return out


def per_call_us(fns, n, rounds, sync, clock=time.perf_counter, round_s=0.05):
    """Best of ``rounds`` interleaved rounds: each times up to ``n`` calls of every callable
    in turn (fewer for a slow one: about ``round_s`` seconds, judged from 20 warm-up calls),
    then synchronises: flashcore.bench.per_call_us_interleaved."""
    return per_call_us_interleaved(fns, n, warmup=20, rounds=rounds, sync=sync, clock=clock,
                                   round_s=round_s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real", action="store_true", help="CUDA tensors, nothing stubbed")
    ap.add_argument("--no-launch", action="store_true",
                    help="with --real: cuLaunchKernel a no-op (the driver's launch left out)")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--cases", help="comma-separated case names to time (default: all)")
    ap.add_argument("--profile", metavar="CASE", help="cProfile of CASE instead of the table")
    args = ap.parse_args(argv)

    if args.real:
        device, sync, clock = "cuda", torch.cuda.synchronize, time.perf_counter
        fns, tensors = cases(device)
        for fn in fns.values():     # record the plans (and load the kernels)
            fn()
        sync()
        if args.no_launch:
            from flashcore.kernels import device as fc_device
            fc_device.driver().launch = _no_launch
    else:
        # the process's CPU time: on a shared machine, time spent descheduled is not counted
        device, sync, clock = "cpu", (lambda: None), time.process_time
        stub_device()
        with recording_stand_in():
            fns, tensors = cases(device)
            for name, fn in fns.items():
                if not name.startswith("sdpa"):
                    fn()
    if (not all(k[0] in ("fwd", "bwd", "kvcache") for k in plans.PLANS)
            or len(plans.PLANS) != 6):
        print(f"warning: {len(plans.PLANS)} plans recorded (expected fwd, bwd, four kvcache: "
              "contiguous, paged, the transformers route's without and with a key mask): the "
              "calls may not be replaying", file=sys.stderr)

    mode = "real" if args.real else "stubbed (CPU tensors, no device)"
    if args.real and args.no_launch:
        mode = "real tensors, cuLaunchKernel stubbed"
    print(f"# probe_route: {mode}; torch {torch.__version__}; shape {SHAPE} bf16 causal; "
          f"best of {args.rounds} x {args.calls} calls, us per call")

    if args.profile:
        import cProfile
        import pstats
        fn = fns[args.profile]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        sync()
        pr.disable()
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        return

    if args.cases:
        fns = {n: fns[n] for n in args.cases.split(",") if n in fns}
    us = per_call_us(fns, args.calls, args.rounds, sync, clock)
    for name, t in us.items():
        print(f"{name:18s} {t:8.2f}")
    for name, a, b, op in (("fwd - sdpa", "fc_fwd", "sdpa_fwd", "-"),
                           ("step / sdpa", "fc_step", "sdpa_step", "/"),
                           ("step - nothing", "fc_step", "nothing_step", "-")):
        if a in us and b in us:
            print(f"{name:18s} {us[a] - us[b] if op == '-' else us[a] / us[b]:8.3g}")
    if not args.cases:
        print("# pieces of a replay")
        for name, t in per_call_us(pieces(tensors), args.calls, args.rounds, sync,
                                   clock).items():
            print(f"{name:18s} {t:8.2f}")


if __name__ == "__main__":
    main()
