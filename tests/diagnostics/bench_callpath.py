"""What users pay per call, end to end, against torch SDPA and "sdpa" in the same run.

    python tests/diagnostics/bench_callpath.py [decode] [decode_host] [decode_lengths] [tiny]
                                               [cupy] [llama] [generate] [generate_static]
                                               [generate_parts] [generate_ab:COMMIT]
                                               [forwards] [prefills] [prefill_calls]
                                               [compile] [profile] [launch_gil] [--json F]

decode    flashcore.bench.decode: attention_with_kvcache (cache_seqlens a CUDA int32 tensor,
          GQA 32/8, d128, bf16), contiguous and paged, batch 1/8/64 x cache 4k/16k/128k: GPU
          time, host loop, CUDA-graph replay, against SDPA cuDNN (``python -m flashcore.bench
          --decode`` prints the same table).
decode_host  whether a decode host loop runs at the host's pace or the kernels': per call, the
          host's own time (100 calls from an empty queue, the clock read before the
          synchronisation), the loop alone and interleaved with SDPA cuDNN's, and the GPU time,
          at batch 1 / 4k, 8 / 4k, 8 / 16k, 64 / 4k (contiguous cache); where the host's time
          exceeds the GPU time the loop runs at the host's pace.
tiny      the tiny training step (flashcore.bench.tiny_calls) in a host loop: the steady state,
          and the first 1000 steps of a fresh process per call (median of 3 rounds), against
          SDPA.
cupy      the same calls on CuPy arrays (forward, forward then backward, a decode step at
          batch 1 / 4k) against the torch calls, interleaved.
llama     a transformers Llama (random init, 8 layers, hidden 2048, 16/4 heads, bf16) training
          step (forward with labels, backward), eager, flashcore vs "sdpa".
generate  greedy generate of 128 tokens, batch 1 / prompt 512 and batch 8 / prompt 2k: the
          three models ("sdpa", flashcore, flashcore with left padding) held together and
          timed in turn after an untimed whole generate of each, 5 rounds, median tokens/s;
          then "sdpa" and flashcore over cache lengths new to both (2 rounds).
generate_static  the same with cache_implementation="static" (compiled by transformers), 64
          tokens after each model's warm-up generate, 5 rounds.
generate_parts  where the dynamic-cache step goes, in the model: tokens/s over "sdpa"'s of
          flashcore and of flashcore with parts taken away (the op through the dispatcher, the
          mask dropped, the route's Python skipped, the plan launched by hand), 64 tokens,
          7 rounds in turn (``fc_unbound``: the layers not binding the forward's plan).
generate_ab:COMMIT  this flashcore against the one of COMMIT (git archive, imported beside it
          under another name), "sdpa" with them, in one process: greedy generate of 64 tokens,
          7 rounds in turn, batch 1 / 512 and 8 / 2k; ratios to "sdpa" and to COMMIT's.
forwards  the dynamic-cache generate's decoding step and prefill forwards timed apart, "sdpa"
          against flashcore (12 rounds in turn, all-ones mask, the step's cache cropped back
          each time), ms a forward and the ratio, a prefill's kernel launches and GPU time
          (torch.profiler); to stderr, that profile's table and cProfile of 40 steps of each
          model.
prefills  where the prefill's gap goes: the prefill (all-ones mask) of "sdpa", flashcore and
          flashcore with the mask dropped (the dense call, no packing), 9 rounds in turn: ms,
          ratio, the host's own time, launches and GPU time (torch.profiler); cProfile of
          each to stderr.
prefill_calls  one prefill layer's attention call alone (b1 / 512 and b8 / 2k, 16 / 4 heads,
          d128, bf16, causal): flashcore.varlen_attention over packed rows, flashcore.attention
          dense, and SDPA, host loops interleaved and GPU time, plans recorded in the loops;
          cProfile of the varlen calls to stderr.
compile   torch.compile of the llama training step (batch 4 x 4k), flashcore vs "sdpa".
decode_lengths  the transformers attention functions at a decoding step, flashcore's against
          sdpa's: a host loop at one cache length, and single calls at cache lengths new to
          the process, then seen (a growing DynamicCache makes every step's length new).
profile   cProfile of the host side of a decode step and of the tiny forward and step.
launch_gil  the tiny forward and step with the driver's calls made through ctypes prototypes
          that release the GIL (CFUNCTYPE, flashcore's) and that hold it (PYFUNCTYPE), host
          loops interleaved with SDPA's, and a driver call that does nothing
          (cuCtxGetCurrent) each way, timed alone: whether handing the GIL over around each
          cuLaunchKernel costs the host.

The timers and problems are flashcore.bench's: ``host_loop_us`` and ``per_call_us_interleaved``
(host loops), ``wall_time`` (a training step's loop, a generate call, a warm-up), ``tiny_calls``
and ``DecodeProblem``. Prints one line per measurement; --json writes the rows.
"""
from __future__ import annotations

import json
import sys

import torch

import flashcore
from flashcore.bench import (LLAMA_IMPLS, DecodeProblem, generate_new_length_rounds,
                             generate_rounds, generate_setup, host_loop_us, llama_model,
                             per_call_us_interleaved, speed_ratio, tiny_calls, train_step_ms,
                             wall_time)

ROWS: list = []


def emit(**row):
    ROWS.append(row)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)


def decode():
    from flashcore.bench import decode as decode_table
    for r in decode_table():
        emit(section="decode", **r)


def decode_host(shapes=((1, 4096), (8, 4096), (8, 16384), (64, 4096))):
    from flashcore.bench import enqueue_us, gpu_time, sdpa_pinned
    for b, s in shapes:
        pb = DecodeProblem(b, s, seed=b * 100003 + s)
        fns = {"flashcore": pb.api, "sdpa_cudnn": pb.sdpa_unpinned}
        with sdpa_pinned("sdpa_cudnn"):
            for fn in fns.values():
                for _ in range(30):
                    fn()
            torch.cuda.synchronize()
            row = {}
            for name, fn in fns.items():
                row[f"{name}_host_us"] = enqueue_us(fn)
                row[f"{name}_loop_alone_us"] = per_call_us_interleaved({name: fn}, 2000,
                                                                       round_s=0.05)[name]
                row[f"{name}_gpu_us"] = gpu_time(fn) * 1e6
            for name, us in per_call_us_interleaved(fns, 2000, round_s=0.05).items():
                row[f"{name}_loop_interleaved_us"] = us
        emit(section="decode_host", batch=b, cache=s, **row)
        del pb
        torch.cuda.empty_cache()


def tiny(n_first=1000, rounds=3):
    """The steady state, interleaved with SDPA's; then the first ``n_first`` steps of a fresh
    process for each call, one process per call (kernels from the disk cache, which the steady
    part filled): a call measured after another in one process would find torch's lazy imports
    done (``torch.autograd.grad`` with a gradient tensor imports sympy, ~2 s, at its first use)
    and the CUDA libraries loaded. The fresh processes run ``rounds`` times, the calls in turn
    within each round, and the median of each call is reported (its rounds too): that start-up
    moved one call's first-1000 figure by 15-30% between runs."""
    import statistics
    import subprocess
    calls, _ = tiny_calls(peers=("sdpa",))
    calls = {k: calls[k] for k in ("torch_fwd", "sdpa_fwd", "torch_fwdbwd", "sdpa_fwdbwd")}
    steady = {f"{name}_us": us for name, us in per_call_us_interleaved(calls, 2000).items()}
    runs = {name: [] for name in calls}
    for _ in range(rounds):
        for name in calls:
            r = subprocess.run([sys.executable, __file__, "--first", name, str(n_first)],
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"the fresh process for {name} failed:\n{r.stderr[-2000:]}")
            runs[name].append(float(r.stdout.split()[-1]))
    first = {f"{name}_first{n_first}_us": statistics.median(v) for name, v in runs.items()}
    print("# first-steps rounds (µs a call): "
          + "; ".join(f"{name} " + " ".join(f"{x:.1f}" for x in v) for name, v in runs.items()))
    emit(section="tiny", **first, **steady,
         fwd_minus_sdpa_us=steady["torch_fwd_us"] - steady["sdpa_fwd_us"],
         step_over_sdpa=steady["torch_fwdbwd_us"] / steady["sdpa_fwdbwd_us"],
         first_fwd_minus_sdpa_us=(first[f"torch_fwd_first{n_first}_us"]
                                  - first[f"sdpa_fwd_first{n_first}_us"]),
         first_step_over_sdpa=(first[f"torch_fwdbwd_first{n_first}_us"]
                               / first[f"sdpa_fwdbwd_first{n_first}_us"]))


def _first_steps(name, n):
    """The first ``n`` calls of ``name`` in this (fresh) process, µs a call: the tensors made
    first (the CUDA context), nothing of flashcore or SDPA called before the timed loop."""
    import torch.nn.functional as F
    shape = (1, 128, 2, 64)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if name.startswith("sdpa"):
        q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    fn = {"torch_fwd": lambda: flashcore.attention(q, k, v, causal=True),
          "sdpa_fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}.get(name)
    if fn is not None:
        def call():
            with torch.no_grad():
                fn()
    else:
        att = (lambda: flashcore.attention(qg, kg, vg, causal=True)) if name == "torch_fwdbwd" \
            else (lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True))

        def call():
            torch.autograd.grad(att(), (qg, kg, vg), do)
    return host_loop_us(call, steps=n, warmup=0, rounds=1)


def cupy_calls():
    """CuPy users' per-call cost against the same calls on torch tensors (host loop)."""
    import cupy
    calls, (q, k, v, do) = tiny_calls(peers=("sdpa",))
    pb = DecodeProblem(1, 4096)     # batch 1, GQA 32/8, d128, a full 4k cache
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    o, lse = flashcore.attention_forward(q, k, v, causal=True)

    def torch_bwd():
        flashcore.attention_backward(do, q, k, v, o, lse, causal=True)
    co, clse = flashcore.attention_forward(cq, ck, cv, causal=True)

    def cupy_bwd():
        flashcore.attention_backward(cdo, cq, ck, cv, co, clse, causal=True)
    calls = {"torch_fwd": calls["torch_fwd"], "cupy_fwd": calls["cupy_fwd"],
             "torch_bwd": torch_bwd, "cupy_bwd": cupy_bwd,
             "torch_decode": lambda: flashcore.attention_with_kvcache(pb.q, pb.k_cache,
                                                                      pb.v_cache,
                                                                      cache_seqlens=pb.cache_seqlens),
             "cupy_decode": lambda: flashcore.attention_with_kvcache(pb.cq, pb.ck, pb.cv,
                                                                     cache_seqlens=pb.cs)}
    us = per_call_us_interleaved(calls, 2000)
    emit(section="cupy", **{f"{n}_us": t for n, t in us.items()},
         fwd_minus_torch_us=us["cupy_fwd"] - us["torch_fwd"],
         bwd_minus_torch_us=us["cupy_bwd"] - us["torch_bwd"],
         decode_minus_torch_us=us["cupy_decode"] - us["torch_decode"])


def llama(shapes=((1, 16384), (4, 4096))):
    for batch, seqlen in shapes:
        r = {}
        for impl in ("sdpa", "flashcore"):
            model = llama_model(impl)
            r[impl + "_ms"], r[impl + "_loss"], _ = train_step_ms(model, batch, seqlen)
            del model
            torch.cuda.empty_cache()
        emit(section="llama_train_eager", batch=batch, seqlen=seqlen, **r,
             speedup=r["sdpa_ms"] / r["flashcore_ms"])


def compile_step(batch=4, seqlen=4096):
    import torch._dynamo
    r = {}
    for impl in ("sdpa", "flashcore"):
        torch._dynamo.reset()
        model = llama_model(impl)
        torch._dynamo.config.capture_scalar_outputs = False
        explain = None
        try:
            ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")
            explain = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
            torch._dynamo.reset()
            r[impl + "_graph_breaks"] = explain.graph_break_count
            r[impl + "_ms"], r[impl + "_loss"], r[impl + "_compile_s"] = train_step_ms(
                model, batch, seqlen, compiled=True)
        except Exception as e:
            print(f"# compile failed for {impl}: {type(e).__name__}: {str(e)[:400]}")
            r[impl + "_ms"] = float("nan")
        del model
        torch.cuda.empty_cache()
    emit(section="llama_train_compiled", batch=batch, seqlen=seqlen, **r,
         speedup=r["sdpa_ms"] / r["flashcore_ms"])


def _by_round(batch, new, times):
    """``times`` ({impl: [seconds]}) as tokens/s, round by round."""
    return "; ".join(f"{impl} " + " ".join(f"{batch * new / x:.1f}" for x in t)
                     for impl, t in times.items())


def _generate_row(section, batch, prompt, new, r, times, outs):
    import statistics
    for impl, t in times.items():
        r[impl + "_tok_s"] = batch * new / statistics.median(t)
    print(f"# {section} {batch} x {prompt}, tokens/s by round: " + _by_round(batch, new, times))
    same = (outs["sdpa"] == outs["flashcore"]).int().cumprod(1).sum(1)
    emit(section=section, batch=batch, prompt=prompt, **r,
         ratio=speed_ratio(times, "flashcore", "sdpa"),
         ratio_left_padding=speed_ratio(times, "flashcore_lp", "sdpa"),
         equal_prefix_min=int(same.min()), equal_prefix_mean=float(same.float().mean()))


def _generate_cold(models, batch, prompt, new, kw, rounds, names=("sdpa", "flashcore")):
    """Tokens/s of the models ``names`` over cache lengths new to the process
    (:func:`flashcore.bench.generate_new_length_rounds`, ``rounds`` rounds): each model's
    tokens/s by round printed, then the medians and flashcore's ratio to "sdpa"
    (flashcore.bench.speed_ratio), with the rounds' seconds.
    (flashcore_lp would find flashcore's plans: not timed.)"""
    import statistics
    cold = generate_new_length_rounds({n: models[n] for n in names}, batch, prompt, new, kw,
                                      rounds)
    print(f"# generate {batch} x {prompt}, new cache lengths, tokens/s by round: "
          + _by_round(batch, new, cold))
    out = {f"{impl}_cold_tok_s": batch * new / statistics.median(t) for impl, t in cold.items()}
    out["ratio_cold"] = speed_ratio(cold, "flashcore", "sdpa")
    return out, cold


def generate(shapes=((1, 512), (8, 2048)), new=128, rounds=5, cold_rounds=2):
    """Greedy generate of ``new`` tokens, the three models held together and timed in turn,
    ``rounds`` times (median tokens/s), after a whole untimed generate of each (run 219: with
    an 8-token warm-up, "sdpa"'s first timed round at batch 1 read 17.6 tokens/s and the
    next two 116.8 and 85.1: the first round measured a cold start, not the loop); then the
    same over cache lengths new to both (:func:`_generate_cold`); the first step's logits of
    sdpa and flashcore."""
    for batch, prompt in shapes:
        models, ids, kw, _ = generate_setup(LLAMA_IMPLS, batch, prompt, new)
        with torch.no_grad():
            # the first step's logits: how close the two are (greedy tokens of a random model
            # flip on near-ties)
            la, lb = (models[i](ids).logits[:, -1].float() for i in ("sdpa", "flashcore"))
        times, outs = generate_rounds(models, ids, kw, rounds)
        r = dict(logits_maxdiff=float((la - lb).abs().max()), logits_scale=float(la.abs().max()))
        r.update(_generate_cold(models, batch, prompt, new, kw, cold_rounds)[0])
        _generate_row("generate", batch, prompt, new, r, times, outs)
        del models, la, lb
        torch.cuda.empty_cache()


def generate_static(shapes=((1, 512), (8, 2048)), new=64, rounds=5):
    """Greedy generate with ``cache_implementation="static"`` (which transformers compiles):
    each model's warm-up generate (which compiles) timed once, then timed generates of the
    three models in turn, ``rounds`` times (median tokens/s); graphs compiled during the timed
    rounds (recompiles: 0 when shapes stay static); the first tokens, sdpa's against
    flashcore's."""
    for batch, prompt in shapes:
        models, ids, kw, warm_s = generate_setup(LLAMA_IMPLS, batch, prompt, new, static=True)
        r = {impl + "_warm_s": t for impl, t in warm_s.items()}
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        times, outs = generate_rounds(models, ids, kw, rounds)
        r["new_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        _generate_row("generate_static", batch, prompt, new, r, times, outs)
        del models
        torch.cuda.empty_cache()


def profile(n=300):
    """cProfile of the host side of the decode step (batch 1, 4k) and of the tiny forward."""
    import cProfile
    import pstats
    pb = DecodeProblem(1, 4096)     # batch 1, GQA 32/8, d128, a full 4k cache
    qt = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    qg = qt.clone().requires_grad_()
    do = torch.randn_like(qt)

    def step():
        with torch.enable_grad():
            o = flashcore.attention(qg, qg, qg, causal=True)
            torch.autograd.grad(o, (qg,), do)
    calls = {"decode": pb.api,
             "tiny_fwd": lambda: flashcore.attention(qt, qt, qt, causal=True),
             "tiny_step": step}
    for name, fn in calls.items():
        with torch.no_grad():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                fn()
            pr.disable()
        torch.cuda.synchronize()
        print(f"# profile {name}: {n} calls")
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(14)
        st.sort_stats("cumulative").print_stats(14)


def launch_gil():
    import ctypes
    from flashcore.kernels import device
    drv = device.driver()
    lib = device.libcuda()
    released = dict(drv._fn)
    held = {name: ctypes.PYFUNCTYPE(device._I, *args)((name, lib))
            for name, args in drv._PROTOS.items()}

    def use(table):
        drv._fn = table
        drv.launch = table["cuLaunchKernel"]
    calls, _ = tiny_calls(peers=("sdpa",))
    fns = {}
    for tag, table in (("released", released), ("held", held)):
        for name in ("torch_fwd", "torch_fwdbwd"):
            def f(table=table, fn=calls[name]):
                use(table)
                fn()
            fns[f"{name}_{tag}"] = f
    fns["sdpa_fwd"], fns["sdpa_fwdbwd"] = calls["sdpa_fwd"], calls["sdpa_fwdbwd"]
    try:
        res = per_call_us_interleaved(fns, 2000, round_s=0.05)
    finally:
        use(released)
    # a driver call that does nothing (cuCtxGetCurrent), each way, alone
    out = ctypes.c_void_p()
    addr = ctypes.addressof(out)
    for tag, table in (("released", released), ("held", held)):
        fn = table["cuCtxGetCurrent"]
        res[f"ctx_get_{tag}"] = host_loop_us(lambda fn=fn: fn(addr), steps=20000, warmup=100,
                                            sync=lambda: None)
    emit(section="launch_gil", **res)


def decode_lengths(shapes=((1, 576), (8, 2176)), lengths=40):
    """The transformers attention functions at a decoding step (16 / 4 heads, d128, bf16; one
    query over a (batch, heads, cache, dim) cache as DynamicCache holds it, position_ids given):
    flashcore's registered function against transformers' sdpa_attention_forward, per call,
    (a) in a host loop at one cache length, interleaved, each callable a forward's 8 layers
    (``*_loop_us`` is per layer: the forward's time / 8); (b) one call at each of ``lengths``
    cache lengths that neither has seen (``wall_time``: one call ended by a synchronisation,
    median and max), then the same lengths again: a growing cache gives every decoding step a
    length new to the process, and flashcore keys a decode step's launch plan on it.

    flashcore's calls come in three routes: ``flashcore`` with no mask (a model called without
    ``attention_mask``), ``flashcore_mask`` with the all-ones (batch, cache) mask that
    ``generate`` passes when no padding was given (``padding_mask`` hands it on without testing
    it: the decode kernel under the mask), ``flashcore_lp`` the same under
    ``register(left_padding=True)``. "sdpa" gets None: its mask function finds the all-ones mask
    and drops it (a read to the host once a forward, before the layers)."""
    import statistics
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    import flashcore.integrations.transformers as fct

    class Layer(torch.nn.Module):      # what the functions read of the attention module
        is_causal = True
        num_key_value_groups = 4
    layer = Layer()
    scale = 128 ** -0.5

    def step_of(impl, b, sk, layers=1):
        """One forward's ``layers`` calls (the same query and cache: the host's cost), the
        position_ids and mask new tensors each forward, as transformers makes them (the
        layers of a forward share what flashcore derives from them)."""
        q = torch.randn(b, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, 4, sk, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        pos0 = torch.full((b, 1), sk - 1, device="cuda", dtype=torch.int64)
        mask0 = fct.padding_mask(attention_mask=torch.ones(b, sk, device="cuda",
                                                           dtype=torch.int64), kv_length=sk)
        fn = {"flashcore": fct.flashcore_attention_forward,
              "flashcore_mask": fct.flashcore_attention_forward,
              "flashcore_lp": fct.flashcore_attention_forward_left_padded}.get(impl)

        def forward():
            pos, mask = pos0.clone(), mask0.clone()
            for _ in range(layers):
                if fn is None:
                    sdpa_attention_forward(layer, q, k, v, None, scaling=scale, is_causal=False)
                else:
                    fn(layer, q, k, v, None if impl == "flashcore" else mask, scaling=scale,
                       position_ids=pos)
        return forward
    impls = ("flashcore", "flashcore_mask", "flashcore_lp", "sdpa")
    layers = 8
    with torch.no_grad():
        for b, sk in shapes:
            fns = {impl: step_of(impl, b, sk, layers) for impl in impls}
            for fn in fns.values():
                for _ in range(10):
                    fn()
            torch.cuda.synchronize()
            row = {f"{k}_loop_us": x / layers for k, x in
                   per_call_us_interleaved(fns, 300, round_s=0.05).items()}
            for i, impl in enumerate(impls):
                first = sk + 8 + 2 * lengths * i
                for phase in ("new", "seen"):
                    ts = [wall_time(step_of(impl, b, n)) * 1e6
                          for n in range(first, first + lengths)]
                    row[f"{impl}_{phase}_length_us"] = statistics.median(ts)
                    row[f"{impl}_{phase}_length_max_us"] = max(ts)
            emit(section="decode_lengths", batch=b, cache=sk, **row)


def _part_functions():
    """The attention functions of :func:`generate_parts`, registered under their names
    (``fc_`` + part): flashcore's own function as the model calls it, and the same step with a
    part taken away each, down to a recorded plan launched by hand."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import flashcore.integrations.transformers as fct
    from flashcore import config
    from flashcore.backends import torch_ops
    from flashcore.kernels import plans
    needed = torch_ops._dispatcher_needed

    def fc_op(module, q, k, v, mask, **kw):        # the op called through the dispatcher
        torch_ops._dispatcher_needed = lambda torch: True
        try:
            return fct.flashcore_attention_forward(module, q, k, v, mask, **kw)
        finally:
            torch_ops._dispatcher_needed = needed

    def fc_positions(module, q, k, v, mask, **kw):     # the mask dropped: positions' lengths
        return fct.flashcore_attention_forward(module, q, k, v, None, **kw)

    def _lens(module, q, k, v, kw):
        pos = kw["position_ids"]
        b, sk = q.shape[0], k.shape[2]
        return fct._per_forward(pos, ("lens", sk, b), fct._lens_from_positions, pos, b, sk)

    def fc_direct(module, q, k, v, mask, scaling=None, **kw):   # no route Python
        if q.shape[2] >= k.shape[2]:
            return fct.flashcore_attention_forward(module, q, k, v, None, scaling=scaling, **kw)
        opts = [0.0, 0.0, 1.0, scaling, -1.0, 0.0, 0.0, 0.0, 1.0]
        return torch_ops._kvcache_read_impl(q, k, v, _lens(module, q, k, v, kw), opts)[0], None

    floor = {}
    stream = torch._C._cuda_getCurrentRawStream

    def fc_floor(module, q, k, v, mask, scaling=None, **kw):    # no key either
        if q.shape[2] >= k.shape[2]:
            return fct.flashcore_attention_forward(module, q, k, v, None, scaling=scaling, **kw)
        lens = _lens(module, q, k, v, kw)
        b, h, s, d = q.shape
        plan = floor.get((b, k.shape[2]))
        if plan is None:
            out = torch_ops.kvcache_read(q, k, v, lens, None, None, True, scaling, (-1, -1),
                                         0.0, heads_first=True)
            # (the plan that call replayed or recorded: its key, as the read op makes it)
            opts = (0, False, True, scaling, -1, 0, 0.0, 0, True)
            found = plans.PLANS.get(torch_ops._kvcache_key(q, k, v, lens, opts, config.get(),
                                                           None, None, None))
            if found is not None:
                floor[(b, k.shape[2])] = found
            return out, None
        out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        plan.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                  lens.data_ptr(), 0, 0, 0, 0, 0, 0), stream(q.get_device()), None)
        return out, None
    def fc_unbound(module, q, k, v, mask, scaling=None, **kw):   # the masked route, unbound
        sq, sk = q.shape[2], k.shape[2]
        if sq >= sk or mask is None:
            return fct.flashcore_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
        keep, first, end = fct._per_forward(mask, ("cache_unbound", sk, sq), fct._cache_route_of,
                                            mask, sk, sq, False, -1)
        return torch_ops.kvcache_read(q, k, v, end, first, keep, True, scaling, (-1, -1), 0.0,
                                      True, None).contiguous(), None
    fns = {"fc_op": fc_op, "fc_positions": fc_positions, "fc_direct": fc_direct,
           "fc_floor": fc_floor, "fc_unbound": fc_unbound}
    for name, fn in fns.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, fct.padding_mask)
    return list(fns)


def generate_parts(shapes=((1, 512), (8, 2048)), new=64, rounds=7):
    """Where the dynamic-cache generate's step goes, measured in the model (session 61: a host
    loop of the layers alone shows about half of what the model pays for the same Python).
    Tokens/s of one model under "sdpa", flashcore, and flashcore with parts taken away, held in
    one process and timed in turn (rounds, the order turning), each a ratio to "sdpa" (the
    median of the rounds' ratios, flashcore.bench.speed_ratio):
    ``fc_op`` the op called through the dispatcher (not directly: what the direct call saves);
    ``fc_positions`` the mask dropped (the positions' lengths: what the masked route costs);
    ``fc_direct`` the lengths, then the read op's implementation (none of the route's Python);
    ``fc_floor`` the lengths, then the layer's recorded plan launched by hand (no plan key, no
    checks: the floor of a Python launch); ``fc_unbound`` the masked route with the layers not
    binding the forward's plan (each builds its key: what the binding saves). The parts give
    flashcore's tokens (checked)."""
    names = ["sdpa", "flashcore"] + _part_functions()
    for batch, prompt in shapes:
        models, ids, kw, _ = generate_setup(names, batch, prompt, new)
        times, outs = generate_rounds(models, ids, kw, rounds)
        print(f"# generate_parts {batch} x {prompt}, tokens/s by round: "
              + _by_round(batch, new, times))
        emit(section="generate_parts", batch=batch, prompt=prompt,
             **{f"{n}_ratio": speed_ratio(times, n, "sdpa") for n in times},
             tokens_equal=all(bool(torch.equal(o, outs["flashcore"])) for n, o in outs.items()
                              if n != "sdpa"))
        del models
        torch.cuda.empty_cache()


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _profile_to_stderr(title, fn, n, top):
    """cProfile of ``n`` calls of ``fn`` (ended by a synchronisation), its ``top`` entries by
    own time, to stderr under ``=== title``."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(top)
    print(f"=== {title}\n" + text.getvalue(), file=sys.stderr)


def _launches_and_gpu_ms(fn, title=None):
    """torch.profiler over one call of ``fn`` (ended by a synchronisation): its kernel launches
    and GPU time in ms, what host noise does not move. The GPU time is the device events' own
    (the table's "Self CUDA time total"; the host ops' rows carry their kernels' time too, so
    a sum over every row counts each kernel twice, as run 247's rows did). With ``title``, the
    profile's table goes to stderr under ``=== title``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    if title is not None:
        print(f"=== {title}\n" + events.table(sort_by="self_cpu_time_total", row_limit=16,
                                              max_name_column_width=50), file=sys.stderr)
    return (sum(e.count for e in events if e.key in _LAUNCHES),
            1e-3 * sum(getattr(e, "self_device_time_total", None)
                       or getattr(e, "self_cuda_time_total", 0)
                       for e in events if e.device_type == DeviceType.CUDA))


def forwards(shapes=((1, 512), (8, 2048)), rounds=12, steps=40, prefills=3):
    """The dynamic-cache generate's two kinds of forward timed apart, "sdpa" against flashcore
    in one process (what the generate figures cannot split: session 66's forward-hook stamps
    put flashcore's prefill 3-5 ms and its median step 2-4% behind on a busy host, and the whole
    generate at 0.99x): a decoding step (one token over a DynamicCache holding the prompt,
    cropped back by one after each forward, so that every step meets the same length) and the
    prefill (the prompt into a fresh DynamicCache), both under the all-ones mask ``generate``
    passes. ``rounds`` rounds in turn, the order turning, each round ``steps`` steps a model
    ended by a synchronisation (flashcore.bench.wall_time), or the best of ``prefills``
    prefills (flashcore.bench.prefill_rounds, asv's PrefillRatio's timer): ms a forward,
    and flashcore's speed over "sdpa"'s (flashcore.bench.speed_ratio); and, from
    torch.profiler over one prefill of each model, its kernel launches and GPU time (what a
    busy host does not move: run 246's rounds of "sdpa" spread by 1.3-1.6x). To
    stderr: that profile's table (kernels and host ops), and cProfile's top entries of
    ``steps`` decoding steps of each (where the host time goes)."""
    import statistics

    from transformers import DynamicCache

    from flashcore.bench import generate_ids, prefill_mask, prefill_rounds
    for batch, prompt in shapes:
        models = {impl: llama_model(impl).eval() for impl in ("sdpa", "flashcore")}
        ids = generate_ids(batch, prompt)
        mask = prefill_mask(batch, prompt + 1, False)   # (all ones; a step's is one wider)
        caches = {}

        def step(impl, n=steps):
            model, cache = models[impl], caches[impl]
            for _ in range(n):
                model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache,
                      use_cache=True)
                cache.crop(-1)      # (a negative count: every transformers version's meaning)

        def prefill(impl):      # (the profiled one; the timed ones: prefill_rounds)
            model = models[impl]
            model(input_ids=ids, attention_mask=mask[:, :prompt], use_cache=True,
                  past_key_values=DynamicCache(config=model.config))

        with torch.no_grad():
            for impl, model in models.items():
                caches[impl] = DynamicCache(config=model.config)
                model(input_ids=ids, attention_mask=mask[:, :prompt], use_cache=True,
                      past_key_values=caches[impl])
            order = list(models)
            steps_s = {impl: [] for impl in order}
            for impl in order:
                step(impl)        # (warm)
            for r in range(rounds):
                for impl in order[r % 2:] + order[:r % 2]:
                    steps_s[impl].append(wall_time(lambda: step(impl)) / steps)
            row = {}
            for kind, times in (("step", steps_s), ("prefill", prefill_rounds(
                    models, ids, mask[:, :prompt], rounds, calls=prefills))):
                for impl, t in times.items():
                    row[f"{impl}_{kind}_ms"] = 1e3 * statistics.median(t)
                row[f"{kind}_ratio"] = speed_ratio(times, "flashcore", "sdpa")
                row[f"sdpa_{kind}_spread"] = max(times["sdpa"]) / min(times["sdpa"])
            for impl in models:
                # what host noise does not move: the prefill's kernel launches and GPU time
                (row[f"{impl}_prefill_launches"],
                 row[f"{impl}_prefill_gpu_ms"]) = _launches_and_gpu_ms(
                    lambda: prefill(impl),
                    f"forwards {batch} x {prompt}: torch.profiler, one prefill, {impl}")
                _profile_to_stderr(f"forwards {batch} x {prompt}: cProfile, {steps} decoding "
                                   f"steps, {impl}", lambda: step(impl), 1, 24)
            emit(section="forwards", batch=batch, prompt=prompt, **row)
        models = caches = None      # (freed before the next shape's models)
        torch.cuda.empty_cache()


def prefills(shapes=((1, 512), (8, 2048)), rounds=9, calls=3):
    """Where the prefill's gap goes (run 246: flashcore's b1/512 prefill 0.754x "sdpa" with 58
    launches more and 0.25 ms more GPU time, which do not add up to its 3.8 ms): one forward of
    the prompt into a fresh DynamicCache under the all-ones mask, "sdpa", flashcore, and
    flashcore with the mask dropped (``fc_positions``: the dense causal call, no packing), timed
    in turn (flashcore.bench.prefill_rounds, ``rounds`` rounds, the best of ``calls`` each):
    ms, ratio to "sdpa"; the host's own time of a prefill (started on an idle device, the clock
    read before the synchronisation: flashcore.bench.enqueue_us), and from torch.profiler its
    kernel launches and GPU time. To stderr: cProfile of ``calls`` prefills of each model, its
    top entries by own time (where the host time goes)."""
    import statistics

    from transformers import DynamicCache

    from flashcore.bench import enqueue_us, generate_ids, prefill_mask, prefill_rounds
    names = ["sdpa", "flashcore", "fc_positions"]
    _part_functions()
    for batch, prompt in shapes:
        models = {impl: llama_model(impl).eval() for impl in names}
        ids = generate_ids(batch, prompt)
        mask = prefill_mask(batch, prompt, False)

        def prefill(model):
            model(input_ids=ids, attention_mask=mask, use_cache=True,
                  past_key_values=DynamicCache(config=model.config))

        row = {}
        with torch.no_grad():
            times = prefill_rounds(models, ids, mask, rounds, calls=calls)
            for impl, model in models.items():
                row[f"{impl}_ms"] = 1e3 * statistics.median(times[impl])
                row[f"{impl}_ratio"] = speed_ratio(times, impl, "sdpa")
                row[f"{impl}_host_ms"] = 1e-3 * enqueue_us(lambda: prefill(model), calls=1,
                                                           rounds=calls)
                row[f"{impl}_launches"], row[f"{impl}_gpu_ms"] = _launches_and_gpu_ms(
                    lambda: prefill(model))
                _profile_to_stderr(f"prefills {batch} x {prompt}: cProfile, {calls} prefills, "
                                   f"{impl}", lambda: prefill(model), calls, 20)
        emit(section="prefills", batch=batch, prompt=prompt, **row)
        models = None
        torch.cuda.empty_cache()


def prefill_calls(shapes=((1, 512), (8, 2048)), calls=200):
    """One prefill layer's attention call alone, as the model makes it (16 query heads over 4,
    head dim 128, bf16, causal): ``flashcore.varlen_attention`` over the packed rows (what the
    padded route runs), ``flashcore.attention`` over the same tensors as one dense batch, and
    SDPA (torch's choice, cuDNN on Hopper), interleaved host loops (µs a call) and GPU time,
    and how many launch plans the loop recorded (0: every call replayed one). Run 247 put
    the varlen op's own host time at about 110 µs a call in the model against cuDNN's 43; the
    stubbed probe (tests/diagnostics/probe_route.py) reads 18.6. To stderr: cProfile of the
    varlen calls."""

    import torch.nn.functional as F

    from flashcore.bench import gpu_time
    from flashcore.kernels import plans
    recorded = [0]
    remember = plans.remember

    def counting(*a, **kw):
        recorded[0] += 1
        return remember(*a, **kw)
    plans.remember = counting
    try:
        for b, s in shapes:
            h, hk, d = 16, 4, 128
            q, k, v = (torch.randn(b * s, n, d, device="cuda", dtype=torch.bfloat16)
                       for n in (h, hk, hk))
            cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * s
            qd, kd, vd = (x.view(b, s, -1, d) for x in (q, k, v))
            qt, kt, vt = (x.transpose(1, 2) for x in (qd, kd, vd))
            fns = {"varlen": lambda: flashcore.varlen_attention(q, k, v, cu, cu, s, s,
                                                                causal=True),
                   "dense": lambda: flashcore.attention(qd, kd, vd, causal=True),
                   "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                  enable_gqa=True)}
            with torch.no_grad():
                before = recorded[0]
                loop = per_call_us_interleaved(fns, calls, warmup=20, rounds=5, round_s=0.05)
                row = {f"{n}_loop_us": us for n, us in loop.items()}
                row.update({f"{n}_gpu_us": 1e6 * gpu_time(fn) for n, fn in fns.items()})
                row["records_in_loops"] = recorded[0] - before
                _profile_to_stderr(f"prefill_calls {b} x {s}: cProfile, {calls} varlen calls",
                                   fns["varlen"], calls, 16)
            emit(section="prefill_calls", batch=b, seqlen=s, **row)
    finally:
        plans.remember = remember


def _package_at(commit):
    """flashcore's transformers integration as of ``commit``, importable beside this one: the
    package and its CUDA sources (``git archive``) in a temporary folder, the package renamed
    ``fc_<commit>`` and its torch.library namespace with it (a namespace is defined once a
    process). Its plans, settings and loaded kernels are its own; the disk cache of compiled
    kernels is shared."""
    import importlib
    import os
    import re
    import subprocess
    import tempfile
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "flashcore", "cuda"],
                             check=True, capture_output=True).stdout
    root = tempfile.mkdtemp(prefix="flashcore_at_")
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    name = "fc_" + re.sub(r"\W", "_", commit)
    os.rename(os.path.join(root, "flashcore"), os.path.join(root, name))
    ops = os.path.join(root, name, "backends", "torch_ops.py")
    with open(ops) as f:
        src = f.read()
    src = (src.replace('Library("flashcore"', f'Library("{name}"')
           .replace('"flashcore::', f'"{name}::').replace("torch.ops.flashcore", f"torch.ops.{name}"))
    with open(ops, "w") as f:
        f.write(src)
    sys.path.insert(0, root)
    return importlib.import_module(name + ".integrations.transformers")


def generate_ab(commit, shapes=((1, 512), (8, 2048)), new=64, rounds=7, cold_rounds=3):
    """This flashcore against flashcore as of ``commit``, in one process (session 61: the
    figure of one generate moves by +-2% from run to run on one tree, more than a change of
    the route may): greedy generate of ``new`` tokens under "sdpa", flashcore and ``fc_old``
    (the integration of ``commit``, :func:`_package_at`), timed in turn, ``rounds`` rounds,
    flashcore's and fc_old's speed ratios to "sdpa", and flashcore's to fc_old (medians of the
    rounds' ratios, flashcore.bench.speed_ratio);
    then the three over cache lengths new to the process (:func:`_generate_cold`)."""

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    old = _package_at(commit)
    AttentionInterface.register("fc_old", old.flashcore_attention_forward)
    AttentionMaskInterface.register("fc_old", old.padding_mask)
    for batch, prompt in shapes:
        models, ids, kw, _ = generate_setup(["sdpa", "flashcore", "fc_old"], batch, prompt, new)
        times, outs = generate_rounds(models, ids, kw, rounds)
        print(f"# generate_ab {batch} x {prompt} against {commit}, tokens/s by round: "
              + _by_round(batch, new, times))
        cold, cold_times = _generate_cold(models, batch, prompt, new, kw, cold_rounds,
                                          ("sdpa", "flashcore", "fc_old"))
        emit(section="generate_ab", commit=commit, batch=batch, prompt=prompt,
             ratio=speed_ratio(times, "flashcore", "sdpa"),
             old_ratio=speed_ratio(times, "fc_old", "sdpa"),
             over_old=speed_ratio(times, "flashcore", "fc_old"),
             tokens_equal_old=bool(torch.equal(outs["flashcore"], outs["fc_old"])),
             ratio_cold=cold["ratio_cold"],
             old_ratio_cold=speed_ratio(cold_times, "fc_old", "sdpa"),
             over_old_cold=speed_ratio(cold_times, "flashcore", "fc_old"))
        del models
        torch.cuda.empty_cache()


def main(argv):
    if argv[:1] == ["--first"]:      # (a fresh process of tiny())
        print(_first_steps(argv[1], int(argv[2])))
        return 0
    jpath = None
    if "--json" in argv:
        i = argv.index("--json")
        jpath = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    sections = argv or ["decode", "tiny", "llama", "generate"]
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, sections {sections}")
    for s in sections:
        if s.startswith("generate_ab:"):
            s, commit = s.split(":", 1)
            run = lambda: generate_ab(commit)  # noqa: E731
        else:
            run = {"decode": decode, "decode_host": decode_host, "tiny": tiny, "cupy": cupy_calls,
                   "llama": llama, "generate": generate, "generate_static": generate_static,
                   "compile": compile_step, "profile": profile, "launch_gil": launch_gil,
                   "decode_lengths": decode_lengths, "generate_parts": generate_parts,
                   "forwards": forwards, "prefills": prefills, "prefill_calls": prefill_calls}.get(s)
        try:
            if run is None:
                raise ValueError(f"unknown section {s!r}")
            run()
        except Exception as e:
            import traceback
            traceback.print_exc()
            emit(section=s, error=f"{type(e).__name__}: {str(e)[:300]}")
        if jpath:
            with open(jpath, "w") as f:
                json.dump(ROWS, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
