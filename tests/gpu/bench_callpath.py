"""What users pay per call, through the public API, against torch SDPA in the same run.

    python tests/gpu/bench_callpath.py [decode] [tiny] [llama] [generate] [compile] [--json F]

decode    attention_with_kvcache (cache_seqlens a CUDA int32 tensor, GQA 32/8, d128, bf16),
          contiguous and paged (256), batch 1/8/64 x cache 4k/16k/128k: GPU time with the L2
          flushed, a host loop of 300 steps without graphs, and CUDA-graph replay; SDPA cuDNN on
          the contiguous cache timed the same three ways.
tiny      1x128x2x64 bf16 causal in a host loop: the first 1000 steps of this process and the
          steady state, forward (no grad) and forward+backward through autograd, vs SDPA.
llama     a transformers Llama (random init, 8 layers, hidden 2048, 16/4 heads, bf16) training
          step (forward with labels, backward), eager, flashcore vs "sdpa".
generate  greedy generate of 128 tokens, batch 1 / prompt 512 and batch 8 / prompt 2k.
compile   torch.compile of the llama training step (batch 4 x 4k), flashcore vs "sdpa".

Only public calls are timed (flashcore.attention, attention_with_kvcache and the transformers
integration), with the arguments users pass. Prints a table per section; --json writes rows.
"""
from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from flashcore.bench import gpu_time_l2_flushed

ROWS: list = []


def emit(**row):
    ROWS.append(row)
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)


def host_loop_us(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_replay_us(fn, steps=20, reps=10):
    """fn captured ``steps`` times in one CUDA graph; GPU time per step of its replays (median
    of ``reps``). Raises if the capture fails."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / steps)
    ts.sort()
    return ts[len(ts) // 2]


def decode(batches=(1, 8, 64), caches=(4096, 16384, 131072), h=32, hk=8, d=128, page=256):
    dev = "cuda"
    for b in batches:
        for L in caches:
            torch.cuda.empty_cache()
            q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
            kc = torch.empty(b, L, hk, d, device=dev, dtype=torch.bfloat16).normal_()
            vc = torch.empty(b, L, hk, d, device=dev, dtype=torch.bfloat16).normal_()
            lens = torch.full((b,), L, device=dev, dtype=torch.int32)
            nbytes = 2 * b * L * hk * d * 2
            blocks = L // page
            perm = torch.randperm(b * blocks, device=dev)
            table = perm.view(b, blocks).to(torch.int32)
            kp = torch.empty(b * blocks, page, hk, d, device=dev, dtype=torch.bfloat16)
            vp = torch.empty_like(kp)
            kp[perm] = kc.view(b * blocks, page, hk, d)
            vp[perm] = vc.view(b * blocks, page, hk, d)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, kc, vc))

            def fc():
                return flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)

            def fc_paged():
                return flashcore.attention_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                        block_table=table)

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            ref = cudnn().transpose(1, 2).float()
            for name, fn in (("contiguous", fc), ("paged", fc_paged)):
                err = (fn().float() - ref).abs().max().item()
                assert err < 2e-2, (name, b, L, err)
            n_loop = 300 if b * L <= 8 * 16384 else 60
            t = {}
            for name, fn in (("cudnn", cudnn), ("fc", fc), ("fc_paged", fc_paged)):
                t[name + "_gpu_us"] = gpu_time_l2_flushed(fn) * 1e6
                t[name + "_loop_us"] = host_loop_us(fn, n_loop)
                try:
                    t[name + "_graph_us"] = graph_replay_us(fn, steps=10 if b * L > 8 * 16384 else 20)
                except Exception as e:       # reported, not hidden
                    print(f"# graph capture failed for {name} b{b} L{L}: {type(e).__name__}: {e}")
                    t[name + "_graph_us"] = float("nan")
            emit(section="decode", batch=b, cache=L, **t,
                 gpu_ratio=t["cudnn_gpu_us"] / t["fc_gpu_us"],
                 gpu_ratio_paged=t["cudnn_gpu_us"] / t["fc_paged_gpu_us"],
                 loop_ratio=t["cudnn_loop_us"] / t["fc_loop_us"],
                 graph_ratio=t["cudnn_graph_us"] / t["fc_graph_us"],
                 graph_ratio_paged=t["cudnn_graph_us"] / t["fc_paged_graph_us"],
                 tbps_fc=nbytes / t["fc_gpu_us"] * 1e-6, tbps_cudnn=nbytes / t["cudnn_gpu_us"] * 1e-6)
            del q, kc, vc, kp, vp, qt, kt, vt, ref


def tiny(n_first=1000, n=2000, rounds=5):
    """The first 1000 steps of this process (kernels compiled from the disk cache on the first
    call), then the steady state (best of ``rounds`` rounds of ``n``), interleaved."""
    mk = lambda: torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    qtg, ktg, vtg = (x.detach().clone().requires_grad_() for x in (qt, kt, vt))

    def fc_fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def fc_step():
        o = flashcore.attention(qg, kg, vg, causal=True)
        torch.autograd.grad(o, (qg, kg, vg), do)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def sdpa_step():
        o = F.scaled_dot_product_attention(qtg, ktg, vtg, is_causal=True)
        torch.autograd.grad(o, (qtg, ktg, vtg), dot)
    fns = {"fc_fwd": fc_fwd, "sdpa_fwd": sdpa_fwd, "fc_step": fc_step, "sdpa_step": sdpa_step}
    first = {f"{name}_first{n_first}_us": host_loop_us(f, n_first) for name, f in fns.items()}
    best = {f"{name}_us": float("inf") for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            best[f"{name}_us"] = min(best[f"{name}_us"], host_loop_us(f, n))
    emit(section="tiny", **first, **best,
         fwd_minus_sdpa_first_us=first[f"fc_fwd_first{n_first}_us"] - first[f"sdpa_fwd_first{n_first}_us"],
         step_over_sdpa_first=first[f"fc_step_first{n_first}_us"] / first[f"sdpa_step_first{n_first}_us"],
         fwd_minus_sdpa_us=best["fc_fwd_us"] - best["sdpa_fwd_us"],
         step_over_sdpa=best["fc_step_us"] / best["sdpa_step_us"])


def _llama(impl, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM
    import flashcore.integrations.transformers as fct
    name = fct.register() if impl == "flashcore" else impl
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=32768, attn_implementation=name)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def _train_step_ms(model, batch, seqlen, steps=8, warmup=3, compiled=False):
    ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")
    fwd = torch.compile(model) if compiled else model

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss
    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps, float(loss), warm_s


def llama(shapes=((1, 16384), (4, 4096))):
    for batch, seqlen in shapes:
        r = {}
        for impl in ("sdpa", "flashcore"):
            model = _llama(impl)
            r[impl + "_ms"], r[impl + "_loss"], _ = _train_step_ms(model, batch, seqlen)
            del model
            torch.cuda.empty_cache()
        emit(section="llama_train_eager", batch=batch, seqlen=seqlen, **r,
             speedup=r["sdpa_ms"] / r["flashcore_ms"])


def compile_step(batch=4, seqlen=4096):
    import torch._dynamo
    r = {}
    for impl in ("sdpa", "flashcore"):
        torch._dynamo.reset()
        model = _llama(impl)
        torch._dynamo.config.capture_scalar_outputs = False
        explain = None
        try:
            ids = torch.randint(0, 32000, (batch, seqlen), device="cuda")
            explain = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
            torch._dynamo.reset()
            r[impl + "_graph_breaks"] = explain.graph_break_count
            r[impl + "_ms"], r[impl + "_loss"], r[impl + "_compile_s"] = _train_step_ms(
                model, batch, seqlen, compiled=True)
        except Exception as e:
            print(f"# compile failed for {impl}: {type(e).__name__}: {str(e)[:400]}")
            r[impl + "_ms"] = float("nan")
        del model
        torch.cuda.empty_cache()
    emit(section="llama_train_compiled", batch=batch, seqlen=seqlen, **r,
         speedup=r["sdpa_ms"] / r["flashcore_ms"])


def generate(shapes=((1, 512), (8, 2048)), new=128):
    for batch, prompt in shapes:
        r = {}
        outs = {}
        for impl in ("sdpa", "flashcore"):
            model = _llama(impl).eval()
            ids = torch.randint(0, 32000, (batch, prompt), device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(1))
            with torch.no_grad():
                model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
                torch.cuda.synchronize()
            r[impl + "_tok_s"] = batch * new / (time.perf_counter() - t0)
            outs[impl] = o[:, prompt:]
            # the first step's logits: how close the two are (greedy tokens of a random model
            # flip on near-ties)
            with torch.no_grad():
                r[impl + "_logits"] = model(ids).logits[:, -1].float()
            del model
            torch.cuda.empty_cache()
        same = (outs["sdpa"] == outs["flashcore"]).int().cumprod(1).sum(1)
        la, lb = r.pop("sdpa_logits"), r.pop("flashcore_logits")
        emit(section="generate", batch=batch, prompt=prompt, **r,
             ratio=r["flashcore_tok_s"] / r["sdpa_tok_s"],
             equal_prefix_min=int(same.min()), equal_prefix_mean=float(same.float().mean()),
             logits_maxdiff=float((la - lb).abs().max()), logits_scale=float(la.abs().max()))


def profile(n=300):
    """cProfile of the host side of the decode step (batch 1, 4k) and of the tiny forward."""
    import cProfile
    import pstats
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
    qt = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    qg = qt.clone().requires_grad_()
    do = torch.randn_like(qt)

    def step():
        with torch.enable_grad():
            o = flashcore.attention(qg, qg, qg, causal=True)
            torch.autograd.grad(o, (qg,), do)
    calls = {"decode": lambda: flashcore.attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
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


def main(argv):
    jpath = None
    if "--json" in argv:
        i = argv.index("--json")
        jpath = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    sections = argv or ["decode", "tiny", "llama", "generate"]
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, sections {sections}")
    for s in sections:
        try:
            {"decode": decode, "tiny": tiny, "llama": llama, "generate": generate,
             "compile": compile_step, "profile": profile}[s]()
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
