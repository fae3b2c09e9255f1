"""Where the per-call host time goes (cProfile over many tiny calls): a diagnostic."""
import cProfile
import pstats
import sys

import cupy
import torch

import flashcore

q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))


def cupy_fb():
    o, l = flashcore.attention_forward(cq, ck, cv, causal=True)
    flashcore.attention_backward(cdo, cq, ck, cv, o, l, causal=True)


def torch_fb():
    o = flashcore.attention(qg, kg, vg, causal=True)
    torch.autograd.grad(o, (qg, kg, vg), do)


for name, fn in (("cupy", cupy_fb), ("torch", torch_fb)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    print(f"===== {name} forward+backward, 300 calls")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(14)
