"""How the benchmark's L2 flush shapes a decoding step's GPU time (issue #17's FP8 decode ratio,
#14's decode table).

    python tests/diagnostics/probe_flush.py [--cells 1x4096,8x16384,...] [--rounds 3]

Until session 48 ``flashcore.bench.gpu_time`` emptied the L2 before every repetition by
writing 256 MB (as triton's ``do_bench`` does). That leaves the L2 full of dirty lines, whose
write-back then runs inside the timed call as its reads evict them. This times the same calls
(GQA 32/8, d128, one query token, through ``flashcore.attention_with_kvcache``: a contiguous
bf16 cache; a paged one, pages of 256 in a shuffled order and the same pool in order; an FP8
cache; SDPA cuDNN over the contiguous bf16 cache) with three flushes: ``write``
(zero the buffer), ``read`` (read it through, the timer's flush now: the L2 as empty of the
inputs, its lines clean) and ``none``; the rounds interleave the modes, and each cell prints
the median of the rounds.
"""
from __future__ import annotations

import statistics
import sys


def main(argv):
    import torch
    from torch.nn.attention import SDPBackend
    import flashcore
    from flashcore import bench
    from flashcore.bench import DecodeProblem, fp8_quantise, gpu_time

    cells = ((1, 4096), (8, 4096), (8, 16384), (1, 131072), (8, 131072))
    if "--cells" in argv:
        cells = tuple(tuple(int(x) for x in c.split("x"))
                      for c in argv[argv.index("--cells") + 1].split(","))
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    cu = bench._cuda("torch")
    buf = cu.flush_buf
    modes = {"write": buf.zero_, "read": lambda: buf.view(torch.int64).sum(), "none": lambda: None}
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}; us per step, median of "
          f"{rounds} rounds; flush modes {list(modes)}")
    print("batch cache | " + " | ".join(
        f"{m}: bf16 / paged / paged in order / fp8 / cudnn (ratio bf16/fp8, cudnn/bf16)"
        for m in modes))
    for b, sk in cells:
        pb = DecodeProblem(b, sk, seed=b * 7 + sk)
        (k8, kd), (v8, vd) = fp8_quantise(pb.k_cache), fp8_quantise(pb.v_cache)
        pp = DecodeProblem(b, sk, seed=b * 7 + sk, page_size=256)
        ident = torch.arange(pp.block_table.numel(), device="cuda", dtype=torch.int32
                             ).view_as(pp.block_table)
        calls = {
            "bf16": pb.api,
            "paged": pp.api,
            "paged-id": lambda: flashcore.attention_with_kvcache(
                pp.q, pp.k_cache, pp.v_cache, cache_seqlens=pp.cache_seqlens, block_table=ident),
            "fp8": lambda: flashcore.attention_with_kvcache(
                pb.q, k8, v8, cache_seqlens=pb.cache_seqlens, k_descale=kd, v_descale=vd),
            "cudnn": lambda: pb.sdpa(SDPBackend.CUDNN_ATTENTION),
        }
        t = {(m, c): [] for m in modes for c in calls}
        for _ in range(rounds):
            for m, f in modes.items():
                cu.flush = f
                for c, fn in calls.items():
                    t[m, c].append(gpu_time(fn))
        del cu.flush            # the timer's own flush again
        med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
        print(f"{b:5d} {sk:6d} | " + " | ".join(
            f"{med[m, 'bf16']:7.1f} / {med[m, 'paged']:7.1f} / {med[m, 'paged-id']:7.1f} / "
            f"{med[m, 'fp8']:6.1f} / {med[m, 'cudnn']:7.1f} "
            f"({med[m, 'bf16'] / med[m, 'fp8']:.2f}, {med[m, 'cudnn'] / med[m, 'bf16']:.3f})"
            for m in modes), flush=True)
        del pb, pp, k8, v8, calls
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
