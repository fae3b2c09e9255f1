"""Where the tiny training step's time goes, stamp by stamp (issue #14; needs a GPU).

    python tests/diagnostics/probe_step_timeline.py [--steps N]

The tiny step (1 x 128 x 2 x 64 bf16, causal; ``flashcore.attention`` then
``torch.autograd.grad``) with ``time.perf_counter_ns`` stamps taken by a subclass of the route's
autograd Function: when the forward body is entered and left, when the backward body is entered
and left (on the autograd engine's device thread), around the public call and around ``grad``.
The median of each interval over N steps (µs), beside a do-nothing Function's step and SDPA's
(stamps around the calls only). Then each step's host loop time (flashcore.bench.host_loop_us),
its GPU time (the device kept busy by a spin kernel first, so the host's enqueueing and the
GPU's execution are timed apart: flashcore.bench.enqueue_and_gpu_time) and the host's enqueue
time per step, and the same steps with the engine's device threads off
(``torch.autograd.set_multithreading_enabled(False)``: the backward on the calling thread).

The flashcore step's two op bodies are stamped inside as well (by wrapping, for the probe only,
the functions the ops' kernels call in turn): the op kernel entered (its ``config.get``), the
launch-plan key built (``plans.lookup`` entered), looked up, the outputs allocated (``replay``
entered), the first ``cuLaunchKernel`` entered, the last one returned, ``replay`` returned;
each interval's median is printed for the forward (main thread) and the backward (the engine's
device thread), so the two threads' costs of the same pieces can be compared.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
import torch.nn.functional as F

import flashcore
from flashcore import config
from flashcore.backends import torch_ops
from flashcore.kernels import device
from flashcore.bench import enqueue_and_gpu_time, host_loop_us

ns = time.perf_counter_ns
SHAPE = (1, 128, 2, 64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    torch_ops.torch_ops()
    FA = torch_ops._FUNCTION[0]
    T = {}

    class Timed(FA):
        @staticmethod
        def forward(ctx, call, *t):
            T["f_in"] = ns()
            r = FA.forward(ctx, call, *t)
            T["f_out"] = ns()
            return r

        @staticmethod
        def backward(ctx, do, dl):
            T["b_in"] = ns()
            T["b_thread"] = threading.get_ident()
            r = FA.backward(ctx, do, dl)
            T["b_out"] = ns()
            return r

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            T["f_in"] = ns()
            o = torch.empty_like(q)
            T["f_out"] = ns()
            return o

        @staticmethod
        def backward(ctx, do):
            T["b_in"] = ns()
            T["b_thread"] = threading.get_ident()
            T["b_out"] = ns()
            return do, do, do

    q, k, v, do = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()

    def fc_step():
        T["s0"] = ns()
        o = flashcore.attention(qg, kg, vg, causal=True)
        T["a0"] = ns()
        torch.autograd.grad(o, (qg, kg, vg), do)
        T["g1"] = ns()

    def nothing_step():
        T["s0"] = ns()
        o = Nothing.apply(qg, kg, vg)
        T["a0"] = ns()
        torch.autograd.grad(o, (qg, kg, vg), do)
        T["g1"] = ns()

    def sdpa_step():
        T["s0"] = ns()
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        T["a0"] = ns()
        torch.autograd.grad(o, (qt, kt, vt), dot)
        T["g1"] = ns()

    def fc_fwd():
        with torch.no_grad():
            flashcore.attention(q, k, v, causal=True)

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    def timeline(step, n):
        rows = []
        for _ in range(30):
            step()
        torch.cuda.synchronize()
        for _ in range(n):
            T.clear()
            step()
            rows.append(dict(T))
        torch.cuda.synchronize()
        return rows

    def med(rows, a, b):
        xs = [(r[b] - r[a]) / 1e3 for r in rows if a in r and b in r]
        return statistics.median(xs) if xs else float("nan")

    main_thread = threading.get_ident()

    def side():      # "f" on the main thread (the forward), "b" on another (the backward)
        return "f" if threading.get_ident() == main_thread else "b"

    def stamped(fn, before, after=None):
        def wrapper(*a, **kw):
            T.setdefault(side() + before, ns())
            r = fn(*a, **kw)
            if after:
                T[side() + after] = ns()
            return r
        return wrapper
    drv = device.driver()
    originals = (config.get, torch_ops.plans.lookup, torch_ops.replay, drv.launch)

    def pieces(on):
        if on:
            config.get = stamped(originals[0], "_op")
            torch_ops.plans.lookup = stamped(originals[1], "_key", "_lookup")
            torch_ops.replay = stamped(originals[2], "_alloc", "_replay")
            drv.launch = stamped(originals[3], "_l0", "_ln")
        else:
            config.get, torch_ops.plans.lookup, torch_ops.replay, drv.launch = originals
    out = []
    for name, step, wrap in (("flashcore", fc_step, True), ("nothing", nothing_step, False),
                             ("sdpa", sdpa_step, False)):
        if wrap:
            torch_ops._FUNCTION[0] = Timed
            pieces(True)
        try:
            rows = timeline(step, args.steps)
        finally:
            torch_ops._FUNCTION[0] = FA
            pieces(False)
        on_main = sum(r.get("b_thread") == main_thread for r in rows)
        line = (f"{name:10s} step {med(rows, 's0', 'g1'):7.1f} | call->f_in "
                f"{med(rows, 's0', 'f_in'):6.1f} fwd body {med(rows, 'f_in', 'f_out'):6.1f} "
                f"f_out->ret {med(rows, 'f_out', 'a0'):6.1f} | apply {med(rows, 's0', 'a0'):6.1f} "
                f"| grad->b_in {med(rows, 'a0', 'b_in'):6.1f} bwd body "
                f"{med(rows, 'b_in', 'b_out'):6.1f} b_out->ret {med(rows, 'b_out', 'g1'):6.1f} "
                f"| grad {med(rows, 'a0', 'g1'):6.1f} (backward on the main thread in "
                f"{on_main}/{len(rows)})")
        print(line, flush=True)
        out.append(line)
        if wrap:
            for p, body in (("f", ("f_in", "f_out")), ("b", ("b_in", "b_out"))):
                marks = [body[0], p + "_op", p + "_key", p + "_lookup", p + "_alloc", p + "_l0",
                         p + "_ln", p + "_replay", body[1]]
                line = f"  {'forward' if p == 'f' else 'backward'} pieces (us): " + "  ".join(
                    f"{a}->{b} {med(rows, a, b):.1f}" for a, b in zip(marks, marks[1:]))
                print(line, flush=True)
                out.append(line)

    # GPU time and host enqueue time apart: a spin kernel holds the device while the host
    # enqueues n steps; events then time the steps' GPU work back to back (L2 not flushed)
    def apart(step, n=200):
        host, gpu = enqueue_and_gpu_time(step, steps=n, warmup=20)
        return host * 1e6, gpu * 1e6

    def loop(step, n=1000):
        return host_loop_us(step, steps=n, warmup=30, rounds=1, warmup_s=0.0)

    for mt in (True, False):
        torch.autograd.set_multithreading_enabled(mt)
        for name, step in (("fc_step", fc_step), ("sdpa_step", sdpa_step),
                           ("nothing_step", nothing_step), ("fc_fwd", fc_fwd),
                           ("sdpa_fwd", sdpa_fwd)):
            host, gpu = apart(step)
            line = (f"multithreading={mt!s:5s} {name:12s} host loop {loop(step):7.1f} us/step; "
                    f"enqueue {host:7.1f}, GPU {gpu:7.1f} us/step")
            print(line, flush=True)
            out.append(line)
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
