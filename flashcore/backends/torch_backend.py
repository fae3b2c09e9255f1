"""The torch backend: torch tensors in, torch tensors out, no copies on the way.

:class:`TorchBackend` moves tensors to the backend that does the work and back, zero-copy: CPU
tensors become NumPy views (``t.detach().numpy()``) for the NumPy backend; CUDA tensors go to
the CUDA kernels' launchers (the CuPy backend's methods) wrapped as
:class:`flashcore.kernels.device.TorchArray`, so the kernels run on torch's current stream and
device with the outputs allocated by torch and every scratch buffer the launchers need
(split-KV partials, dQ accumulators, copies) taken from torch's caching allocator: a call can
be captured in a CUDA graph (``torch.cuda.graph``) and replays bit for bit. The CUDA calls go
to the driver through ctypes (flashcore.kernels.device): CuPy is imported only by a process that
compiles a kernel (NVRTC's bindings).

The torch route above it (the ops, autograd, the entry points) is :mod:`flashcore.backends.torch_ops`.
Nothing here imports torch at flashcore import time.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

from ..spec import FLOAT_DTYPES, AttentionSpec
from .base import Backend, get_backend, register

__all__ = ["TorchBackend"]

# --------------------------------------------------------------------------------------------
# Layer 1: the backend (no autograd)
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _torch_unavailable_reason() -> str | None:
    return None if importlib.util.find_spec("torch") is not None else \
        "PyTorch is not installed (pip install 'flashcore[torch]')"


def _bf16_reason() -> str | None:
    """Why the kernels cannot take bfloat16 CUDA tensors here, or None."""
    if importlib.util.find_spec("ml_dtypes") is None:
        return "bfloat16 CUDA tensors need the ml_dtypes package (pip install ml_dtypes)"
    return None


def _contiguous_numpy_to_torch(torch, a):
    # The NumPy backend may hand back a (b, s, h, d) view of (b, h, s, d) memory; the fake
    # implementations promise contiguous results, so make them so (a copy only when needed).
    import numpy as np
    return torch.from_numpy(np.ascontiguousarray(a))


class TorchBackend(Backend):
    """torch.Tensor front end: CPU tensors on the NumPy backend, CUDA tensors on the CuPy kernels.

    Capabilities depend on where the tensors live: CPU takes float16/float32/float64
    (bfloat16 has no NumPy view), CUDA takes what the CuPy kernels take (float16/bfloat16,
    any headdim up to 256; decoding: a multiple of 8). ``not_supported_reasons`` says which
    applies.
    """

    name = "torch"
    libraries = ("torch",)
    dtypes = FLOAT_DTYPES + ("float8_e4m3fn",)   # (FP8: forward only, see _forward_fp8)
    supports_kvcache = True
    supports_fp8_kvcache = True   # torch.float8_e4m3fn caches (as the backend delegated to)

    def unavailable_reason(self):
        return _torch_unavailable_reason()

    def info(self):
        if self.unavailable_reason() is not None:
            return {}
        import torch
        d = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
        if torch.cuda.is_available():
            d["torch_gpu"] = torch.cuda.get_device_name()
        return d

    def not_supported_reasons(self, spec: AttentionSpec, backward: bool = False):
        r = super().not_supported_reasons(spec, backward)
        if r:
            return r
        return _delegated_reasons(
            spec, lambda lib: get_backend(lib).not_supported_reasons(
                dataclasses.replace(spec, library=lib), backward))

    # -- the work (plain tensors in and out; autograd lives in the custom ops below) --------

    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                block_table=None, out_fp32=False, rng_state=None, descales=None,
                fp8_out="bfloat16"):
        """Return ``(out, lse)`` as torch tensors on q's device; out contiguous, like q.
        torch.float8_e4m3fn q, k, v (``spec.dtype``; forward only, no autograd): ``descales``
        (q, k, v), out in ``fp8_out``; see :meth:`_forward_fp8`."""
        import torch
        if spec.dtype == "float8_e4m3fn":
            return self._forward_fp8(torch, spec, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                     descales, fp8_out)
        extra = {n: t for n, t in (("block_table", block_table), ("rng_state", rng_state))
                 if t is not None}
        if q.device.type == "cpu":
            nb = get_backend("numpy")
            out, lse = nb.forward(_on_library(spec, "numpy"),
                                  *(_np(x) for x in (q, k, v)),
                                  alibi_slopes=_np(alibi_slopes), cu_seqlens_q=_np(cu_seqlens_q),
                                  cu_seqlens_k=_np(cu_seqlens_k), out_fp32=out_fp32,
                                  **{n: _np(t) for n, t in extra.items()})
            return _contiguous_numpy_to_torch(torch, out), _contiguous_numpy_to_torch(torch, lse)
        cb = get_backend("cupy")
        lse_shape = (spec.nheads, spec.total_q) if spec.varlen else \
            (spec.batch, spec.nheads, spec.seqlen_q)
        out = torch.empty(q.shape, dtype=torch.float32 if out_fp32 else q.dtype, device=q.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        cb.forward(_on_library(spec, "cupy"), *(_cp(x) for x in (q, k, v)),
                   alibi_slopes=_cp(alibi_slopes), cu_seqlens_q=_cp(cu_seqlens_q),
                   cu_seqlens_k=_cp(cu_seqlens_k), out=_cp(out), lse=_cp(lse),
                   **{n: _cp(t) for n, t in extra.items()})
        return out, lse

    def _forward_fp8(self, torch, spec, q, k, v, cu_seqlens_q, cu_seqlens_k, descales,
                     fp8_out):
        """FP8 tensors cross as their bytes: ml_dtypes float8_e4m3fn views on CPU (the NumPy
        reference), uint8 tensors on CUDA (the Hopper kernel); the descales as given on
        CPU, as contiguous float32 (batch, nheads_k) tensors on CUDA."""
        from ..spec import exact_descale
        descales = descales or (None, None, None)
        q8, k8, v8 = (x.detach().view(torch.uint8) for x in (q, k, v))
        if q.device.type == "cpu":
            import ml_dtypes
            # (bfloat16 has no torch view of NumPy's: float32, rounded by torch the same way)
            bf16 = fp8_out == "bfloat16"
            out, lse = get_backend("numpy").forward(
                _on_library(spec, "numpy"),
                *(_np(x).view(ml_dtypes.float8_e4m3fn) for x in (q8, k8, v8)),
                cu_seqlens_q=_np(cu_seqlens_q), cu_seqlens_k=_np(cu_seqlens_k),
                descales=tuple(_np(d) for d in descales),
                fp8_out="float32" if bf16 else fp8_out)
            out = _contiguous_numpy_to_torch(torch, out)
            return (out.to(torch.bfloat16) if bf16 else out), _contiguous_numpy_to_torch(torch, lse)
        descales = tuple(exact_descale(d, spec.batch, spec.nheads_k) for d in descales)
        out = torch.empty(q.shape, dtype=getattr(torch, fp8_out), device=q.device)
        lse = torch.empty((spec.nheads, spec.total_q) if spec.varlen else
                          (spec.batch, spec.nheads, spec.seqlen_q), dtype=torch.float32,
                          device=q.device)
        get_backend("cupy").forward(_on_library(spec, "cupy"), *(_cp(x) for x in (q8, k8, v8)),
                                    cu_seqlens_q=_cp(cu_seqlens_q),
                                    cu_seqlens_k=_cp(cu_seqlens_k), out=_cp(out), lse=_cp(lse),
                                    descales=tuple(_cp(d) for d in descales),
                                    fp8_out=fp8_out)
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None):
        """Return ``(dq, dk, dv)`` as contiguous torch tensors like q, k, v."""
        import torch
        if q.device.type == "cpu":
            nb = get_backend("numpy")
            grads = nb.backward(_on_library(spec, "numpy"),
                                *(_np(x) for x in (dout, q, k, v, out, lse)),
                                alibi_slopes=_np(alibi_slopes), cu_seqlens_q=_np(cu_seqlens_q),
                                cu_seqlens_k=_np(cu_seqlens_k), rng_state=_np(rng_state))
            # In the inputs' layout, like the CUDA path and the fake implementation.
            return tuple(torch.empty_like(x).copy_(torch.from_numpy(g))
                         for x, g in zip((q, k, v), grads))
        cb = get_backend("cupy")
        # Gradients in the inputs' own layout (empty_like keeps a dense view's strides), so
        # autograd can hand them to .grad without a copy.
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        cb.backward(_on_library(spec, "cupy"),
                    *(_cp(x) for x in (dout, q, k, v, out, lse)),
                    alibi_slopes=_cp(alibi_slopes), cu_seqlens_q=_cp(cu_seqlens_q),
                    cu_seqlens_k=_cp(cu_seqlens_k), dq=_cp(dq), dk=_cp(dk), dv=_cp(dv),
                    rng_state=_cp(rng_state))
        return dq, dk, dv

    # -- decoding with a KV cache (inference: no autograd) ---------------------------------

    def kvcache_not_supported_reasons(self, spec):
        why = self.unavailable_reason()
        if why:
            return [f"not available: {why}"]
        return _delegated_reasons(
            spec.attn, lambda lib: get_backend(lib).kvcache_not_supported_reasons(
                _kv_library(spec, lib)))

    def forward_kvcache(self, spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                        block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None,
                        cache_leftpad=None, k_descale=None, v_descale=None, key_mask=None):
        """Return ``(out, lse)`` as torch tensors (not requiring grad); the cache tensors are
        written in place through zero-copy views (NumPy on CPU, CuPy/DLPack on CUDA), and
        their autograd version counters are bumped. torch.float8_e4m3fn caches (read only)
        cross as their bytes: ml_dtypes float8_e4m3fn views on CPU, uint8 CuPy views (the
        CuPy backend's FP8 caches) on CUDA."""
        import torch
        conv = _np if q.device.type == "cpu" else _cp
        as_int = spec.cache_seqlens_int is not None
        if spec.fp8:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        with torch.no_grad():
            if q.device.type == "cpu":
                kc, vc = conv(k_cache), conv(v_cache)
                if spec.fp8:
                    import ml_dtypes
                    kc, vc = kc.view(ml_dtypes.float8_e4m3fn), vc.view(ml_dtypes.float8_e4m3fn)
                out, lse = get_backend("numpy").forward_kvcache(
                    _kv_library(spec, "numpy"), conv(q), kc, vc, conv(k), conv(v),
                    cache_seqlens=cache_seqlens if as_int else conv(cache_seqlens),
                    block_table=conv(block_table), rotary_cos=conv(rotary_cos),
                    rotary_sin=conv(rotary_sin), alibi_slopes=conv(alibi_slopes),
                    cache_leftpad=conv(cache_leftpad), k_descale=conv(k_descale),
                    v_descale=conv(v_descale), key_mask=conv(key_mask))
                out = _contiguous_numpy_to_torch(torch, out)
                lse = _contiguous_numpy_to_torch(torch, lse)
            else:
                a = spec.attn
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                lse = torch.empty((a.batch, a.nheads, a.seqlen_q), dtype=torch.float32,
                                  device=q.device)
                get_backend("cupy").forward_kvcache(
                    _kv_library(spec, "cupy"), *(conv(x) for x in (q, k_cache, v_cache, k, v)),
                    cache_seqlens=cache_seqlens if as_int else conv(cache_seqlens),
                    block_table=conv(block_table), rotary_cos=conv(rotary_cos),
                    rotary_sin=conv(rotary_sin), alibi_slopes=conv(alibi_slopes),
                    cache_leftpad=conv(cache_leftpad), k_descale=conv(k_descale),
                    v_descale=conv(v_descale), key_mask=conv(key_mask), out=conv(out),
                    lse=conv(lse))
        if spec.appends:
            _bump_version(torch, k_cache, v_cache)
        return out, lse


def _kv_library(spec, library):
    return dataclasses.replace(spec, attn=dataclasses.replace(spec.attn, library=library))


def _bump_version(torch, *tensors):
    """Tell autograd that these tensors were written (through a view it cannot see)."""
    inc = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    for t in tensors:
        if inc is not None and not t.is_inference():
            inc(t)


def _np(t):
    """A NumPy view of a CPU tensor's storage (no copy), or None."""
    return None if t is None else t.detach().numpy()


def _delegated_reasons(attn: AttentionSpec, reasons_of) -> list[str]:
    """Why the backend that torch tensors on ``attn.device`` go to cannot take the call:
    CPU tensors run on the NumPy backend, CUDA tensors on the CuPy kernels.
    ``reasons_of(library)`` asks that backend."""
    if attn.device == "cpu":
        if attn.dtype == "bfloat16":
            return ["bfloat16 CPU tensors are not supported: NumPy cannot view torch's "
                    "bfloat16 storage without a copy (use float32/float64 on CPU, or a "
                    "CUDA tensor)"]
        return [f"on CPU (NumPy backend): {x}" for x in reasons_of("numpy")]
    if attn.device.startswith("cuda"):
        reasons = reasons_of("cupy")
        if not reasons and attn.dtype == "bfloat16":
            why = _bf16_reason()
            reasons = [why] if why else []
        return [f"CUDA tensors run on the CuPy kernels, which cannot take this call: {x}"
                for x in reasons]
    return [f"tensors on {attn.device} are not supported (CPU and CUDA only)"]


def _on_library(spec: AttentionSpec, library: str) -> AttentionSpec:
    """``spec`` for the backend torch delegates to (specs are frozen and hashable)."""
    return dataclasses.replace(spec, library=library)


def _cp(t):
    """A CUDA tensor as the kernels' launchers take it (a TorchArray over its detached self,
    no copy), or None. Only the first call of a layout comes here: later ones replay its
    launch plan from the tensors' addresses."""
    return None if t is None else TorchArray(t.detach())


# --------------------------------------------------------------------------------------------
# Replaying a recorded call (flashcore.kernels.plans) on torch's terms
# --------------------------------------------------------------------------------------------

def layout(t):
    """What a launch plan may depend on of a tensor (or None): shape, strides, dtype, device
    and the address modulo 16."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def replay(torch, plan, pointers, device) -> bool:
    """Run ``plan`` with ``pointers`` on torch's current stream of ``device``, scratch from
    torch's caching allocator. False (nothing launched) when another CUDA context is current
    on this thread (plans.enter), or the stream has no split counters yet: run in full then."""
    if not enter(plan):
        return False
    stream = torch_stream_getter()(device.index)
    if not plan.scratch_bytes:      # (no allocator to make)
        return plan.run(pointers, stream, None) is not None

    def alloc(nbytes):     # (sizes as ints, not tuples: torch's argument parser is faster)
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t, t.data_ptr()
    return plan.run(pointers, stream, alloc) is not None


from ..kernels.device import TorchArray, torch_stream_getter  # noqa: E402
from ..kernels.plans import enter  # noqa: E402


_BACKEND = register(TorchBackend())
