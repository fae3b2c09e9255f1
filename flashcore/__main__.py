"""``python -m flashcore``: environment report, self-check of every available backend against
the naive reference, and a small benchmark table. Exits non-zero if a self-check fails."""
from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np

from . import __version__, attention_backward, attention_forward, available_backends
from .backends.base import all_backends
from .reference import naive_backward, naive_forward, round_to_dtype
from .spec import forward_spec


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m flashcore",
        description="Report the environment, self-check every available flashcore backend "
                    "against the naive NumPy reference, and print a benchmark table.")
    p.add_argument("--backend", choices=sorted(all_backends()), action="append",
                   help="only this backend (repeatable; default: every available one)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                   help="element type (default: on a GPU float16 and bfloat16 in the self-check, "
                        "bfloat16 in the benchmark; on the CPU float32). On the CPU the NumPy "
                        "backend takes all three (bfloat16 needs ml_dtypes) and computes in "
                        "float32; torch's CPU tensors take float16 and float32, not bfloat16. "
                        "A backend that cannot take the type is skipped with the reason")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 16384 // seqlen on GPU, 1 on CPU)")
    p.add_argument("--seqlen", type=int, action="append",
                   help="sequence length to benchmark (repeatable; default 1024 2048 4096 on GPU, 256 512 on CPU)")
    p.add_argument("--nheads", type=int, default=None, help="query heads (default: 2048 // headdim on GPU, 4 on CPU)")
    p.add_argument("--nheads-k", type=int, default=None, help="key/value heads (GQA; default = nheads)")
    p.add_argument("--headdim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right aligned) masking")
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions (median is reported)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness self-check")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark table")
    return p.parse_args(argv)


def _environment():
    print(f"flashcore {__version__}  python {platform.python_version()}  numpy {np.__version__}  "
          f"({platform.machine()}, {platform.system()})")
    for name, why in available_backends().items():
        b = all_backends()[name]
        extra = ""
        if why is None:
            info = b.info()
            extra = "  " + ", ".join(f"{k} {v}" for k, v in info.items()) if info else ""
        print(f"  backend {name:6s} {'available' if why is None else 'unavailable: ' + why}{extra}")


def _np_dtype(dtype):
    """The NumPy dtype of a name; bfloat16 is ml_dtypes' (NumPy has none of its own)."""
    if dtype == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _arrays(lib, dtype, shape, rng):
    x = rng.standard_normal(shape).astype(np.float32)
    if lib == "numpy":
        return x.astype(_np_dtype(dtype))
    if lib == "cupy":
        import cupy
        return cupy.asarray(x.astype(_np_dtype(dtype)))
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.from_numpy(x).to(device=dev, dtype=getattr(torch, dtype))


def _to_np(x):
    lib = type(x).__module__.split(".")[0]
    if lib == "cupy":
        x = x.get()
    elif lib == "torch":
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64) if x.dtype.name != "bfloat16" else x.astype(np.float64)


def _lib_of(name):
    return {"numpy": "numpy", "cupy": "cupy", "torch": "torch"}[name]


def _on_gpu(name) -> bool:
    """Whether backend ``name`` runs on a GPU here (torch without CUDA runs its CPU tensors on
    the NumPy backend)."""
    if name == "cupy":
        return True
    if name == "torch":
        import torch
        return torch.cuda.is_available()
    return False


def _dtypes(name, requested, for_bench):
    """Element types to run ``name`` with: the requested one, or float32 on the CPU, float16
    and bfloat16 on a GPU (bfloat16 alone in the benchmark). Whether the backend can take a
    requested type here is :func:`_why_not`'s question."""
    if requested:
        return [requested]
    if not _on_gpu(name):
        return ["float32"]
    return ["bfloat16"] if for_bench else ["float16", "bfloat16"]


def _why_not(name, dtype):
    """Why backend ``name`` cannot run ``dtype`` here (one line), or None if it can."""
    if dtype == "bfloat16" and _lib_of(name) != "torch":
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            return "bfloat16 NumPy/CuPy arrays need ml_dtypes (pip install ml_dtypes)"
    if name == "torch" and dtype == "bfloat16" and not _on_gpu(name):
        return ("torch's CPU tensors run on the NumPy backend, which cannot view torch's "
                "bfloat16 CPU storage without a copy: use float16 or float32 on the CPU")
    return None


def _self_check(name, dtype, causal):
    """Random odd-sized GQA problem; the flash-attn rule against the float64 oracle."""
    rng = np.random.default_rng(int(time.time()))
    b, sq, sk, h, hk, d = 2, 77, 93, 4, 2, 64
    lib = _lib_of(name)
    q, k, v = (_arrays(lib, dtype, s, rng) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = _arrays(lib, dtype, (b, sq, h, d), rng)
    kw = dict(causal=causal)
    out, lse = attention_forward(q, k, v, backend=name, **kw)
    grads = attention_backward(dout, q, k, v, out, lse, backend=name, **kw)
    q64, k64, v64, do64 = (_to_np(x) for x in (q, k, v, dout))
    spec = forward_spec(q64, k64, v64, **kw)
    ro, rl = naive_forward(spec, q64, k64, v64)
    rg = naive_backward(spec, do64, q64, k64, v64)
    low = dtype if dtype in ("float16", "bfloat16") else None
    q32, k32, v32, do32 = (x.astype(np.float32) for x in (q64, k64, v64, do64))
    spec32 = forward_spec(q32, k32, v32, **kw)
    lo_o, _ = naive_forward(spec32, q32, k32, v32, round_to=low)
    lo_g = naive_backward(spec32, do32, q32, k32, v32, round_to=low)
    worst = []
    for label, got, ref, lo, factor in [("out", out, ro, lo_o, 2), *[
            (f"d{c}", g, r, lg, 3) for c, g, r, lg in zip("qkv", grads, rg, lo_g)]]:
        err = float(np.abs(_to_np(got) - ref).max())
        base = float(np.abs(round_to_dtype(lo, low) - ref).max())
        ok = np.isfinite(_to_np(got)).all() and err <= factor * base + 1e-5
        worst.append((label, err, base, ok))
    lse_err = float(np.abs(_to_np(lse) - rl).max())
    ok = all(w[3] for w in worst) and lse_err < 1e-3
    detail = ", ".join(f"{l} {e:.1e} (≤{f}×{b_:.1e})" for (l, e, b_, _), f in zip(worst, (2, 3, 3, 3)))
    print(f"  {name:6s} {dtype:8s} causal={causal!s:5s} {'PASS' if ok else 'FAIL'}  {detail}, lse {lse_err:.1e}")
    return ok


def _sync(lib):
    if lib == "cupy":
        import cupy
        cupy.cuda.get_current_stream().synchronize()
    elif lib == "torch":
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _time(fn, lib, repeats):
    fn()
    _sync(lib)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(lib)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _bench(names, args):
    print(f"\nbenchmark: headdim {args.headdim}, causal={args.causal}; median wall time of "
          "synchronised calls; TFLOP/s counted as flash-attn does (fwd 4·b·h·s²·d, halved for "
          "causal; fwd+bwd 3.5× that)")
    print(f"  {'backend':8s} {'dtype':9s} {'batch':>5s} {'seqlen':>6s} {'heads':>5s} "
          f"{'fwd ms':>9s} {'fwd TF/s':>9s} {'f+b ms':>9s} {'f+b TF/s':>9s}")
    rng = np.random.default_rng(0)
    for name in names:
        lib = _lib_of(name)
        gpu = _on_gpu(name)
        dtype = _dtypes(name, args.dtype, True)[0]
        why = _why_not(name, dtype)
        if why:
            print(f"  {name:8s} {dtype:9s} skipped: {why}")
            continue
        for s in args.seqlen or ([1024, 2048, 4096] if gpu else [256, 512]):
            h = args.nheads or (2048 // args.headdim if gpu else 4)
            hk = args.nheads_k or h
            b = args.batch or (max(1, 16384 // s) if gpu else 1)
            d = args.headdim
            q, k, v, do = (_arrays(lib, dtype, shp, rng) for shp in
                           ((b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d)))
            kw = dict(causal=args.causal, backend=name)
            reps = args.repeats or (20 if gpu else 3)
            tf = _time(lambda: attention_forward(q, k, v, **kw), lib, reps)

            def fb():
                o, l = attention_forward(q, k, v, **kw)
                attention_backward(do, q, k, v, o, l, **kw)
            tb = _time(fb, lib, reps)
            flops = 4.0 * b * h * s * s * d / (2 if args.causal else 1)
            print(f"  {name:8s} {dtype:9s} {b:5d} {s:6d} {h:5d} {tf * 1e3:9.3f} "
                  f"{flops / tf / 1e12:9.3f} {tb * 1e3:9.3f} {3.5 * flops / tb / 1e12:9.3f}")


def main(argv=None) -> int:
    args = _parse(argv)
    _environment()
    avail = [n for n, why in available_backends().items() if why is None]
    names = [n for n in (args.backend or avail)]
    missing = [n for n in names if n not in avail]
    if missing:
        print(f"error: backend(s) {missing} not available here (see above)", file=sys.stderr)
        return 2
    runnable = [(n, dt) for n in names for dt in _dtypes(n, args.dtype, False)
                if _why_not(n, dt) is None]
    if not runnable:
        reasons = "; ".join(f"{n}: {_why_not(n, dt)}" for n in names
                            for dt in _dtypes(n, args.dtype, False))
        print(f"error: nothing can run {args.dtype} here ({reasons})", file=sys.stderr)
        return 2
    ok = True
    if not args.no_check:
        print("\nself-check against the float64 naive reference (flash-attn rule: error ≤ 2× "
              "that of the same computation in the low precision, 3× for gradients):")
        for name in names:
            for dt in _dtypes(name, args.dtype, False):
                why = _why_not(name, dt)
                if why:
                    print(f"  {name:6s} {dt:8s} skipped: {why}")
                    continue
                for causal in (False, True):
                    ok &= _self_check(name, dt, causal)
    if not args.no_bench:
        _bench(names, args)
    if not ok:
        print("\nSELF-CHECK FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
