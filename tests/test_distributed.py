"""Context parallelism (flashcore.distributed) with 2 and 4 processes on one CPU machine (gloo,
torch CPU tensors on the NumPy backend): ring attention (contiguous and zig-zag, causal or
not, GQA) and packed documents over all-gathered K/V (causal, windowed, documents spanning
ranks), forward and gradients equal to single-process attention on the gathered sequence."""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

_WORKER = textwrap.dedent(r"""
    import os, sys, torch, torch.distributed as dist
    import flashcore
    from flashcore.distributed import ring_attention, shard, unshard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"],
                            rank=rank, world_size=world)
    fails = []
    cases = [(c, (-1, -1), h, hk) for c in (False, True) for h, hk in ((4, 4), (4, 2))]
    cases += [(True, (w, 0), 4, 2) for w in (0, 3, 9, 20)]      # windows across chunk edges
    cases += [(False, w, 4, 2) for w in ((3, 5), (0, 9), (20, 0), (-1, 4), (7, -1), (0, 0),
                                         (2, 30))]              # two-sided, causal or not
    cases += [(True, (5, 7), 4, 4), (True, (-1, 5), 4, 2)]        # the right side folded away
    cases += [(False, w, 4, 2) for w in ((3, 0), (0, -1), (-1, 0), (1, 1))]
    cases = [c + (0.0,) for c in cases]
    cases += [(True, (-1, -1), 4, 2, 4.0), (False, (-1, -1), 4, 2, 2.5), (True, (3, 0), 4, 4, 3.0)]
    for layout in ("contiguous", "zigzag"):
        for causal, window, h, hk, cap in cases:
            g = torch.Generator().manual_seed(7 + h + hk + causal + window[0] + 3 * window[1])
            s = 8 * world                       # 2W chunks of 4 for zigzag
            q, k, v, do = (torch.randn(2, s, n, 16, generator=g, dtype=torch.float64)
                           for n in (h, hk, hk, h))
            qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
            ref = flashcore.attention(qf, kf, vf, causal=causal, window_size=window, softcap=cap)
            ref.backward(do)
            ql, kl, vl = (shard(x, world, rank, layout).requires_grad_() for x in (q, k, v))
            out = ring_attention(ql, kl, vl, causal=causal, window_size=window, softcap=cap,
                                 layout=layout)
            out.backward(shard(do, world, rank, layout))
            pairs = [("out", out, ref), ("dq", ql.grad, qf.grad), ("dk", kl.grad, kf.grad),
                     ("dv", vl.grad, vf.grad)]
            for name, got, want in pairs:
                err = (got - shard(want, world, rank, layout)).abs().max().item()
                if not err < 1e-10:
                    fails.append((layout, causal, window, h, hk, cap, name, err))
    # packed documents, all-gathered K/V (Llama 3's scheme): documents that span ranks
    from flashcore.distributed import varlen_attention_all_gather
    lens = [5, 11, 3, 13, 0, 7, 25] if world == 2 else [5, 11, 3, 13, 0, 7, 25, 1, 31, 8]
    total = sum(lens) + (-sum(lens)) % world
    lens[-1] += total - sum(lens)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    n = total // world
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    for causal, window, cap, alibi in ((False, (-1, -1), 0.0, None), (True, (-1, -1), 0.0, None),
                                       (True, (6, 0), 0.0, None), (False, (-1, -1), 3.0, None),
                                       (True, (-1, -1), 2.0, slopes), (True, (6, 0), 0.0, slopes)):
        g = torch.Generator().manual_seed(11 + causal + window[0])
        q, k, v, do = (torch.randn(total, h, 16, generator=g, dtype=torch.float64)
                       for h in (4, 2, 2, 4))
        qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
        ref = flashcore.varlen_attention(qf, kf, vf, cu, cu, max(lens), max(lens), causal=causal,
                                         window_size=window, softcap=cap, alibi_slopes=alibi)
        ref.backward(do)
        rows = slice(rank * n, (rank + 1) * n)
        ql, kl, vl = (x[rows].clone().requires_grad_() for x in (q, k, v))
        out = varlen_attention_all_gather(ql, kl, vl, cu, causal=causal, window_size=window,
                                          softcap=cap, alibi_slopes=alibi)
        out.backward(do[rows])
        for name, got, want in (("out", out, ref), ("dq", ql.grad, qf.grad),
                                ("dk", kl.grad, kf.grad), ("dv", vl.grad, vf.grad)):
            err = (got - want[rows]).abs().max().item()
            if not err < 1e-10:
                fails.append(("varlen", causal, window, cap, alibi is not None, name, err))
    # shard / unshard round trip
    x = torch.arange(2 * 8 * world).reshape(2, 8 * world)
    assert torch.equal(unshard([shard(x, world, r) for r in range(world)]), x)
    dist.barrier()             # nobody tears gloo down while another rank still talks
    dist.destroy_process_group()
    print("FAILS" if fails else "ok", fails)
""")


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_single_process(world, tmp_path):
    env = dict(os.environ, WORLD_SIZE=str(world), INIT_FILE=str(tmp_path / "init"),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}: {err[-2000:]}"
        assert out.strip().startswith("ok"), f"rank {r}: {out[-2000:]}"


def test_arguments_are_checked_before_any_communication():
    from flashcore.distributed import ring_attention, shard
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="argument 'layout'"):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(ValueError, match="argument 'softcap'"):
        ring_attention(q, q, q, softcap=-1.0)
    from flashcore.distributed import varlen_attention_all_gather
    x = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match="argument 'softcap'"):
        varlen_attention_all_gather(x, x, x, [0, 8], softcap=float("inf"))
    with pytest.raises(NotImplementedError, match="argument 'alibi_slopes'.*causal=True"):
        varlen_attention_all_gather(x, x, x, [0, 8], alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="argument 'alibi_slopes'.*\\(2,\\)"):
        varlen_attention_all_gather(x, x, x, [0, 8], causal=True, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="argument 'x'"):
        shard(torch.randn(1, 6, 2, 8), 2, 0)          # 6 is not divisible into 4 chunks
