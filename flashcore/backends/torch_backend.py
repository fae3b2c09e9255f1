"""The torch backend: torch tensors in, torch tensors out, no copies on the way.

Three thin layers, bottom to top:

1. :class:`TorchBackend` moves tensors to the backend that does the work and back, zero-copy:
   CPU tensors become NumPy views (``t.detach().numpy()``) for the NumPy backend and its
   results come back through ``torch.from_numpy``; CUDA tensors become CuPy arrays through
   DLPack (``cupy.from_dlpack(t.detach())``), the outputs are allocated by torch and handed to
   the CuPy kernels as ``out=``/``lse=``/``dq=``..., and the kernels run on torch's current
   stream and on the tensor's device.
2. Two ``torch.library`` custom ops, ``flashcore::fwd`` and ``flashcore::bwd``, with fake
   (shape-only) implementations, so that ``torch.compile(fullgraph=True)`` traces through
   flashcore without a graph break and ``torch.library.opcheck`` passes. One op serves padded
   and varlen calls: ``cu_seqlens_q`` present means varlen.
3. Autograd registered on the ops (``register_autograd``): the forward saves
   ``(q, k, v, out, lse)``, the backward calls ``flashcore::bwd``. ``lse`` is not
   differentiable; differentiating the backward (double backward) is refused.

Nothing here imports torch at flashcore import time: the ops are defined on first use.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys

from .._arrays import device_of, dtype_name
from ..kernels import plans
from ..spec import FLOAT_DTYPES, AttentionSpec, forward_spec
from .base import Backend, choose, get_backend, register

__all__ = ["TorchBackend", "autograd_attention", "torch_ops", "set_fast_path"]

DOUBLE_BACKWARD_MESSAGE = (
    "flashcore: double backward is not supported (the attention backward is not itself "
    "differentiable); use torch.nn.functional.scaled_dot_product_attention's math backend "
    "for higher-order gradients")


# --------------------------------------------------------------------------------------------
# Layer 1: the backend (no autograd)
# --------------------------------------------------------------------------------------------

_TORCH_REASON: list = []    # memo of _torch_unavailable_reason(), filled on first call


def _torch_unavailable_reason() -> str | None:
    if "torch" in sys.modules:  # already imported: usable, and no file-system probe
        return None
    if not _TORCH_REASON:
        _TORCH_REASON.append(None if importlib.util.find_spec("torch") is not None else
                             "PyTorch is not installed (pip install 'flashcore[torch]')")
    return _TORCH_REASON[0]


def _cupy_bf16_reason() -> str | None:
    """Why bfloat16 cannot cross DLPack into CuPy here, or None."""
    import cupy
    if int(cupy.__version__.split(".")[0]) < 14:
        return (f"bfloat16 CUDA tensors need CuPy >= 14 to cross DLPack (found CuPy "
                f"{cupy.__version__})")
    if importlib.util.find_spec("ml_dtypes") is None:
        return "bfloat16 CUDA tensors need the ml_dtypes package (pip install ml_dtypes)"
    return None


_STREAMS: dict = {}


def _cupy_stream(torch, device):
    """torch's current stream on ``device`` as a CuPy stream (usable as a context).

    Memoised by the stream's handle: wrapping it anew cost microseconds on every call, and
    torch never frees a stream handle it has handed out (its streams come from fixed pools or
    live as long as their Python object, which the memo then keeps)."""
    import cupy
    ts = torch.cuda.current_stream(device)
    key = (ts.cuda_stream, device.index)
    cs = _STREAMS.get(key)
    if cs is None:
        if hasattr(cupy.cuda.Stream, "from_external"):     # CuPy >= 14
            cs = cupy.cuda.Stream.from_external(ts)
        else:
            cs = cupy.cuda.ExternalStream(ts.cuda_stream, device.index)
        _STREAMS[key] = (cs, ts)      # ts kept alive with its wrapper
        return cs
    return cs[0]


def _contiguous_numpy_to_torch(torch, a):
    # The NumPy backend may hand back a (b, s, h, d) view of (b, h, s, d) memory; the fake
    # implementations promise contiguous results, so make them so (a copy only when needed).
    import numpy as np
    return torch.from_numpy(np.ascontiguousarray(a))


class TorchBackend(Backend):
    """torch.Tensor front end: CPU tensors on the NumPy backend, CUDA tensors on the CuPy kernels.

    Capabilities depend on where the tensors live: CPU takes float16/float32/float64
    (bfloat16 has no NumPy view), CUDA takes what the CuPy kernels take (float16/bfloat16,
    headdim a multiple of 8 up to 256). ``not_supported_reasons`` says which applies.
    """

    name = "torch"
    libraries = ("torch",)
    dtypes = FLOAT_DTYPES
    supports_kvcache = True

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

    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None):
        """Return ``(out, lse)`` as torch tensors on q's device; out contiguous, like q."""
        import torch
        if q.device.type == "cpu":
            nb = get_backend("numpy")
            out, lse = nb.forward(_on_library(spec, "numpy"),
                                  *(_np(x) for x in (q, k, v)),
                                  alibi_slopes=_np(alibi_slopes), cu_seqlens_q=_np(cu_seqlens_q),
                                  cu_seqlens_k=_np(cu_seqlens_k))
            return _contiguous_numpy_to_torch(torch, out), _contiguous_numpy_to_torch(torch, lse)
        import cupy
        cb = get_backend("cupy")
        lse_shape = (spec.nheads, spec.total_q) if spec.varlen else \
            (spec.batch, spec.nheads, spec.seqlen_q)
        with cupy.cuda.Device(q.device.index), _cupy_stream(torch, q.device):
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            cb.forward(_on_library(spec, "cupy"), *(_cp(x) for x in (q, k, v)),
                       alibi_slopes=_cp(alibi_slopes), cu_seqlens_q=_cp(cu_seqlens_q),
                       cu_seqlens_k=_cp(cu_seqlens_k), out=_cp(out), lse=_cp(lse))
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None):
        """Return ``(dq, dk, dv)`` as contiguous torch tensors like q, k, v."""
        import torch
        if q.device.type == "cpu":
            nb = get_backend("numpy")
            grads = nb.backward(_on_library(spec, "numpy"),
                                *(_np(x) for x in (dout, q, k, v, out, lse)),
                                alibi_slopes=_np(alibi_slopes), cu_seqlens_q=_np(cu_seqlens_q),
                                cu_seqlens_k=_np(cu_seqlens_k))
            # In the inputs' layout, like the CUDA path and the fake implementation.
            return tuple(torch.empty_like(x).copy_(torch.from_numpy(g))
                         for x, g in zip((q, k, v), grads))
        import cupy
        cb = get_backend("cupy")
        with cupy.cuda.Device(q.device.index), _cupy_stream(torch, q.device):
            # Gradients in the inputs' own layout (empty_like keeps a dense view's strides), so
            # autograd can hand them to .grad without a copy.
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
            cb.backward(_on_library(spec, "cupy"),
                        *(_cp(x) for x in (dout, q, k, v, out, lse)),
                        alibi_slopes=_cp(alibi_slopes), cu_seqlens_q=_cp(cu_seqlens_q),
                        cu_seqlens_k=_cp(cu_seqlens_k), dq=_cp(dq), dk=_cp(dk), dv=_cp(dv))
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
                        block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None):
        """Return ``(out, lse)`` as torch tensors (not requiring grad); the cache tensors are
        written in place through zero-copy views (NumPy on CPU, CuPy/DLPack on CUDA), and
        their autograd version counters are bumped."""
        import torch
        conv = _np if q.device.type == "cpu" else _cp
        as_int = spec.cache_seqlens_int is not None
        with torch.no_grad():
            if q.device.type == "cpu":
                out, lse = get_backend("numpy").forward_kvcache(
                    _kv_library(spec, "numpy"), *(conv(x) for x in (q, k_cache, v_cache, k, v)),
                    cache_seqlens=cache_seqlens if as_int else conv(cache_seqlens),
                    block_table=conv(block_table), rotary_cos=conv(rotary_cos),
                    rotary_sin=conv(rotary_sin), alibi_slopes=conv(alibi_slopes))
                out = _contiguous_numpy_to_torch(torch, out)
                lse = _contiguous_numpy_to_torch(torch, lse)
            else:
                import cupy
                a = spec.attn
                with cupy.cuda.Device(q.device.index), _cupy_stream(torch, q.device):
                    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                    lse = torch.empty((a.batch, a.nheads, a.seqlen_q), dtype=torch.float32,
                                      device=q.device)
                    get_backend("cupy").forward_kvcache(
                        _kv_library(spec, "cupy"), *(conv(x) for x in (q, k_cache, v_cache, k, v)),
                        cache_seqlens=cache_seqlens if as_int else conv(cache_seqlens),
                        block_table=conv(block_table), rotary_cos=conv(rotary_cos),
                        rotary_sin=conv(rotary_sin), alibi_slopes=conv(alibi_slopes),
                        out=conv(out), lse=conv(lse))
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
            why = _cupy_bf16_reason()
            reasons = [why] if why else []
        return [f"CUDA tensors run on the CuPy kernels, which cannot take this call: {x}"
                for x in reasons]
    return [f"tensors on {attn.device} are not supported (CPU and CUDA only)"]


@functools.lru_cache(maxsize=1024)
def _on_library(spec: AttentionSpec, library: str) -> AttentionSpec:
    """``spec`` for the backend torch delegates to (specs are frozen and hashable)."""
    return dataclasses.replace(spec, library=library)


# CuPy views of CUDA tensors, by (pointer, shape, strides, dtype, device). A view holds no
# reference to the tensor (UnownedMemory without an owner), so the memo never keeps memory
# alive; it is only ever used for a tensor that has exactly that pointer and layout, i.e. the
# very same bytes, which the caller holds for the duration of the call.
_VIEWS: dict = {}
_VIEWS_MAX = 1024
_NP_DTYPES: dict = {}


def _np_dtype(torch, dt):
    if not _NP_DTYPES:
        import numpy as np
        _NP_DTYPES.update({torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                           torch.float64: np.dtype(np.float64), torch.int32: np.dtype(np.int32),
                           torch.int64: np.dtype(np.int64)})
        try:
            import ml_dtypes
            _NP_DTYPES[torch.bfloat16] = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            pass
    return _NP_DTYPES.get(dt)


def _cp(t):
    """A CuPy view of a CUDA tensor's memory (no copy), or None.

    Built from the tensor's pointer, shape and strides (memoised, see ``_VIEWS``): a DLPack
    exchange costs several microseconds per tensor and per call, which flashcore's per-call
    budget cannot afford. Tensors with no elements or an unusual dtype go through DLPack
    (``torch.utils.dlpack.to_dlpack``, not ``Tensor.__dlpack__``, whose stream negotiation cost
    ~80 us per tensor on the H200 with torch 2.11).
    """
    if t is None:
        return None
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device.index)
    a = _VIEWS.get(key)
    if a is not None:
        return a
    import cupy
    import torch
    dt = _np_dtype(torch, t.dtype)
    n = t.numel()
    if dt is None or n == 0 or any(st < 0 for st in t.stride()):
        from torch.utils.dlpack import to_dlpack
        return cupy.from_dlpack(to_dlpack(t.detach()))
    isz = dt.itemsize
    extent = (1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride()))) * isz
    mem = cupy.cuda.UnownedMemory(key[0], extent, None, key[4])
    a = cupy.ndarray(tuple(t.shape), dt, cupy.cuda.MemoryPointer(mem, 0),
                     tuple(st * isz for st in t.stride()))
    if len(_VIEWS) >= _VIEWS_MAX:
        _VIEWS.clear()
    _VIEWS[key] = a
    return a


_BACKEND = register(TorchBackend())


# --------------------------------------------------------------------------------------------
# Layer 2: torch.library custom ops with fake implementations
# --------------------------------------------------------------------------------------------

# The call's options cross the op boundary as plain scalars (a schema cannot take a spec);
# the window is already folded with `causal` by flashcore.spec, -1 meaning unbounded.
_OPTIONS = ("int max_seqlen_q, int max_seqlen_k, bool causal, float softmax_scale, "
            "int window_left, int window_right, float softcap, bool deterministic")
_FWD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, Tensor? cu_seqlens_q, "
               f"Tensor? cu_seqlens_k, {_OPTIONS}) -> (Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               "Tensor? alibi_slopes, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
               f"{_OPTIONS}) -> (Tensor, Tensor, Tensor)")


def _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
             softmax_scale, window_left, window_right, softcap, deterministic) -> AttentionSpec:
    """The spec of an op call, from arguments flashcore.spec validated before the op ran."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch, sq, sk = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        total_q, total_k = q.shape[0], k.shape[0]
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        total_q = total_k = None
    alibi = None if alibi_slopes is None else \
        ("per_head" if alibi_slopes.ndim == 1 else "per_batch_head")
    return AttentionSpec(
        library="torch", device=device_of(q), dtype=dtype_name(q), batch=batch, seqlen_q=sq,
        seqlen_k=sk, nheads=q.shape[-2], nheads_k=k.shape[-2], headdim=q.shape[-1],
        causal=causal, window_left=window_left, window_right=window_right,
        softmax_scale=softmax_scale, softcap=softcap, alibi=alibi,
        deterministic=deterministic, varlen=varlen, total_q=total_q, total_k=total_k)


_OPS: list = []   # [torch.ops.flashcore], filled by torch_ops() on first use


def torch_ops():
    """``torch.ops.flashcore`` with ``fwd`` and ``bwd`` defined (imports torch on first use)."""
    if not _OPS:
        import torch
        if torch.compiler.is_compiling():
            # Defining an op is not traceable. The ops are defined when flashcore is imported
            # after torch, or at the first eager call; here neither happened.
            raise RuntimeError(
                "flashcore: the torch custom ops are not defined yet and cannot be defined while "
                "torch.compile traces; import torch before flashcore, or call "
                "flashcore.backends.torch_backend.torch_ops() once before compiling")
        _OPS.append(_define_ops())
    return _OPS[0]


def _define_ops():
    import torch

    @torch.library.custom_op("flashcore::fwd", mutates_args=(), schema=_FWD_SCHEMA)
    def fwd(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, softmax_scale, window_left, window_right, softcap, deterministic):
        spec = _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, window_left, window_right, softcap, deterministic)
        return _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)

    @fwd.register_fake
    def _fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, *_):
        lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else \
            (q.shape[0], q.shape[2], q.shape[1])
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=lse_dtype)

    @torch.library.custom_op("flashcore::bwd", mutates_args=(), schema=_BWD_SCHEMA)
    def bwd(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
            deterministic):
        spec = _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, window_left, window_right, softcap, deterministic)
        return _BACKEND.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi_slopes,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)

    @bwd.register_fake
    def _bwd_fake(dout, q, k, v, *_):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    # -- Layer 3: autograd ------------------------------------------------------------------

    def fwd_setup_context(ctx, inputs, output):
        q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *options = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
        ctx.options = options
        ctx.mark_non_differentiable(lse)

    def fwd_backward(ctx, dout, _dlse):
        q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        # The kernels need a contiguous last dimension; the incoming gradient can be anything
        # (an expanded scalar from .sum() has stride 0 everywhere).
        if dout.shape[-1] > 1 and dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.ops.flashcore.bwd(dout, q, k, v, out, lse, alibi_slopes,
                                             cu_seqlens_q, cu_seqlens_k, *ctx.options)
        return (dq, dk, dv) + (None,) * (3 + len(ctx.options))

    torch.library.register_autograd("flashcore::fwd", fwd_backward,
                                    setup_context=fwd_setup_context)

    def bwd_setup_context(ctx, inputs, output):
        pass

    def bwd_backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)

    torch.library.register_autograd("flashcore::bwd", bwd_backward,
                                    setup_context=bwd_setup_context)
    return torch.ops.flashcore


# --------------------------------------------------------------------------------------------
# The entry point used by flashcore.attention / flashcore.varlen_attention on torch tensors
# --------------------------------------------------------------------------------------------

def autograd_attention(q, k, v, *, backend=None, varlen=False, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None):
    """Differentiable attention on torch tensors. Returns ``(out, lse)``; lse has no gradient.

    The arguments are validated (flashcore.spec) and a backend chosen before any op runs;
    under ``torch.compile`` the same Python runs at trace time on fake tensors.
    """
    import torch
    fk = None
    needs_grad = _needs_grad(torch, q, k, v)
    if _FAST["enabled"] and not varlen and not torch.compiler.is_compiling() and q.is_cuda:
        fk = _fast_key(torch, q, k, v, alibi_slopes, backend, causal, softmax_scale, window_size,
                       softcap, deterministic, needs_grad)
        if fk is not None:
            e = plans.derived_get(fk)
            if e is not None:          # this layout and these options ran in full before
                nid = e.native
                if nid is None:
                    nid = _native_id(fk, e)
                if nid >= 0 and _FAST["native"]:
                    # the C++ node: the same launches, with no Python in the step (slopes get
                    # no gradient: detached, so that they alone do not make out require grad)
                    if alibi_slopes is not None and alibi_slopes.requires_grad:
                        alibi_slopes = alibi_slopes.detach()
                    return _NATIVE_OP[0](q, k, v, alibi_slopes, nid)
                if fk[1]:
                    box = []
                    out = _eager_function().apply(q, k, v, alibi_slopes, None, None, e.spec,
                                                  (fk, e), box)
                    return out, box[0]
                r = _fast_forward(torch, e, q, k, v, alibi_slopes)
                if r is not None:
                    return r
    spec = forward_spec(q, k, v, varlen=varlen, causal=causal, softmax_scale=softmax_scale,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k)
    if not torch.compiler.is_compiling():
        # Eager: every backend's reasons before any op runs, then the autograd Function straight
        # away (the custom op's dispatch costs tens of microseconds a call). Under torch.compile
        # the probe (CuPy import checks, device queries) is not traceable: the shapes, dtypes
        # and options were still validated above, and the custom op carries the call.
        choose(spec, backend, backward=needs_grad)
        torch_ops()   # defined once, so that a later torch.compile of this code can use them
        if not needs_grad:    # inference: no autograd node to build (saves its overhead)
            if fk is not None:
                return _forward_recording(torch, fk, spec, q, k, v, alibi_slopes)
            return _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes,
                                    cu_seqlens_q=cu_seqlens_q if varlen else None,
                                    cu_seqlens_k=cu_seqlens_k if varlen else None)
        box = []
        out = _eager_function().apply(q, k, v, alibi_slopes, cu_seqlens_q if varlen else None,
                                      cu_seqlens_k if varlen else None, spec, (fk, None), box)
        return out, box[0]
    return torch_ops().fwd(q, k, v, alibi_slopes, cu_seqlens_q if varlen else None,
                           cu_seqlens_k if varlen else None,
                           spec.seqlen_q if varlen else 0, spec.seqlen_k if varlen else 0,
                           spec.causal, spec.softmax_scale, spec.window_left, spec.window_right,
                           spec.softcap, spec.deterministic)


# --------------------------------------------------------------------------------------------
# The eager fast path for CUDA tensors
# --------------------------------------------------------------------------------------------
# A training or inference loop repeats the same calls with the same layouts. The first call of
# a layout (and of the options) runs in full: validation (flashcore.spec), the backend choice,
# CuPy views, the launchers, which record a launch plan (flashcore/kernels/plans.py) when they
# made no copies. That call is then recorded here too, under a key made from the torch tensors
# themselves: later calls with that key allocate the outputs with torch.empty, fill the
# pointers into the recorded struct and launch the recorded kernels on torch's current stream
# (cuLaunchKernel straight from a persistent parameter buffer, see plans.Direct), with none of
# the spec, the CuPy views, the CuPy stream or the launcher's Python in between.
#
# The key holds everything the full call depends on: for q, k, v (and alibi_slopes) the
# address modulo 16, shape, strides, dtype and device; the options with their types; the
# backend argument; whether the call builds an autograd node. A key is only ever recorded after
# a full call with that key succeeded, so bad input always takes the full path and gets its
# error. Not taken: varlen calls, under torch.compile (the custom ops carry the call there),
# tensor subclasses, options of other types. The entries live in plans.PLANS, so whatever drops
# the launch plans (plans.set_enabled(False), tile overrides, kernel reloads) drops them too.
# set_fast_path(False) turns the path off; set_fast_path(direct=False) keeps it but launches
# through the recorded plan (CuPy's RawKernel, under CuPy's view of torch's stream) instead.

_FAST = {"enabled": os.environ.get("FLASHCORE_TORCH_FAST", "1") != "0", "direct": True,
         "native": True}
# (cuda/torch_native.cpp passes the pointers in these orders: tests/test_torch_native.py checks)
_FWD_NAMES = ("q", "k", "v", "o", "lse", "alibi_slopes")
_BWD_NAMES = ("q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "alibi_slopes")
_SCALARS = (bool, int, float, type(None))


def set_fast_path(enabled: bool | None = None, direct: bool | None = None,
                  native: bool | None = None) -> None:
    """Turn the torch eager fast path on or off (``enabled``; the environment variable
    FLASHCORE_TORCH_FAST=0 turns it off at import), its direct driver launches (``direct``;
    off, the recorded plans launch through CuPy's RawKernel), and its native C++ autograd node
    (``native``; off, the Python autograd Function replays the records; see
    :mod:`flashcore.backends.torch_native`). Recorded entries are dropped."""
    if enabled is not None:
        _FAST["enabled"] = bool(enabled)
    if direct is not None:
        _FAST["direct"] = bool(direct)
    if native is not None:
        _FAST["native"] = bool(native)
    plans.drop([key for key in plans.PLANS if type(key) is tuple and key
                and key[0] in ("torch-fwd", "torch-bwd")])


def fast_path_enabled() -> bool:
    return _FAST["enabled"]


def _tl(t):
    return (t.data_ptr() % 16, t.shape, t.stride(), t.dtype, t.get_device())


def _needs_grad(torch, q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _fast_key(torch, q, k, v, alibi_slopes, backend, causal, softmax_scale, window_size, softcap,
              deterministic, needs_grad=None):
    """The fast path's key of an eager call on plain tensors, or None (not eligible); the
    caller checks that they are CUDA tensors and that torch is not compiling.
    ``needs_grad``: the caller's _needs_grad (computed here when not given)."""
    T = torch.Tensor
    if type(q) is not T or type(k) is not T or type(v) is not T:
        return None
    if alibi_slopes is not None and type(alibi_slopes) is not T:
        return None
    tw = type(window_size)
    if tw is not tuple and tw is not list:
        return None
    ws = tuple(window_size)
    scalars = (causal, softmax_scale, softcap, deterministic) + ws
    for x in scalars:
        if type(x) not in _SCALARS:
            return None
    if backend is not None and type(backend) is not str:
        return None
    if needs_grad is None:
        needs_grad = _needs_grad(torch, q, k, v)
    try:
        return ("torch-fwd", needs_grad, backend, scalars, tuple(type(x) for x in scalars), tw,
                _tl(q), _tl(k), _tl(v), None if alibi_slopes is None else _tl(alibi_slopes))
    except Exception:        # a tensor without storage or strides: not for this path
        return None


def _fast_bwd_key(torch, fk, dout, q, k, v, out, lse):
    """The backward's fast key: the forward's (options, alibi_slopes) and the layouts of the
    incoming gradient and of the saved tensors as autograd hands them back (saved-tensor hooks,
    e.g. torch.autograd.graph.save_on_cpu, may return them in another layout than the
    forward's)."""
    if torch.compiler.is_compiling() or type(dout) is not torch.Tensor:
        return None
    try:
        return ("torch-bwd", fk, _tl(dout), _tl(q), _tl(k), _tl(v), _tl(out), _tl(lse))
    except Exception:
        return None


class _Entry:
    """What the fast path needs of one recorded full call."""

    __slots__ = ("spec", "plan", "names", "slots", "scratch", "direct", "index", "device",
                 "ctx", "lse_shape", "out_mods", "scratch_offsets", "scratch_floats",
                 "scratch_zero", "out_like_q", "native")

    def __init__(self, torch, spec, plan, names, index, lse_shape, out_mods):
        self.spec = spec
        self.plan = plan
        self.names = names
        s = plans.slots()
        self.slots = tuple(s[n] for n in names) + tuple(s[f] for f, _, _ in plan.scratch)
        self.scratch = tuple((shape, zero) for _, shape, zero in plan.scratch)
        # the scratch buffers as byte offsets into one float32 allocation, each 256-byte aligned
        # (what the allocator gives a buffer of its own)
        offs, floats = [], 0
        for shape, _ in self.scratch:
            offs.append(4 * floats)
            n = 1
            for x in shape:
                n *= int(x)
            floats += -(-n // 64) * 64
        self.scratch_offsets = tuple(offs)
        self.scratch_floats = max(floats, 1)
        self.scratch_zero = any(zero for _, zero in self.scratch)
        self.index = index
        self.device = torch.device("cuda", index)
        self.lse_shape = lse_shape
        self.out_mods = out_mods
        self.out_like_q = False     # set by the forward's recording (q contiguous)
        self.direct = None
        self.ctx = None
        self.native = None          # its native record's id (see _native_id); None: not yet
        try:
            import cupy
            with cupy.cuda.Device(index):
                self.ctx = int(cupy.cuda.driver.ctxGetCurrent())
            if self.ctx:       # (no current context: leave launching to CuPy)
                self.direct = plans.Direct(plan)
        except Exception:    # no CUfunction to be had: the plan's RawKernel path serves
            self.direct = None


_RAW_STREAM: list = []


def _raw_stream(torch, index):
    """torch's current stream on device ``index``, as the raw ``cudaStream_t``."""
    if not _RAW_STREAM:
        f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if f is None:
            def f(i):
                return torch.cuda.current_stream(i).cuda_stream
        _RAW_STREAM.append(f)
    return _RAW_STREAM[0](index)


def _run_entry(torch, e, addrs):
    """Launch entry ``e`` with ``addrs`` (addresses in ``e.names`` order) on torch's current
    stream. Returns the scratch it allocated (the caller drops it after the launches are
    queued: torch's allocator, like CuPy's, reuses memory in stream order)."""
    import cupy
    if e.direct is not None and _FAST["direct"]:
        keep = []
        if e.scratch:
            # one allocation for all of the plan's scratch (zero-filled when any part must be):
            # one allocator call and at most one fill instead of one of each per buffer
            buf = (torch.zeros if e.scratch_zero else torch.empty)(
                (e.scratch_floats,), dtype=torch.float32, device=e.device)
            keep.append(buf)
            base = buf.data_ptr()
            addrs = list(addrs)
            addrs.extend(base + off for off in e.scratch_offsets)
        drv = cupy.cuda.driver
        stream = _raw_stream(torch, e.index)
        if drv.ctxGetCurrent() == e.ctx:
            e.direct.run(zip(e.slots, addrs), stream, drv.launchKernel)
        else:
            with cupy.cuda.Device(e.index):
                e.direct.run(zip(e.slots, addrs), stream, drv.launchKernel)
        return keep
    with cupy.cuda.Device(e.index), _cupy_stream(torch, e.device):
        return e.plan.run(dict(zip(e.names, addrs)))


def _fast_forward(torch, e, q, k, v, alibi_slopes):
    """``(out, lse)`` by entry ``e``, or None (fresh outputs of another alignment: the caller
    takes the full path)."""
    # (empty_like: the cheapest allocation call; q's strides are the key's, so the entry knows
    # whether it gives the contiguous out that the recorded call had)
    out = torch.empty_like(q) if e.out_like_q else torch.empty(q.shape, dtype=q.dtype,
                                                                device=e.device)
    lse = torch.empty(e.lse_shape, dtype=torch.float32, device=e.device)
    po, pl = out.data_ptr(), lse.data_ptr()
    if (po % 16, pl % 16) != e.out_mods:
        return None
    _run_entry(torch, e, (q.data_ptr(), k.data_ptr(), v.data_ptr(), po, pl,
                          0 if alibi_slopes is None else alibi_slopes.data_ptr()))
    return out, lse


def _forward_recording(torch, fk, spec, q, k, v, alibi_slopes):
    """The full forward; when it amounted to one launch plan, record the fast entry of ``fk``."""
    with plans.capture() as seen:
        out, lse = _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes)
    if len(seen) == 1 and out.is_cuda:
        e = _Entry(torch, spec, seen[0], _FWD_NAMES, q.get_device(), tuple(lse.shape),
                   (out.data_ptr() % 16, lse.data_ptr() % 16))
        e.out_like_q = q.is_contiguous()
        plans.derived_put(fk, e)
    return out, lse


_NATIVE_OP: list = []       # [torch.ops.flashcore_native.attention.default] once loaded
_NATIVE_FWD: dict = {}      # native forward id -> (spec, fast key), for its backward misses


def _native_id(key, e) -> int:
    """The native record id of fast entry ``e`` (recorded under ``key``), attaching it when the
    native library is loaded; -1 when there is none (not built yet: asked again next call)."""
    from . import torch_native
    if not (_FAST["native"] and _FAST["direct"]):
        e.native = -1           # (turning it back on drops the entries: see set_fast_path)
        return -1
    ops = torch_native.ops()
    if ops is None:
        if torch_native.status()["status"] != "building":
            e.native = -1       # off or failed: do not ask again for this entry
        return -1
    if not _NATIVE_OP:
        torch_native.set_misses(_native_fwd_miss, _native_bwd_miss)
        _NATIVE_OP.append(ops.attention.default)
    forward = key[0] == "torch-fwd"
    nid = torch_native.attach(key, e, len(_FWD_NAMES if forward else _BWD_NAMES))
    e.native = nid
    if nid >= 0 and forward:
        _NATIVE_FWD[nid] = (e.spec, key)
    return nid


def _native_bwd_miss(dout, q, k, v, out, lse, alibi_slopes, nid):
    """The native node's backward when it has no current record for this gradient's layout
    (or under create_graph): the Python backward, recording and attaching a new record."""
    import torch
    spec, fk = _NATIVE_FWD[nid]
    grads, (bk, e) = _backward_replayed(torch, spec, fk, dout, q, k, v, out, lse, alibi_slopes)
    if torch.is_grad_enabled():        # create_graph=True: refuse when differentiated
        return _eager_function().no_second_derivative.apply(dout, q, k, v, *grads)
    if e is not None:
        bid = e.native if e.native is not None else _native_id(bk, e)
        if bid >= 0:
            from . import torch_native
            torch_native.ops().set_backward(nid, bid, [dout, q, k, v, out, lse, alibi_slopes])
    return grads


def _native_fwd_miss(q, k, v, alibi_slopes, nid):
    """The native node's forward when its record went stale after the caller looked it up
    (another thread dropped the plans): the full forward."""
    return _BACKEND.forward(_NATIVE_FWD[nid][0], q, k, v, alibi_slopes=alibi_slopes)


def _backward_replayed(torch, spec, fk, dout, q, k, v, out, lse, alibi_slopes,
                       cu_seqlens_q=None, cu_seqlens_k=None):
    """The backward of a forward made under fast key ``fk`` (None: not eligible): replayed
    from its fast entry when one was recorded for these layouts, else in full, recording one.
    Returns ``((dq, dk, dv), (backward key, its entry))``, the pair (None, None) when the call
    is not eligible."""
    bk = _fast_bwd_key(torch, fk, dout, q, k, v, out, lse) \
        if fk is not None and _FAST["enabled"] else None
    if bk is None:
        return _BACKEND.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi_slopes,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k), \
            (None, None)
    e = plans.derived_get(bk)
    grads = None if e is None else _fast_backward(torch, e, dout, q, k, v, out, lse,
                                                  alibi_slopes)
    if grads is None:
        grads = _backward_recording(torch, bk, spec, dout, q, k, v, out, lse, alibi_slopes)
        e = plans.derived_get(bk)
    return grads, (bk, e)


def _fast_backward(torch, e, dout, q, k, v, out, lse, alibi_slopes):
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    pq, pk, pv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    if (pq % 16, pk % 16, pv % 16) != e.out_mods:
        return None
    _run_entry(torch, e, (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                          lse.data_ptr(), dout.data_ptr(), pq, pk, pv,
                          0 if alibi_slopes is None else alibi_slopes.data_ptr()))
    return dq, dk, dv


def _backward_recording(torch, bk, spec, dout, q, k, v, out, lse, alibi_slopes):
    with plans.capture() as seen:
        dq, dk, dv = _BACKEND.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi_slopes)
    if len(seen) == 1 and dq.is_cuda:
        plans.derived_put(bk, _Entry(torch, spec, seen[0], _BWD_NAMES, q.get_device(), None,
                                     (dq.data_ptr() % 16, dk.data_ptr() % 16,
                                      dv.data_ptr() % 16)))
    return dq, dk, dv


_EAGER: list = []


def _eager_function():
    """The eager-mode autograd Function (same backend calls as the custom ops)."""
    if _EAGER:
        return _EAGER[0]
    import torch

    class FlashAttentionFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, spec, fast, box):
            # fast: (key, entry) of the torch fast path (see _fast_key): entry set, the launches
            # recorded for this key replay; key only, the full call records them.
            # box: a list that receives lse. lse is no output of the node: it has no gradient,
            # and a second (non-differentiable) output costs the node microseconds per call.
            fk, e = fast
            r = None
            if e is not None:
                r = _fast_forward(torch, e, q, k, v, alibi_slopes)
            if r is None:
                if fk is not None:
                    r = _forward_recording(torch, fk, spec, q, k, v, alibi_slopes)
                else:
                    r = _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
            out, lse = r
            box.append(lse)
            if cu_seqlens_q is None and alibi_slopes is None:    # (fewer saved: cheaper node)
                ctx.save_for_backward(q, k, v, out, lse)
            else:
                ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
            ctx.spec = spec
            ctx.fast_key = fk
            return out

        @staticmethod
        def backward(ctx, dout):
            saved = ctx.saved_tensors
            if len(saved) == 5:
                q, k, v, out, lse = saved
                alibi_slopes = cu_seqlens_q = cu_seqlens_k = None
            else:
                q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k = saved
            if dout.shape[-1] > 1 and dout.stride(-1) != 1:
                dout = dout.contiguous()
            (dq, dk, dv), _ = _backward_replayed(torch, ctx.spec, ctx.fast_key, dout, q, k, v,
                                                 out, lse, alibi_slopes, cu_seqlens_q,
                                                 cu_seqlens_k)
            if torch.is_grad_enabled():      # create_graph=True: refuse when differentiated
                dq, dk, dv = NoSecondDerivative.apply(dout, q, k, v, dq, dk, dv)
            return dq, dk, dv, None, None, None, None, None, None

    class NoSecondDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dout, q, k, v, *grads):
            # dout, q, k, v tie the gradients to the graph being built: they require grad
            # whenever the gradients could be differentiated (a constant dout included)
            return tuple(g.clone() for g in grads)

        @staticmethod
        def backward(ctx, *_):
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)

    FlashAttentionFunction.no_second_derivative = NoSecondDerivative
    _EAGER.append(FlashAttentionFunction)
    return FlashAttentionFunction


class _DefineOpsAfterTorchImport:
    """A one-shot import hook: when torch is imported after flashcore, define the custom ops
    right after torch finishes loading, so that a first flashcore call made inside a
    torch.compile trace finds them (defining an op cannot be traced)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_define(module):
            exec_module(module)
            try:
                torch_ops()
            except Exception:   # never break `import torch`; the eager path defines them later
                pass
        loader.exec_module = exec_then_define
        return spec


if "torch" in sys.modules:   # torch already loaded: define the ops now, outside any trace
    torch_ops()
elif importlib.util.find_spec("torch") is not None:
    sys.meta_path.insert(0, _DefineOpsAfterTorchImport())
