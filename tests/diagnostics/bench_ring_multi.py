"""Ring attention on several GPUs (context parallelism, issue #18): tokens/s and scaling
efficiency against one GPU, through ``flashcore.distributed.ring_attention``.

    python tests/diagnostics/bench_ring_multi.py [--world 2] [--seqlens 65536,262144]
                                                 [--heads 16 --heads-k 4 --headdim 128]
                                                 [--layout zigzag] [--no-causal] [--cpu]

For each total sequence length: one GPU runs ``flashcore.attention`` over the whole sequence
(forward, then forward+backward through autograd), when it fits; then ``--world`` processes,
one per GPU (NCCL; NVLink multicast stays off: NCCL_NVLS_ENABLE=0), each holding its shard of
q, k, v (``shard``, the ``--layout`` given), run ``ring_attention`` over the same sequence.
Times are the slowest rank's (wall clock of one call ended by a synchronisation, best of 3
after a warm-up call: flashcore.bench.wall_time). Prints ms, tokens/s and
the scaling efficiency (one GPU's time / (world x the ring's time): 1.0 is perfect; the issue
asks 2 GPUs >= 1.8x one GPU, i.e. efficiency >= 0.9). ``--cpu``: gloo and CPU tensors (the
NumPy backend) at toy sizes, a check of the script itself on a machine without GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys

# NVLink multicast must stay off on the shared hosts (see the device tool's KINDS.md)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v


def _inputs(torch, n, heads, heads_k, headdim, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, n, h, headdim, device=device, dtype=dtype, generator=g)
            for h in (heads, heads_k, heads_k, heads)]


def _timed(torch, fn, cpu, reps=3):
    """Best of ``reps`` after one warm-up call, seconds (flashcore.bench.wall_time: exactly
    1 + reps calls, which every rank must make alike: ``fn`` holds collectives)."""
    from flashcore.bench import wall_time
    return wall_time(fn, reps=reps, warmup=1,
                     sync=(lambda: None) if cpu else torch.cuda.synchronize)


def _one_gpu(a, n):
    """(forward s, forward+backward s) of one call over the whole sequence, or None (OOM)."""
    import torch
    import flashcore
    device = "cpu" if a.cpu else "cuda"
    dtype = torch.float32 if a.cpu else torch.bfloat16
    try:
        q, k, v, do = _inputs(torch, n, a.heads, a.heads_k, a.headdim, device, dtype)
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def fwd():
            with torch.no_grad():
                flashcore.attention(q, k, v, causal=a.causal)

        def step():
            torch.autograd.grad(flashcore.attention(q, k, v, causal=a.causal), (q, k, v), do)
        return _timed(torch, fwd, a.cpu), _timed(torch, step, a.cpu)
    except torch.OutOfMemoryError:
        return None
    finally:
        if not a.cpu:
            torch.cuda.empty_cache()


def _rank(rank, a, n, init_file, out):
    import torch
    import torch.distributed as dist
    from flashcore.distributed import ring_attention, shard
    device = "cpu" if a.cpu else f"cuda:{rank}"
    if not a.cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if a.cpu else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=a.world)
    dtype = torch.float32 if a.cpu else torch.bfloat16
    q, k, v, do = _inputs(torch, n, a.heads, a.heads_k, a.headdim, device, dtype)
    ql, kl, vl, dol = (shard(x, a.world, rank, a.layout).contiguous() for x in (q, k, v, do))
    del q, k, v, do
    ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, causal=a.causal, layout=a.layout)
        dist.barrier()

    def step():
        torch.autograd.grad(ring_attention(ql, kl, vl, causal=a.causal, layout=a.layout),
                            (ql, kl, vl), dol)
        dist.barrier()
    t = torch.tensor([_timed(torch, fwd, a.cpu), _timed(torch, step, a.cpu)], dtype=torch.float64,
                     device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)          # the slowest rank sets the time
    if rank == 0:
        out.put((float(t[0]), float(t[1])))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqlens", default="65536,262144")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-k", type=int, default=4)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--cpu", action="store_true")
    a = p.parse_args(argv)
    import tempfile
    import torch
    import torch.multiprocessing as mp
    if not a.cpu and torch.cuda.device_count() < a.world:
        print(f"bench_ring_multi: {a.world} GPUs needed, {torch.cuda.device_count()} found",
              file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    print(f"# ring_attention, {a.world} {'processes (CPU, gloo)' if a.cpu else 'GPUs (NCCL)'}, "
          f"{a.layout}, causal={a.causal}, {a.heads}/{a.heads_k} heads of {a.headdim}")
    print(f"{'tokens':>8s} {'pass':8s} | {'1 GPU ms':>9s} {'tok/s':>9s} | {'ring ms':>9s} "
          f"{'tok/s':>9s} | speed-up  efficiency")
    for n in (int(x) for x in a.seqlens.split(",")):
        one = _one_gpu(a, n)
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            procs = [ctx.Process(target=_rank, args=(r, a, n, os.path.join(d, "init"), out))
                     for r in range(a.world)]
            for pr in procs:
                pr.start()
            ring = out.get(timeout=1800)
            for pr in procs:
                pr.join(timeout=600)
        for i, name in enumerate(("fwd", "fwd+bwd")):
            t1 = one[i] if one else float("nan")
            tr = ring[i]
            print(f"{n:8d} {name:8s} | {t1 * 1e3:9.1f} {n / t1:9.0f} | {tr * 1e3:9.1f} "
                  f"{n / tr:9.0f} | {t1 / tr:7.2f}x  {t1 / tr / a.world:9.3f}"
                  + ("" if one else "   (one GPU: out of memory)"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
