"""The torch route, flash-attn's, the same eagerly and under ``torch.compile``:

1. Three ``torch.library`` ops, ``flashcore::fwd``, ``flashcore::bwd`` and
   ``flashcore::kvcache`` (which writes the cache in place), with fake (shape-only)
   implementations: ``torch.compile(fullgraph=True)`` traces through flashcore without a
   graph break and ``torch.library.opcheck`` passes. One op serves padded and varlen calls:
   ``cu_seqlens_q`` present means varlen. Their kernels are the torch backend's
   (:mod:`flashcore.backends.torch_backend`).
2. An autograd Function over the ops: the forward saves ``(q, k, v, out, lse)``, the backward
   calls ``flashcore::bwd``. ``lse`` is not differentiable; differentiating the backward
   (double backward) is refused.
3. :func:`autograd_attention` (behind ``flashcore.attention``) validates (flashcore.spec,
   memoised per layout) and applies the Function; :func:`kvcache_attention` (behind
   ``flashcore.attention_with_kvcache``) calls the kvcache op.

Nothing here imports torch at flashcore import time: the ops are defined when torch is
imported (an import hook, or at once if torch is already loaded) or at the first call.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import threading

from .._arrays import device_of, dtype_name, torch_compiling
from ..spec import AttentionSpec, forward_spec
from .base import choose
from .torch_backend import _BACKEND

__all__ = ["autograd_attention", "kvcache_attention", "torch_ops", "DOUBLE_BACKWARD_MESSAGE"]

DOUBLE_BACKWARD_MESSAGE = (
    "flashcore: double backward is not supported (the attention backward is not itself "
    "differentiable); use torch.nn.functional.scaled_dot_product_attention's math backend "
    "for higher-order gradients")


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
                "flashcore.backends.torch_ops.torch_ops() once before compiling")
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
