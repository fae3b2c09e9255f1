"""The torch backend: torch tensors in, torch tensors out, no copies on the way.

One route, the same eagerly and under ``torch.compile`` (flash-attn's shape):

1. :class:`TorchBackend` moves tensors to the backend that does the work and back, zero-copy:
   CPU tensors become NumPy views (``t.detach().numpy()``) for the NumPy backend; CUDA tensors
   become CuPy views for the CuPy kernels, which run on torch's current stream and device, with
   the outputs allocated by torch and every scratch buffer the launchers need (split-KV
   partials, dQ accumulators, copies) taken from torch's caching allocator: so a call can be
   captured in a CUDA graph (``torch.cuda.graph``) and replays bit for bit.
2. Three ``torch.library`` ops, ``flashcore::fwd``, ``flashcore::bwd`` and
   ``flashcore::kvcache`` (which writes the cache in place), with fake (shape-only)
   implementations: ``torch.compile(fullgraph=True)`` traces through flashcore without a
   graph break and ``torch.library.opcheck`` passes. One op serves padded and varlen calls:
   ``cu_seqlens_q`` present means varlen.
3. An autograd Function over the ops: the forward saves ``(q, k, v, out, lse)``, the backward
   calls ``flashcore::bwd``. ``lse`` is not differentiable; differentiating the backward
   (double backward) is refused.

:func:`autograd_attention` validates (flashcore.spec, memoised per layout) and applies the
Function, eagerly and under ``torch.compile`` alike (flash-attn's route). Nothing here imports torch at flashcore import time: the ops are defined when torch
is imported (an import hook, or at once if torch is already loaded) or at the first call.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import threading

from .._arrays import device_of, dtype_name, torch_compiling
from ..spec import FLOAT_DTYPES, AttentionSpec, forward_spec
from .base import Backend, choose, get_backend, register

__all__ = ["TorchBackend", "autograd_attention", "torch_ops"]

DOUBLE_BACKWARD_MESSAGE = (
    "flashcore: double backward is not supported (the attention backward is not itself "
    "differentiable); use torch.nn.functional.scaled_dot_product_attention's math backend "
    "for higher-order gradients")


# --------------------------------------------------------------------------------------------
# Layer 1: the backend (no autograd)
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _torch_unavailable_reason() -> str | None:
    return None if importlib.util.find_spec("torch") is not None else \
        "PyTorch is not installed (pip install 'flashcore[torch]')"


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
_ALLOCATORS: dict = {}


def _torch_allocator(torch, index):
    """A CuPy allocator (``size -> MemoryPointer``) drawing from torch's caching allocator on
    device ``index``: what the CuPy launchers allocate while they serve torch comes from the
    memory torch manages (stream-ordered, and the graph's private pool under
    ``torch.cuda.graph``). The tensor owns the memory and lives as long as CuPy's pointer."""
    alloc = _ALLOCATORS.get(index)
    if alloc is None:
        import cupy
        device = torch.device("cuda", index)

        def alloc(nbytes):
            t = torch.empty((max(int(nbytes), 1),), dtype=torch.uint8, device=device)
            return cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(t.data_ptr(), t.numel(), t, index), 0)
        _ALLOCATORS[index] = alloc
    return alloc


class _OnTorch:
    """``with _OnTorch(torch, index):`` the CuPy work of a call on torch's terms: device
    ``index``, torch's current stream, torch's allocator."""

    __slots__ = ("ctx",)

    def __init__(self, torch, index):
        import cupy
        self.ctx = (cupy.cuda.Device(index), _cupy_stream(torch, torch.device("cuda", index)),
                    cupy.cuda.using_allocator(_torch_allocator(torch, index)))

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()
        return self

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)
        return False


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
        cb = get_backend("cupy")
        lse_shape = (spec.nheads, spec.total_q) if spec.varlen else \
            (spec.batch, spec.nheads, spec.seqlen_q)
        with _OnTorch(torch, q.device.index):
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
        cb = get_backend("cupy")
        with _OnTorch(torch, q.device.index):
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
                a = spec.attn
                with _OnTorch(torch, q.device.index):
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


@functools.lru_cache(maxsize=1024)
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


_KV_SCHEMA = ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
              "Tensor? cache_seqlens, int cache_seqlens_int, Tensor? block_table, "
              "Tensor? rotary_cos, Tensor? rotary_sin, bool rotary_interleaved, bool causal, "
              "float softmax_scale, int window_left, int window_right, float softcap, "
              "Tensor? alibi_slopes, int num_splits) -> (Tensor, Tensor)")


def _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
             softmax_scale, window_left, window_right, softcap, deterministic) -> AttentionSpec:
    """The spec of an op call, from arguments flashcore.spec validated before the op ran."""
    varlen = cu_seqlens_q is not None
    return _op_spec_of(
        device_of(q), dtype_name(q), tuple(q.shape), tuple(k.shape),
        None if alibi_slopes is None else alibi_slopes.ndim,
        cu_seqlens_q.shape[0] - 1 if varlen else None, max_seqlen_q, max_seqlen_k, causal,
        softmax_scale, window_left, window_right, softcap, deterministic)


@functools.lru_cache(maxsize=1024)
def _op_spec_of(device, dtype, q_shape, k_shape, alibi_ndim, varlen_batch, max_seqlen_q,
                max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
                deterministic) -> AttentionSpec:
    varlen = varlen_batch is not None
    if varlen:
        batch, sq, sk = varlen_batch, max_seqlen_q, max_seqlen_k
        total_q, total_k = q_shape[0], k_shape[0]
    else:
        batch, sq, sk = q_shape[0], q_shape[1], k_shape[1]
        total_q = total_k = None
    alibi = None if alibi_ndim is None else ("per_head" if alibi_ndim == 1 else "per_batch_head")
    return AttentionSpec(
        library="torch", device=device, dtype=dtype, batch=batch, seqlen_q=sq,
        seqlen_k=sk, nheads=q_shape[-2], nheads_k=k_shape[-2], headdim=q_shape[-1],
        causal=causal, window_left=window_left, window_right=window_right,
        softmax_scale=softmax_scale, softcap=softcap, alibi=alibi,
        deterministic=deterministic, varlen=varlen, total_q=total_q, total_k=total_k)


_OPS: list = []   # [torch.ops.flashcore], filled by torch_ops() on first use
_OPS_LOCK = threading.Lock()


def torch_ops():
    """``torch.ops.flashcore`` with ``fwd`` and ``bwd`` defined (imports torch on first use)."""
    if _OPS:
        return _OPS[0]
    with _OPS_LOCK:      # (first calls from several threads at once define them once)
        if _OPS:
            return _OPS[0]
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


def _fwd_impl(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, softmax_scale, window_left, window_right, softcap, deterministic):
    spec = _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, window_left, window_right, softcap, deterministic)
    return _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _bwd_impl(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
              deterministic):
    spec = _op_spec(q, k, alibi_slopes, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, window_left, window_right, softcap, deterministic)
    return _BACKEND.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi_slopes,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table,
                  rotary_cos, rotary_sin, rotary_interleaved, causal, softmax_scale, window_left,
                  window_right, softcap, alibi_slopes, num_splits):
    from ..spec import kvcache_spec
    lens = cache_seqlens_int if cache_seqlens is None else cache_seqlens
    spec = kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=block_table,
                        rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                        rotary_interleaved=rotary_interleaved, causal=causal,
                        softmax_scale=softmax_scale, window_size=(window_left, window_right),
                        softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits)
    return _BACKEND.forward_kvcache(spec, q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                    block_table=block_table, rotary_cos=rotary_cos,
                                    rotary_sin=rotary_sin, alibi_slopes=alibi_slopes)


_LIBRARY: list = []     # the torch.library.Library that owns the ops (kept alive)


def _define_ops():
    """The three ops, defined with torch.library's low-level API: a Python kernel reached
    through the dispatcher costs ~5 us a call on the H200 host, against ~20 us for a
    ``torch.library.custom_op`` (whose wrapper adds checks and a dynamo guard per call)."""
    import torch
    lib = torch.library.Library("flashcore", "DEF")
    for name, schema, impl in (("fwd", _FWD_SCHEMA, _fwd_impl), ("bwd", _BWD_SCHEMA, _bwd_impl),
                               ("kvcache", _KV_SCHEMA, _kvcache_impl)):
        lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key)

    def fwd_fake(q, k, v, alibi_slopes, cu_seqlens_q, *_):
        lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else \
            (q.shape[0], q.shape[2], q.shape[1])
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=lse_dtype)

    def bwd_fake(dout, q, k, v, *_):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def kvcache_fake(q, *_):
        return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                                 dtype=torch.float32)
    torch.library.register_fake("flashcore::fwd", fwd_fake, lib=lib)
    torch.library.register_fake("flashcore::bwd", bwd_fake, lib=lib)
    torch.library.register_fake("flashcore::kvcache", kvcache_fake, lib=lib)
    _LIBRARY.append(lib)
    ops = torch.ops.flashcore
    _FUNCTION.append(_attention_function(torch, ops))
    return ops


# -- Layer 3: autograd ------------------------------------------------------------------------

_FUNCTION: list = []


def _attention_function(torch, ops):
    """The autograd Function over the ops (flash-attn's layering: ops, Function, public
    function): the forward saves ``(q, k, v, out, lse)``; lse is not differentiable; the
    backward is not differentiable either (double backward is refused with a message)."""

    class FlashAttention(torch.autograd.Function):
        # Inputs arrive deduplicated (dynamo cannot trace a Function given one tensor twice,
        # and q is k is v, or cu_seqlens_q is cu_seqlens_k, are common): ``where`` gives, for
        # q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, the index of each in ``tensors``
        # (-1: None).
        @staticmethod
        def forward(ctx, where, options, *tensors):
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k = (
                None if i < 0 else tensors[i] for i in where)
            out, lse = ops.fwd.default(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                       *options)
            ctx.save_for_backward(out, lse, *tensors)
            ctx.where = where
            ctx.options = options
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            out, lse, *tensors = ctx.saved_tensors
            where = ctx.where
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k = (
                None if i < 0 else tensors[i] for i in where)
            # The kernels need a contiguous last dimension; the incoming gradient can be
            # anything (an expanded scalar from .sum() has stride 0 everywhere).
            if dout.shape[-1] > 1 and dout.stride(-1) != 1:
                dout = dout.contiguous()
            dq, dk, dv = ops.bwd.default(dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q,
                                         cu_seqlens_k, *ctx.options)
            if torch.is_grad_enabled():      # create_graph=True: refuse when differentiated
                dq, dk, dv = NoSecondDerivative.apply(dout, q, k, v, dq, dk, dv)
            grads = [None] * len(tensors)
            for i, g in zip(where[:3], (dq, dk, dv)):
                grads[i] = g if grads[i] is None else grads[i] + g
            return (None, None, *grads)

    class NoSecondDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dout, q, k, v, *grads):
            # dout, q, k, v tie the gradients to the graph being built: they require grad
            # whenever the gradients could be differentiated (a constant dout included)
            return tuple(g.clone() for g in grads)

        @staticmethod
        def backward(ctx, *_):
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)

    return FlashAttention


# --------------------------------------------------------------------------------------------
# The entry point used by flashcore.attention / flashcore.varlen_attention on torch tensors
# --------------------------------------------------------------------------------------------

def autograd_attention(q, k, v, *, backend=None, varlen=False, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None):
    """Differentiable attention on torch tensors. Returns ``(out, lse)``; lse has no gradient.

    The arguments are validated (flashcore.spec) and, eagerly, a backend chosen (every
    backend's reasons before any op runs); then the autograd Function runs the forward op.
    Under ``torch.compile`` the same Python runs at trace time on fake tensors: dynamo traces
    the Function, and the ops enter the graph.
    """
    spec = forward_spec(q, k, v, varlen=varlen, causal=causal, softmax_scale=softmax_scale,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                        max_seqlen_k=max_seqlen_k)
    if not torch_compiling(q):
        # (the capability probe, CuPy import checks and device queries, is not traceable; the
        # shapes, dtypes and options were validated above either way)
        choose(spec, backend, backward=_needs_grad(q, k, v))
    torch_ops()
    tensors, where = [], []
    for t in (q, k, v, alibi_slopes, cu_seqlens_q if varlen else None,
              cu_seqlens_k if varlen else None):
        if t is None:
            where.append(-1)
            continue
        for i, u in enumerate(tensors):
            if u is t:
                where.append(i)
                break
        else:
            where.append(len(tensors))
            tensors.append(t)
    return _FUNCTION[0].apply(tuple(where), _options(spec), *tensors)


def _options(spec) -> tuple:
    """The scalar arguments of the ops for ``spec`` (the window folded with causal)."""
    return (spec.seqlen_q if spec.varlen else 0, spec.seqlen_k if spec.varlen else 0,
            spec.causal, spec.softmax_scale, spec.window_left, spec.window_right, spec.softcap,
            spec.deterministic)


def kvcache_attention(q, k_cache, v_cache, k, v, spec, *, cache_seqlens, block_table,
                      rotary_cos, rotary_sin, alibi_slopes):
    """flashcore.attention_with_kvcache on torch tensors, through the ``flashcore::kvcache``
    op (validated into ``spec`` already): eagerly and under torch.compile alike."""
    import torch
    a = spec.attn
    as_int = spec.cache_seqlens_int is not None
    with torch.no_grad():        # inference only: the results never require grad
        return torch_ops().kvcache.default(
            q, k_cache, v_cache, k, v, None if as_int else cache_seqlens,
            spec.cache_seqlens_int if as_int else 0, block_table, rotary_cos, rotary_sin,
            spec.rotary_interleaved, a.causal, a.softmax_scale,
            # the causal window is folded in: the op takes the window flashcore.spec made
            a.window_left, a.window_right, a.softcap, alibi_slopes, spec.num_splits)


def _needs_grad(q, k, v) -> bool:
    import torch
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


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
