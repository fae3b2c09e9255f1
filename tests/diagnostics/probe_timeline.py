"""Where the Hopper kernels' time goes, step by step (#15, #17; needs a GPU).

    python tests/diagnostics/probe_timeline.py [--backward] [--headdim 128] [--seqlen 2048 16384]
        [--causal no|yes|both] [--fp8] [--defines NAME ...] [--json FILE] [--raw DIR]

The warp-specialised forward (or, ``--backward``, the warp-specialised dK/dV kernel at head
dims 64 / 128, or the head-dim-256 one) compiled with ``-DFC_DIAG_TIMELINE``
(cuda/diag_timeline.cuh) writes the SM clock at fixed points of its schedule, thread 0 of each
warpgroup, for the first 132 CTAs and the first 8 tiles of each. The call goes through the public API (torch CUDA tensors at the
ANCHORS.md sizes: 16k tokens, hidden 2048; the forward alone, FP8 inputs with per-head
descales with ``--fp8``; forward and backward through autograd with ``--backward``); the
stamped kernel's GPU time (the call's) is printed beside the plain one's, since the stamps
themselves cost a little. ``--defines`` adds timing-only defines to both (e.g.
``FC_DIAG_PP_CHAIN``: the timeline of that variant).

The forward:

Consumer warpgroup events, one step (every key block but the tile's last; step ``it`` issues
S of block it + 1 and P V of block it):

    0 top of the step      1 K and V of the step are in shared memory (mbarrier waits)
    2 ping-pong turn taken 3 both products issued (and the turn handed on)
    4 S done               5 mask + softmax done
    6 P V done             7 O rescaled and P packed (the step's end)

and of the tile: 0 the tile received, 1 Q in shared memory, 2 the first S done, 3 its softmax
and packing done (the steps begin), 4 the steps done, 5 the last P V done, 6 the epilogue's
stores issued; 7 holds the tile's step count + 1 (its key blocks). Producer (16-bit: thread 0
issues every load; FP8: the warpgroup also transposes V): per key block 0 before the K stage
is free (16-bit) / the loads of the next block (FP8), 1 K issued / loads issued, 2 the V stage
free, 3 V issued / transposed. Printed: the median of each interval in clocks, per consumer
warpgroup, for the first step, a middle step and the last; the tile's prologue and epilogue;
its time against (key blocks x the median step), i.e. the per-tile fixed cost, in key-block
times and microseconds (the clock rate from %clock against %globaltimer over each CTA's life);
and the next tile's Q, from the consumers' release of the buffer (the later warpgroup's tile
event 4) to the producer's load (its tile event 1) to the first consumer holding it (event 1
of the next tile), all on the one SM's clock (``_q_path``); and the TMA-store epilogue by
part (the stamps of step EPI_STEP, cuda/diag_timeline.cuh).
An interval holds what the SASS puts between its two stamps, which is not always the source's
order: ptxas moves register-only arithmetic across clock reads, stores, wgmma waits and
barriers. Without ``FC_DIAG_SOFTMAX_FENCE`` it issues the wait for P V before the whole softmax
(flash_fwd_sm90.cu, kSoftmaxFence), so the softmax's time shows under "rescale+pack" and
"wait PV" is the product's whole remaining time; read the instantiation's SASS (the README of
this folder says how) before reading the table.

The backward (one key block a CTA; consumer warpgroups 1 and 2, one step per (query head,
query block) of the CTA's walk):

    0 top of the step              1 Q, dO, lse and D of the step in shared memory
    2 the step before's dQ staged  3 S^T and dP^T issued
    4 the step before's dQ tile handed to TMA (reduce-add)
    5 grads: S^T, dP^T waited, P and dS computed, dS^T stored, dV and dK issued
    6 the consumers met (dS^T whole)
    7 dQ = dS K issued and every product of the step waited

and of the CTA: 0 start, 1 K and V in shared memory, 4 the steps done, 5 the last dQ tile
handed over, 6 dK and dV stored; 7 holds the step count. The head-dim-256 kernel stamps the
same points of its own order: 5 is P^T and dS^T stored (its S^T and dP^T waited), 6 the
consumers met, 7 dV, dK and dQ issued and waited; the second meeting (the stage free for the
dQ tiles) lies between a step's 7 and the next step's 0. Producer (thread 0) per step: 0 before
the stage is free, 1 free, 2 loads issued and statistics stored.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys

import numpy as np

CTAS, TILES, ITERS = 132, 8, 128
TILE_SLOT, CTA_SLOT = ITERS - 1, ITERS - 2
QWAIT_STEP = ITERS - 4      # (the forward's consumers: event 0, the clock before the Q wait)
EPI_STEP = ITERS - 5        # (and the epilogue's points, cuda/diag_timeline.cuh)
EPI_NAMES = ["buffer free", "barrier", "O staged", "fence+barrier", "stores issued", "read wait"]
UNSET = 0xFFFFFFFF
STEP_NAMES = ["data", "turn", "issue", "wait S", "softmax", "wait PV", "rescale+pack"]
BWD_STEP_NAMES = ["Q/dO wait", "stage dQ", "issue S,dP", "dQ handover", "grads", "dS^T meet",
                  "dQ + wait"]
DEFINE = "-DFC_DIAG_TIMELINE"


def _cu():
    lib = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        st = getattr(lib, name)(*args)
        if st != 0:
            raise RuntimeError(f"{name} failed: CUresult {st}")
    return call


def _timeline_buffer(jit, prefix):
    """(device pointer, bytes, kernel name) of fc_diag_tl in the module of the one stamped
    kernel loaded whose name starts with ``prefix`` (the caller clears jit's kernels before
    the call)."""
    ks = [k for key, k in list(jit._kernels.items())
          if DEFINE in key[4] and k.name.startswith(prefix)]
    if len(ks) != 1:
        raise RuntimeError(f"expected one stamped {prefix} kernel loaded, found {len(ks)}")
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    _cu()("cuModuleGetGlobal_v2", ctypes.byref(ptr), ctypes.byref(size),
          ctypes.c_void_p(ks[0].module), b"fc_diag_tl")
    return ptr.value, size.value, ks[0].name


def _consumers(name):
    """Consumer warpgroups of a forward kernel: kBM / 64 (the FP8 kernel's tiles: 128 rows)."""
    targs = name.split("<", 1)[1].split(",")
    return int(targs[2]) // 64 if name.startswith("flash_fwd_sm90_ws_kernel") else 2


def _read(ptr, size):
    host = np.empty(size // 4, dtype=np.uint32)
    _cu()("cuMemcpyDtoH_v2", host.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(ptr),
          ctypes.c_size_t(size))
    return host.reshape(CTAS, 4, TILES, ITERS, 8)


def _d(a, b):
    """b - a on the 32-bit clock (both set)."""
    return (int(b) - int(a)) & 0xFFFFFFFF


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def _steps(tl, c, w, u, n, limit=CTA_SLOT):
    """The intervals of steps 0 .. n - 1 of CTA c's tile u, warpgroup w (to the first one not
    stamped; each the 7 gaps between its events and its whole), and the clocks from each
    step's start to the next's."""
    steps = []
    for it in range(min(n, limit)):
        s = tl[c, w, u, it]
        if UNSET in s:
            break
        steps.append([_d(s[i], s[i + 1]) for i in range(7)] + [_d(s[0], s[7])])
    lens = [_d(tl[c, w, u, it][0], tl[c, w, u, it + 1][0]) for it in range(len(steps) - 1)]
    return steps, lens


def _step_table(runs):
    """{first, middle, last}: the column medians of each run's first, middle and last step."""
    def cols(rows):
        return [_med([r[i] for r in rows]) for i in range(8)] if rows else [float("nan")] * 8
    return dict(first=cols([r[0] for r in runs if r]),
                middle=cols([r[len(r) // 2] for r in runs if len(r) > 2]),
                last=cols([r[-1] for r in runs if r]))


def _producer(tl, tiles, events):
    """Medians of the gaps between the producer's first ``events`` stamps of a step, over the
    first ``tiles`` tiles of every CTA (from each tile's second step: the first carries the
    tile's start)."""
    rows = []
    for c in range(CTAS):
        for u in range(tiles):
            for it in range(1, CTA_SLOT):
                s = tl[c, 0, u, it]
                if UNSET in s[:events]:
                    break
                rows.append([_d(s[i], s[i + 1]) for i in range(events - 1)])
    return [_med([r[i] for r in rows]) for i in range(events - 1)] if rows else None


def _clock_ghz(tl, warpgroups):
    """The SM clock from each CTA's %clock against %globaltimer over its life (median)."""
    rates = []
    for c in range(CTAS):
        for w in range(warpgroups):
            e = tl[c, w, 0, CTA_SLOT]
            if UNSET in (e[0], e[1], e[2], e[3], e[4], e[5]):
                continue
            ns = ((int(e[5]) << 32) | int(e[4])) - ((int(e[2]) << 32) | int(e[1]))
            if ns > 0:
                rates.append(_d(e[0], e[3]) / ns)
    return _med(rates)


def analyse_bwd(tl):
    """The backward's medians (clocks); see the module's docstring."""
    out = {"clock_ghz": _clock_ghz(tl, 3)}
    for w in (1, 2):
        runs, step_len, ctas = [], [], []
        for c in range(CTAS):
            t = tl[c, w, 0, TILE_SLOT]
            if UNSET in (t[0], t[6], t[7]):
                continue
            n = int(t[7])
            steps, lens = _steps(tl, c, w, 0, n)
            runs.append(steps)
            step_len += lens
            ctas.append(dict(steps=n, kv=_d(t[0], t[1]), walk=_d(t[1], t[4]),
                             tail=_d(t[4], t[5]), epilogue=_d(t[5], t[6]), span=_d(t[0], t[6])))
        step = _med(step_len)
        out[f"consumer{w}"] = dict(
            step_clocks=step, **_step_table(runs),
            cta={k: _med([x[k] for x in ctas]) for k in ("steps", "kv", "walk", "tail",
                                                          "epilogue", "span")},
            fixed_steps=_med([x["span"] / step - x["steps"] for x in ctas]) if step else None,
            ctas=len(ctas))
    out["producer"] = _producer(tl, 1, 3)
    return out


def _print_steps(r, names):
    """A warpgroup's first, middle and last step, interval by interval (median clocks)."""
    print("  step      " + " ".join(f"{n:>12}" for n in names + ["total"]))
    for k in ("first", "middle", "last"):
        print(f"  {k:<9} " + " ".join(f"{x:>12.0f}" for x in r[k]))


def report_bwd(label, res, ms_plain, ms_stamped):
    ghz = res["clock_ghz"]
    print(f"\n## {label}: forward+backward {ms_plain:.3f} ms plain, {ms_stamped:.3f} ms stamped; "
          f"SM clock {ghz:.2f} GHz")
    for w in sorted(k for k in res if k.startswith("consumer")):
        r = res[w]
        print(f"{w}: median step {r['step_clocks']:.0f} clk ({r['step_clocks'] / ghz / 1e3:.2f} µs)"
              f" over {r['ctas']} CTAs; a CTA: " + ", ".join(
                  f"{k} {v:.0f}" for k, v in r["cta"].items())
              + f"; beyond its steps {r['fixed_steps']:.2f} step-times")
        _print_steps(r, BWD_STEP_NAMES)
    if res["producer"]:
        print("producer (median a step, clk): stage wait {:.0f}, loads and statistics {:.0f}"
              .format(*res["producer"]))


def analyse(tl, consumers):
    """Medians (clocks) of the schedule's intervals; see the module's docstring."""
    out = {"clock_ghz": _clock_ghz(tl, 1 + consumers)}
    for w in range(1, 1 + consumers):
        runs, step_len, tiles, epi_parts = [], [], [], []
        for c in range(CTAS):
            for u in range(TILES):
                t = tl[c, w, u, TILE_SLOT]
                if UNSET in (t[0], t[6], t[7]):
                    continue
                nblk = int(t[7])
                # (every block but the last; steps from EPI_STEP on may hold tile events)
                steps, lens = _steps(tl, c, w, u, nblk - 1, EPI_STEP)
                runs.append(steps)
                step_len += lens
                e = tl[c, w, u, EPI_STEP]
                if nblk - 1 <= EPI_STEP and UNSET not in (t[5], *e[:5]):
                    pts = [t[5], *e[:5], t[6]]
                    epi_parts.append([_d(pts[i], pts[i + 1]) for i in range(6)])
                nxt = tl[c, w, u + 1, TILE_SLOT] if u + 1 < TILES else None
                tiles.append(dict(
                    blocks=nblk, q=_d(t[0], t[1]), s0=_d(t[1], t[2]), softmax0=_d(t[2], t[3]),
                    steps=_d(t[3], t[4]), last_pv=_d(t[4], t[5]), epilogue=_d(t[5], t[6]),
                    span=_d(t[0], t[6]),
                    to_next=(_d(t[6], nxt[0]) if nxt is not None and nxt[0] != UNSET else None),
                    tile=(_d(t[0], nxt[0]) if nxt is not None and nxt[0] != UNSET else None)))
        step = _med(step_len)
        whole = [t for t in tiles if t["tile"] is not None]
        out[f"consumer{w}"] = dict(
            step_clocks=step, **_step_table(runs),
            prologue={k: _med([t[k] for t in tiles]) for k in ("q", "s0", "softmax0")},
            epilogue={k: _med([t[k] for t in tiles if t[k] is not None])
                      for k in ("last_pv", "epilogue", "to_next")},
            tile_clocks=_med([t["tile"] for t in whole]),
            blocks=_med([t["blocks"] for t in whole]),
            fixed_blocks=_med([t["tile"] / step - t["blocks"] for t in whole]) if step else None,
            # (one tile a CTA: no next tile; the tile's own span, received to epilogue issued)
            span_clocks=_med([t["span"] for t in tiles]),
            span_fixed_blocks=_med([t["span"] / step - t["blocks"] for t in tiles]) if step else None,
            epilogue_parts=({n: _med([x[i] for x in epi_parts]) for i, n in enumerate(EPI_NAMES)}
                            if epi_parts else None),
            tiles=len(tiles))
    out["producer"] = _producer(tl, TILES, 4)
    out["q_path"] = _q_path(tl, consumers)
    return out


def _sd(a, b):
    """b - a on the 32-bit clock, signed (both set)."""
    return ((int(b) - int(a) + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def _q_path(tl, consumers):
    """The next tile's Q, tile u >= 1 of each CTA (medians, clocks): from the consumers' release
    of Q (the later warpgroup's "steps done", where it arrives on empty_q) to the producer's
    issue of the next Q's load (its tile slot 1, after its wait on empty_q), from that issue to
    the first consumer past its wait for Q (tile slot 1: an upper bound on the load's latency
    where the consumer waited), from the producer's start of the tile (slot 0) to the issue,
    from the later warpgroup's epilogue end (slot 6 of tile u - 1) to Q in hand, and (tiles of
    at most QWAIT_STEP blocks, whose steps leave that slot alone) the wait itself, from the
    clock just before it, and from the issue to the first consumer at the wait. (None for the
    FP8 kernel, whose producer does not stamp its Q load.)"""
    rows = []
    for c in range(CTAS):
        for u in range(1, TILES):
            prev = [tl[c, w, u - 1, TILE_SLOT] for w in range(1, 1 + consumers)]
            cur = [tl[c, w, u, TILE_SLOT] for w in range(1, 1 + consumers)]
            p = tl[c, 0, u, TILE_SLOT]
            if UNSET in (p[0], p[1]) or any(UNSET in (t[4], t[6]) for t in prev) \
                    or any(UNSET in (t[0], t[1]) for t in cur):
                continue
            r = prev[0][4]
            release = max(_sd(r, t[4]) for t in prev)
            epi_end = max(_sd(r, t[6]) for t in prev)
            issue, start = _sd(r, p[1]), _sd(r, p[0])
            ready = min(_sd(r, t[1]) for t in cur)
            waited = min(_sd(t[0], t[1]) for t in cur)
            row = dict(release_to_issue=issue - release, issue_to_ready=ready - issue,
                       start_to_issue=issue - start, epilogue_end_to_ready=ready - epi_end,
                       consumer_q_wait=waited)
            # the wait alone (from the clock before it), where the tile's steps left it
            before = [tl[c, w, u, QWAIT_STEP][0] for w in range(1, 1 + consumers)]
            if all(t[7] != UNSET and int(t[7]) - 1 <= QWAIT_STEP for t in cur) \
                    and UNSET not in before:
                row.update(wait_alone=min(_sd(b, t[1]) for b, t in zip(before, cur)),
                           issue_to_first_waiter=min(_sd(r, b) for b in before) - issue)
            rows.append(row)
    keys = dict.fromkeys(k for x in rows for k in x)
    return {k: _med([x[k] for x in rows if k in x]) for k in keys} | {"tiles": len(rows)} \
        if rows else None


def report(label, res, ms_plain, ms_stamped):
    ghz = res["clock_ghz"]
    print(f"\n## {label}: {ms_plain:.3f} ms plain, {ms_stamped:.3f} ms stamped; SM clock "
          f"{ghz:.2f} GHz")
    for w in sorted(k for k in res if k.startswith("consumer")):
        r = res[w]
        print(f"{w}: median step {r['step_clocks']:.0f} clk ({r['step_clocks'] / ghz / 1e3:.2f} µs);"
              f" tile {r['tile_clocks']:.0f} clk for {r['blocks']:.0f} blocks -> fixed cost "
              f"{r['fixed_blocks']:.2f} block-times "
              f"({r['fixed_blocks'] * r['step_clocks'] / ghz / 1e3:.2f} µs) over {r['tiles']} tiles")
        print(f"  a tile's own span (received to epilogue issued): {r['span_clocks']:.0f} clk, "
              f"{r['span_fixed_blocks']:.2f} block-times beyond its blocks")
        _print_steps(r, STEP_NAMES)
        print("  prologue  " + ", ".join(f"{k} {v:.0f}" for k, v in r["prologue"].items()))
        print("  epilogue  " + ", ".join(f"{k} {v:.0f}" for k, v in r["epilogue"].items()))
        if r.get("epilogue_parts"):
            print("  epilogue by part (TMA-store epilogue; from the last P V's end)  " + ", ".join(
                f"{k} {v:.0f}" for k, v in r["epilogue_parts"].items()))
    if res.get("q_path"):
        print("next tile's Q (median clk): " + ", ".join(
            f"{k.replace('_', ' ')} {v:.0f}" for k, v in res["q_path"].items()))
    if res["producer"]:
        print("producer (median a key block, clk): " + ", ".join(
            f"{n} {v:.0f}" for n, v in zip(("K wait+issue", "V wait", "V issue/transpose"),
                                           res["producer"])))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention dropout p (a fixed random state: the stamped and plain "
                         "calls draw the same masks)")
    ap.add_argument("--defines", nargs="*", default=[])
    ap.add_argument("--json")
    ap.add_argument("--raw", help="a folder for each call's stamps (NumPy .npz, uint32 "
                                  "[CTA][warpgroup][tile][step][event])")
    args = ap.parse_args(argv)

    import torch
    import flashcore
    from flashcore import config, jit
    from flashcore.bench import fp8_quantise, gpu_time, random_arrays, shape_for

    if args.backward and args.fp8:
        ap.error("--backward: the FP8 forward has no backward")
    if args.fp8 and args.dropout:
        ap.error("--dropout: FP8 attention has no dropout")
    results = {}
    for d in args.headdim:
        for s in args.seqlen:
            for causal in {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]:
                b, _, h, _ = shape_for(s, d)
                x = random_arrays("torch", [(b, s, h, d)] * 3, seed=s + d)
                kw = dict(causal=causal)
                if args.fp8:
                    x, ds = zip(*(fp8_quantise(t) for t in x))
                    kw.update(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])

                if args.dropout and not args.backward:
                    kw.update(dropout_p=args.dropout,
                              rng_state=torch.tensor([s, d], dtype=torch.int64, device="cuda"))
                if args.backward:
                    x = [t.detach().requires_grad_() for t in x]
                    grad = torch.randn_like(x[0])
                    if args.dropout:
                        kw.update(dropout_p=args.dropout)

                    def call():
                        if args.dropout:
                            torch.manual_seed(s + d)     # (the same masks every call)
                        out = flashcore.attention(*x, **kw)
                        return torch.autograd.grad(out, x, grad)
                else:
                    def call():
                        return flashcore.attention_forward(*x, **kw)
                prefix = ("flash_fwd_sm90" if not args.backward else
                          "flash_bwd_dkdv_sm90_d256" if d == 256 else "flash_bwd_dkdv_sm90_ws")
                pick = 1 if args.backward else 0     # dK (dQ's reduce-adds may vary in order)
                extra = tuple(f"-D{n}" for n in args.defines)
                with config.override(sm90_defines=extra):
                    ref = call()[pick].float()
                    t_plain = gpu_time(call)
                with config.override(sm90_defines=extra + (DEFINE,)):
                    jit.clear_memory_cache()      # (so that one stamped kernel is loaded)
                    out = call()[pick].float()
                    if not torch.equal(out, ref):
                        print(f"# the stamped kernel's output differs from the plain one's: "
                              f"max {float((out - ref).abs().max()):.3g}")
                    t_st = gpu_time(call)
                    ptr, size, name = _timeline_buffer(jit, prefix)
                    torch.cuda.synchronize()
                    ctypes.CDLL("libcuda.so.1").cuMemsetD32_v2(
                        ctypes.c_uint64(ptr), ctypes.c_uint(UNSET), ctypes.c_size_t(size // 4))
                    call()
                    torch.cuda.synchronize()
                    tl = _read(ptr, size)
                label = (f"{'fp8 ' if args.fp8 else ''}"
                         f"{f'dropout {args.dropout} ' if args.dropout else ''}"
                         f"{' '.join(args.defines)} d{d} s{s} b{b} h{h} "
                         f"{'causal' if causal else 'full'} [{name}]")
                if args.backward:
                    res = analyse_bwd(tl)
                    report_bwd(label, res, t_plain * 1e3, t_st * 1e3)
                else:
                    res = analyse(tl, _consumers(name))
                    report(label, res, t_plain * 1e3, t_st * 1e3)
                results[label] = dict(res, ms_plain=t_plain * 1e3, ms_stamped=t_st * 1e3)
                if args.raw:
                    import os
                    os.makedirs(args.raw, exist_ok=True)
                    tag = "_".join(label.split(" [")[0].split()).replace("-D", "")
                    np.savez_compressed(os.path.join(args.raw, f"{tag}.npz"), tl=tl)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
