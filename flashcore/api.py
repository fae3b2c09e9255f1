"""Public functions: validate -> choose a backend -> call it.

Conventions (flash-attn's; see docs/conventions):

* q ``(batch, seqlen_q, nheads, headdim)``, k and v ``(batch, seqlen_k, nheads_k, headdim)``;
  ``nheads % nheads_k == 0`` (MQA/GQA: query head i uses key head ``i // (nheads // nheads_k)``).
  Varlen: packed ``(total, nheads, headdim)`` with ``cu_seqlens`` int32 of length batch+1.
* ``softmax_scale`` defaults to ``1/sqrt(headdim)``.
* Causal masking is aligned to the bottom-right corner: query i sees key j iff
  ``j <= i + seqlen_k - seqlen_q``. With seqlen_q = 2, seqlen_k = 5 (``x`` = visible)::

      causal=True              window_size=(1, 0)
      k:  0 1 2 3 4            k:  0 1 2 3 4
      q0  x x x x .            q0  . . x x .
      q1  x x x x x            q1  . . . x x

  ``window_size=(left, right)``, -1 unbounded:
  ``i + sk - sq - left <= j <= i + sk - sq + right``.
* ``softcap`` c > 0 replaces a scaled score s by ``c·tanh(s/c)``; ALiBi adds
  ``-slope_h·|i + sk - sq - j|`` (slopes ``(nheads,)`` or ``(batch, nheads)``, float32).
* The forward returns ``out`` (like q, in q's dtype) and ``lse``: float32, natural log,
  ``(batch, nheads, seqlen_q)`` (varlen ``(nheads, total_q)``), of the final scores. A query row
  that sees no key gets ``out = 0`` and ``lse = -inf``, never NaN. (float64 inputs, on the
  NumPy backend and torch CPU tensors: lse is float64, a choice: the reference keeps full
  precision end to end.)
* Inputs are assumed finite. A NaN or Inf in k or v can reach rows that cannot see that key
  when both fall in one tile (a masked weight is 0, and 0 · NaN is NaN); a NaN in q reaches
  only its own row.
* The backward returns ``(dq, dk, dv)`` in the input dtypes; for GQA, dk/dv are summed over the
  query heads that share a key head.
"""
from __future__ import annotations

from . import config
from ._arrays import library_of
from .backends import torch_ops   # (imports no torch: the torch route, bound once)
from .backends.base import all_backends, choose, choose_kvcache, raise_oom
from .kernels import plans
from .reference import merge_states
from .spec import (FP8_DTYPES, _arg_error, _scalar_key, as_flag, backward_spec, check_outputs,
                   exact_descale, forward_spec, fp8_out_dtype, kvcache_spec, lse_shape,
                   merge_spec, out_fp32)

__all__ = [
    "attention", "attention_forward", "attention_backward",
    "varlen_attention", "varlen_attention_forward", "varlen_attention_backward",
    "attention_with_kvcache", "merge_attention_states", "available_backends", "draw_rng_state",
]


def _lse_shape(spec):
    return (spec.nheads, spec.total_q) if spec.varlen else (spec.batch, spec.nheads, spec.seqlen_q)


# CuPy calls replay the launch plan of their layout (flashcore.kernels.plans, keyed here on
# the arguments as given); torch calls do so inside their ops (flashcore.backends.torch_ops).

def _cupy_layout(a):
    if a is None:
        return None
    m = a.data
    return (a.shape, a.strides, a.dtype, m.ptr & 15, m.device_id)


def _cupy_key(kind, arrays, scalars):
    """The launch-plan key of a CuPy call, or None (not CuPy arrays throughout, an option that
    cannot be keyed exactly, debug mode: then the call runs in full)."""
    if not plans.enabled() or library_of(arrays[0]) != "cupy":
        return None
    cfg = config.get()
    if cfg.debug:
        return None
    try:
        key = (kind, cfg, *(_cupy_layout(a) for a in arrays), *(_scalar_key(x) for x in scalars))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def _cupy_replay(plan, pointers) -> bool:
    import cupy
    stream = cupy.cuda.get_current_stream().ptr

    def alloc(nbytes):
        m = cupy.cuda.alloc(nbytes)
        return m, m.ptr
    return plan.run(pointers, stream, alloc) is not None


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


_FWD_OPTIONS = ("causal", "softmax_scale", "window_size", "softcap", "deterministic",
                "max_seqlen_q", "max_seqlen_k", "dropout_p")


def _dropout_kw(dropout_p, rng_state, q=None) -> dict:
    """The dropout arguments of a call ({} without dropout, the common case: nothing added to
    the fast paths); with ``q`` (the autograd-style functions) a missing ``rng_state`` is drawn
    from the array library's generator."""
    if type(dropout_p) in (float, int) and dropout_p == 0 and rng_state is None:
        return {}
    if rng_state is None and q is not None and library_of(q) == "torch" \
            and type(dropout_p) in (float, int) and 0 < dropout_p < 1:
        rng_state = draw_rng_state(q)    # (autograd saves it for the backward)
    return {"dropout_p": dropout_p, "rng_state": rng_state}


def draw_rng_state(like):
    """A fresh dropout random state, an int64 array (seed, offset), for arrays like ``like``
    (of their library and device): drawn by torch's generator of the device (on the device: no
    sync, and a CUDA graph replays fresh draws), ``cupy.random`` or ``numpy.random``. Pass it
    as ``rng_state`` to the forward and the backward of one step."""
    lib = library_of(like)
    if lib == "torch":
        import torch
        return torch.empty(2, dtype=torch.int64, device=like.device).random_()
    if lib == "cupy":
        import cupy
        return cupy.random.randint(0, 2**63 - 1, size=2, dtype=cupy.int64)
    import numpy as np
    return np.random.randint(0, 2**63 - 1, size=2, dtype=np.int64)


def _descale_kw(q, k, v, q_descale, k_descale, v_descale, **call) -> dict:
    """The FP8 descales of a call ({} when none is given, the common case). With arrays other
    than NumPy's the call is validated here (``call``: its other arguments): the torch ops of
    16-bit calls take no descales, so a descale given with them is refused here, by name."""
    if q_descale is None and k_descale is None and v_descale is None:
        return {}
    d = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if library_of(q) != "numpy":
        forward_spec(q, k, v, **call, **d)
    return d


def _torch_fp8(q) -> bool:
    """Whether q is a float8_e4m3fn torch tensor (the FP8 forward: forward only, run through
    the torch backend directly, not the autograd ops)."""
    return library_of(q) == "torch" and str(q.dtype) == "torch.float8_e4m3fn"


def _no_grad_fp8(q, k, v) -> None:
    import torch
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)
                                       if isinstance(x, torch.Tensor)):
        raise _arg_error(TypeError, "q", "float8_e4m3fn tensors that do not require grad "
                         "(FP8 attention is forward only: no backward, as in FlashAttention-3)",
                         "a tensor that requires grad")


def _forward(q, k, v, backend, varlen, out=None, lse=None, out_dtype=None, **kw):
    if out is None and lse is None and library_of(q) == "torch" and not _torch_fp8(q):
        return torch_ops.forward(q, k, v, backend=backend, varlen=varlen, out_dtype=out_dtype,
                                 **kw)
    alibi, cu_q, cu_k = kw.get("alibi_slopes"), kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    bt, rng = kw.get("block_table"), kw.get("rng_state")
    key = _cupy_key("fwd", (q, k, v, out, lse, alibi, cu_q, cu_k, bt, rng),
                    (backend, varlen, out_dtype, *(kw.get(n) for n in _FWD_OPTIONS)))
    if key is not None:
        plan = plans.lookup(key)
        if plan is not None and plans.enter(plan):
            import cupy     # (the current device is the plan's: outputs are allocated there)
            try:
                o = cupy.empty(q.shape, plan.result if plan.result is not None else q.dtype) \
                    if out is None else out
                l_ = cupy.empty(lse_shape(q.shape, varlen), cupy.float32) if lse is None else lse
                ok = _cupy_replay(plan, (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr,
                                         l_.data.ptr, _ptr(alibi), _ptr(cu_q), _ptr(cu_k),
                                         _ptr(bt), _ptr(rng)))
            except Exception as e:
                raise_oom(e, "forward")
                raise
            if ok:
                return o, l_
    spec = forward_spec(q, k, v, varlen=varlen, **kw)
    if spec.dtype in FP8_DTYPES:
        return _forward_fp8(spec, q, k, v, backend, out, lse, out_dtype, kw)
    fp32 = out_fp32(out_dtype, spec.dtype)
    b = choose(spec, backend)
    given = {} if out is None and lse is None else check_outputs(
        spec, {"out": out, "lse": lse},
        {"out": (q.shape, "float32" if fp32 else spec.dtype), "lse": (_lse_shape(spec), "float32")},
        fp32_out=out_dtype is None)
    with plans.record() as rec:
        o, l_ = b.forward(spec, q, k, v, alibi_slopes=alibi, cu_seqlens_q=cu_q,
                          cu_seqlens_k=cu_k, block_table=bt, out_fp32=fp32,
                          rng_state=rng if spec.dropout_p else None, **given)
    if key is not None:
        plans.remember(key, rec.plan((("q", _ptr(q)), ("k", _ptr(k)), ("v", _ptr(v)),
                                      ("o", _ptr(o)), ("lse", _ptr(l_)),
                                      ("alibi_slopes", _ptr(alibi)), ("cu_seqlens_q", _ptr(cu_q)),
                                      ("cu_seqlens_k", _ptr(cu_k)), ("block_table", _ptr(bt)),
                                      ("dropout_rng", _ptr(rng))),
                                     q.device.id, result=o.dtype))
    return o, l_


def _forward_fp8(spec, q, k, v, backend, out, lse, out_dtype, kw):
    """A float8_e4m3fn forward (validated by ``spec``): output in bfloat16 unless ``out_dtype``
    says float16 or float32."""
    if out is not None or lse is not None:
        raise _arg_error(ValueError, "out" if out is not None else "lse", "None with "
                         "float8_e4m3fn inputs (the outputs are allocated by the call)", "an array")
    odt = fp8_out_dtype(out_dtype)
    b = choose(spec, backend)
    return b.forward(spec, q, k, v, alibi_slopes=kw.get("alibi_slopes"),
                     cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"),
                     block_table=kw.get("block_table"),
                     descales=tuple(kw.get(n) for n in ("q_descale", "k_descale", "v_descale")),
                     fp8_out=odt)


def _backward(dout, q, k, v, out, lse, backend, varlen, dq=None, dk=None, dv=None, **kw):
    if dq is None and dk is None and dv is None and library_of(q) == "torch":
        return torch_ops.backward(dout, q, k, v, out, lse, backend=backend, varlen=varlen, **kw)
    alibi, cu_q, cu_k = kw.get("alibi_slopes"), kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    rng = kw.get("rng_state")
    key = _cupy_key("bwd", (q, dout, k, v, out, lse, dq, dk, dv, alibi, cu_q, cu_k, rng),
                    (backend, varlen, *(kw.get(n) for n in _FWD_OPTIONS)))
    if key is not None:
        plan = plans.lookup(key)
        if plan is not None and plans.enter(plan):
            import cupy     # (the current device is the plan's: outputs are allocated there)
            try:
                gq = cupy.empty(q.shape, q.dtype) if dq is None else dq
                gk = cupy.empty(k.shape, k.dtype) if dk is None else dk
                gv = cupy.empty(v.shape, v.dtype) if dv is None else dv
                ok = _cupy_replay(plan, (dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr,
                                         out.data.ptr, lse.data.ptr, gq.data.ptr, gk.data.ptr,
                                         gv.data.ptr, _ptr(alibi), _ptr(cu_q), _ptr(cu_k),
                                         _ptr(rng)))
            except Exception as e:
                raise_oom(e, "backward")
                raise
            if ok:
                return gq, gk, gv
    spec = backward_spec(dout, q, k, v, out, lse, varlen=varlen, **kw)
    b = choose(spec, backend, backward=True)
    given = {} if dq is None and dk is None and dv is None else check_outputs(
        spec, {"dq": dq, "dk": dk, "dv": dv},
        {"dq": (q.shape, spec.dtype), "dk": (k.shape, spec.dtype), "dv": (v.shape, spec.dtype)})
    with plans.record() as rec:
        gq, gk, gv = b.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi,
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                rng_state=rng if spec.dropout_p else None, **given)
    if key is not None:
        plans.remember(key, rec.plan(
            (("dout", _ptr(dout)), ("q", _ptr(q)), ("k", _ptr(k)), ("v", _ptr(v)),
             ("o", _ptr(out)), ("lse", _ptr(lse)), ("dq", _ptr(gq)), ("dk", _ptr(gk)),
             ("dv", _ptr(gv)), ("alibi_slopes", _ptr(alibi)), ("cu_seqlens_q", _ptr(cu_q)),
             ("cu_seqlens_k", _ptr(cu_k)), ("dropout_rng", _ptr(rng))), q.device.id))
    return gq, gk, gv


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, deterministic=False, backend=None,
                      out=None, lse=None, out_dtype=None, dropout_p=0.0, rng_state=None,
                      q_descale=None, k_descale=None, v_descale=None):
    """Forward pass. Returns ``(out, lse)``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    out: like q; lse: float32 (batch, nheads, seqlen_q) (float64 for float64 inputs, see the
    module's conventions). ``backend`` names one of
    :func:`backends` (default: the first that takes these arrays). CuPy arrays: ``out`` and
    ``lse`` may be given, preallocated (written in place and returned), which is what a call
    captured in a CUDA graph (``cupy.cuda.Stream.begin_capture``) needs.
    ``out_dtype=float32`` (or a float32 ``out``) with 16-bit inputs: the output unrounded, in
    float32, for partial results merged through their lse (:func:`merge_attention_states`,
    ring attention), so that nothing is rounded to 16 bits before the merge.
    ``dropout_p`` > 0: attention dropout with the random state ``rng_state`` (an int64 array
    (seed, offset) of q's library and device; see :mod:`flashcore.dropout`); pass the same
    ``dropout_p`` and ``rng_state`` to :func:`attention_backward`.
    FP8 (FlashAttention-3's e4m3 forward; forward only): q, k, v float8_e4m3fn: NumPy arrays of
    ml_dtypes and torch CPU tensors (the NumPy reference), torch.float8_e4m3fn CUDA tensors and
    CuPy uint8 arrays holding the e4m3 bits (CuPy has no float8 dtype; ``x.view(cupy.uint8)``
    of another library's FP8 memory) on the Hopper kernel: compute capability 9.0, head dim
    128 or 256, dense calls (no varlen), no softcap or ALiBi. With
    ``q_descale``, ``k_descale``, ``v_descale`` float32 arrays broadcastable to
    ``(batch, nheads_k)`` (None: 1): the inputs' values are ``x * descale[b, key head]``. The
    output is bfloat16 (``out_dtype`` float16 or float32 on request), lse float32; the
    probabilities are rounded to e4m3 for the product with V, as the FP8 GEMM takes them
    (:func:`flashcore.reference.fp8_forward` is the computation).
    """
    return _forward(q, k, v, backend, False, out=out, lse=lse, out_dtype=out_dtype, causal=causal,
                    softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                    alibi_slopes=alibi_slopes, deterministic=deterministic,
                    **_dropout_kw(dropout_p, rng_state),
                    **_descale_kw(q, k, v, q_descale, k_descale, v_descale))


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, backend=None, dq=None, dk=None, dv=None,
                       dropout_p=0.0, rng_state=None):
    """Backward pass from the forward's ``out`` and ``lse``. Returns ``(dq, dk, dv)``.

    ``deterministic=True`` gives bitwise identical gradients run after run. CuPy arrays:
    ``dq``, ``dk``, ``dv`` may be given, preallocated (see :func:`attention_forward`).
    Dropout: the forward's ``dropout_p`` and ``rng_state`` (the mask is regenerated).
    """
    return _backward(dout, q, k, v, out, lse, backend, False, dq=dq, dk=dk, dv=dv,
                     causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                     softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                     **_dropout_kw(dropout_p, rng_state))


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, deterministic=False, return_lse=False,
              backend=None, dropout_p=0.0, rng_state=None, q_descale=None, k_descale=None,
              v_descale=None):
    """softmax(q·kᵀ·scale + mask)·v, exactly, the FlashAttention way.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out (like q), or ``(out, lse)`` with ``return_lse=True``. On torch tensors the
    result is differentiable (autograd); on NumPy/CuPy arrays use :func:`attention_backward`.
    ``dropout_p`` > 0: attention dropout (training). On torch tensors its random state is
    drawn from torch's generator of q's device, on the device (``torch.manual_seed`` reproduces
    a run), unless ``rng_state`` is given; on NumPy/CuPy arrays ``rng_state`` must be given
    (the same pair then goes to :func:`attention_backward`; :func:`draw_rng_state` makes one).
    See :mod:`flashcore.dropout`. FP8 inputs and their descales: see :func:`attention_forward`.
    """
    return_lse = as_flag("return_lse", return_lse)
    # (no dropout, no descales, the common case: _dropout_kw's and _descale_kw's {} without
    # their calls)
    drop = {} if type(dropout_p) is float and dropout_p == 0 and rng_state is None else \
        _dropout_kw(dropout_p, rng_state, q)
    fp8 = {} if q_descale is None and k_descale is None and v_descale is None else \
        _descale_kw(q, k, v, q_descale, k_descale, v_descale)
    if library_of(q) == "torch" and not _torch_fp8(q):
        # validated once, inside (this path is per-call overhead)
        # (dropout's arguments named, not **drop: an empty ** costs a call about 0.3 us)
        out, lse = torch_ops.autograd_attention(
            q, k, v, backend=backend, causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            deterministic=deterministic, dropout_p=drop["dropout_p"] if drop else 0.0,
            rng_state=drop["rng_state"] if drop else None)
    else:
        if _torch_fp8(q):       # forward only: inputs that require grad are refused by name
            _no_grad_fp8(q, k, v)
        out, lse = _forward(q, k, v, backend, False, causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic, **drop, **fp8)
    return (out, lse) if return_lse else out


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                             max_seqlen_k=None, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, backend=None, block_table=None,
                             out_dtype=None, dropout_p=0.0, rng_state=None, q_descale=None,
                             k_descale=None, v_descale=None):
    """Forward over packed variable-length sequences. Returns ``(out, lse)``.

    q: (total_q, nheads, headdim), k, v: (total_k, nheads_k, headdim); sequence b holds
    rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32, length batch+1). lse: (nheads, total_q).
    Rows past ``cu_seqlens[-1]`` belong to no sequence (flash-attn's rule): no result depends
    on them (NaN there included), and their out, lse and gradients are unspecified.
    ``max_seqlen_*`` default to the longest sequence (computed from cu_seqlens; for device
    arrays, which are not read back, to the packed totals).

    Over a paged KV cache (prefill or chunked prefill into a paged cache, flash-attn's
    ``block_table``): k, v are ``(num_blocks, page_size, nheads_k, headdim)`` with page_size a
    multiple of 16, ``block_table`` int32 ``(batch, max_blocks_per_seq)``; key t of sequence
    b is row ``t % page_size`` of block ``block_table[b, t // page_size]``, and
    ``cu_seqlens_k`` gives only the key lengths (``cu_seqlens_k[b+1] - cu_seqlens_k[b]``).
    Forward only (there is no backward over a paged cache, as in flash-attn).
    ``out_dtype``, ``dropout_p``, ``rng_state`` and FP8 (``q_descale``, ``k_descale``,
    ``v_descale``, row b for sequence b): as in :func:`attention_forward`.
    """
    return _forward(q, k, v, backend, True, out_dtype=out_dtype, causal=causal,
                    softmax_scale=softmax_scale,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, block_table=block_table,
                    **_dropout_kw(dropout_p, rng_state),
                    **_descale_kw(q, k, v, q_descale, k_descale, v_descale, varlen=True,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, backend=None,
                              dropout_p=0.0, rng_state=None):
    """Backward over packed variable-length sequences. Returns ``(dq, dk, dv)``."""
    return _backward(dout, q, k, v, out, lse, backend, True, causal=causal,
                     softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                     **_dropout_kw(dropout_p, rng_state))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                     max_seqlen_k=None, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_lse=False, backend=None, block_table=None,
                     dropout_p=0.0, rng_state=None, q_descale=None, k_descale=None,
                     v_descale=None):
    """:func:`attention` over packed variable-length sequences (differentiable on torch;
    with ``block_table``, over a paged KV cache, forward only: see
    :func:`varlen_attention_forward`, which also says how FP8 inputs are taken)."""
    return_lse = as_flag("return_lse", return_lse)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_table=block_table,
              **_dropout_kw(dropout_p, rng_state, q))
    kw.update(_descale_kw(q, k, v, q_descale, k_descale, v_descale, varlen=True,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k))
    if library_of(q) == "torch" and not _torch_fp8(q):
        out, lse = torch_ops.autograd_attention(q, k, v, backend=backend, varlen=True, **kw)
    else:
        if _torch_fp8(q):
            _no_grad_fp8(q, k, v)
        out, lse = _forward(q, k, v, backend, True, **kw)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           block_table=None, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=False, causal=False, softmax_scale=None,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0,
                           return_lse=False, backend=None, out=None, lse=None,
                           cache_leftpad=None, k_descale=None, v_descale=None, key_mask=None):
    """One decoding step with a KV cache (flash-attn's ``flash_attn_with_kvcache``).

    **The cache is updated in place**: when ``k`` and ``v`` are given, they are written into
    ``k_cache``/``v_cache`` at positions ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` of
    each sequence, and attention then runs over the first ``cache_seqlens[b] + seqlen_new``
    keys of sequence b. ``cache_seqlens`` itself is not changed: advance it yourself.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: the cache, either contiguous ``(batch, seqlen_cache, nheads_k,
            headdim)`` or paged ``(num_blocks, page_size, nheads_k, headdim)`` (with
            ``block_table``; page_size a multiple of 16). Only the last dimension needs to be
            contiguous (a slice of a larger cache is updated in place all the same).
        k, v: optional new keys/values ``(batch, seqlen_new, nheads_k, headdim)``, appended.
        cache_seqlens: int, or int32 array ``(batch,)``: the number of cached keys of each
            sequence *before* appending. Every ``cache_seqlens[b] + seqlen_new`` must fit in the
            cache. Checked for an int and host arrays; device arrays are not read back (no
            sync: the call can be captured in a CUDA graph), the kernels clamp what they
            address to the cache instead, and debug mode (``FLASHCORE_DEBUG=1``, see
            :mod:`flashcore.config`) checks them with named errors.
        block_table: int32 ``(batch, max_blocks_per_seq)``: key position t of sequence b lives
            in row ``t % page_size`` of block ``block_table[b, t // page_size]``. Every block a
            sequence uses must exist (checked like ``cache_seqlens``: on the host, or in debug
            mode; the kernels never read or write outside the pool); unused entries are
            ignored.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)`` in q's dtype, rotary_dim a
            multiple of 16 and at most headdim; only with ``k``/``v``. The new keys are rotated
            at their positions ``cache_seqlens[b] + t`` before they are written; q is rotated
            at ``cache_seqlens[b] + i`` when causal or windowed, else every query row at
            ``cache_seqlens[b]`` (flash-attn's rule).
        rotary_interleaved: rotate channel pairs (0, 1), (2, 3), ... (GPT-J) instead of
            (i, i + rotary_dim/2) (GPT-NeoX, the default here; flash-attn's own default is
            True, which :func:`flashcore.flash_attn.flash_attn_with_kvcache` keeps).
        causal, window_size, softcap, alibi_slopes, softmax_scale: as in :func:`attention`,
            bottom-right aligned per sequence to its ``cache_seqlens[b] + seqlen_new`` keys.
        num_splits: split the keys of each sequence into this many chunks merged through
            their LSE (Flash-Decoding); 0 lets the backend choose. The result is the same.
        return_lse: also return the log-sum-exp.
        cache_leftpad: int32 ``(batch,)`` or None (flash-attn's): sequence b's keys start at row
            ``cache_leftpad[b]`` of its (contiguous) cache; rows before it are ignored (left
            padding): masks, the causal alignment and ALiBi count from it. The new keys are
            still written, and rotated, at rows ``cache_seqlens[b] + t``, as in flash-attn.
            Not with ``block_table``. ``0 <= cache_leftpad[b] <= cache_seqlens[b]`` is checked
            for host arrays and in debug mode; on the device the kernel clamps it to the
            sequence (memory-safe, but an out-of-range pad gives a meaningless result).
        key_mask: bool ``(batch, capacity)`` or None: key ``t`` of sequence b (its row ``t``
            counted from the start of its cache, ``cache_leftpad`` or not; paged: its position
            ``t``) is attended only where ``key_mask[b, t]`` is True, on top of the causal /
            window masks, which keep counting positions (a padding mask with holes: what
            transformers passes for batched generation). capacity is ``seqlen_cache``, or
            ``max_blocks_per_seq * page_size`` when paged; the last dimension contiguous. Not
            in flash-attn. The kernels read one byte a key.
        out, lse: CuPy arrays only, preallocated outputs (like q; float32 ``(batch, nheads,
            seqlen_q)``), written in place: what a call captured in a CUDA graph needs.
        k_descale, v_descale: with an FP8 cache (FlashAttention-3's names), None (1.0) or
            float32 arrays of q's library and device broadcastable to ``(batch, nheads_k)``:
            the cache stands for the values ``k_cache[b, t, hk, :] * k_descale[b, hk]`` (v
            likewise). Given with a 16-bit cache: refused.

    FP8 caches: ``k_cache`` and ``v_cache`` both float8_e4m3fn (NumPy: ``ml_dtypes``
    arrays; torch: ``torch.float8_e4m3fn`` tensors; CuPy, which has no float8 dtype: uint8
    arrays, read as float8_e4m3fn bits), q float16 or bfloat16; out in q's dtype, lse float32.
    Read only: appending ``k``/``v`` to an FP8 cache is refused (quantise new tokens and write
    them yourself), and so is an FP8 q. Paged caches, ``cache_leftpad``, masks, softcap, ALiBi,
    GQA and ``num_splits`` work as with 16-bit caches. The CUDA kernels take head dims 128
    and 256 with FP8 caches, on compute capability 8.9 and newer.

    Returns:
        out like q (in q's dtype), or ``(out, lse)`` with lse float32 ``(batch, nheads,
        seqlen_q)``. A sequence with no key (length 0, or everything masked) gets out 0 and
        lse -inf. On torch tensors there is no autograd: the call runs as under
        ``torch.no_grad()`` and the results do not require grad (inference only).
    """
    return_lse = as_flag("return_lse", return_lse)
    if out is None and lse is None and library_of(q) == "torch":
        out, lse = torch_ops.kvcache_attention(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin,
            rotary_interleaved, causal, softmax_scale, window_size, softcap, alibi_slopes,
            num_splits, backend, cache_leftpad, k_descale, v_descale, key_mask)
        return (out, lse) if return_lse else out
    if k_descale is not None or v_descale is not None:
        # (what the backends take: contiguous float32 (batch, nheads_k); validated below)
        kd_shape = _kv_shape(q, k_cache)
        if kd_shape is not None:
            k_descale, v_descale = (exact_descale(d, *kd_shape) for d in (k_descale, v_descale))
    # (a call that appends is never recorded: its decode reads the lengths the append computes
    # on the device; no key is made for it)
    key = None if k is not None else _cupy_key(
        "kvcache", (q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos,
                    rotary_sin, alibi_slopes, out, lse, cache_leftpad, k_descale, v_descale,
                    key_mask),
        (rotary_interleaved, causal, softmax_scale, window_size, softcap, num_splits, backend))
    if key is not None:
        plan = plans.lookup(key)
        if plan is not None and plans.enter(plan):
            import cupy     # (the current device is the plan's: outputs are allocated there)
            try:
                o = cupy.empty(q.shape, q.dtype) if out is None else out
                l_ = cupy.empty(lse_shape(q.shape), cupy.float32) if lse is None else lse
                ok = _cupy_replay(plan, (q.data.ptr, k_cache.data.ptr, v_cache.data.ptr,
                                         o.data.ptr, l_.data.ptr, cache_seqlens.data.ptr,
                                         _ptr(block_table), _ptr(alibi_slopes),
                                         _ptr(cache_leftpad), _ptr(k_descale), _ptr(v_descale),
                                         _ptr(key_mask)))
            except Exception as e:
                raise_oom(e, "decode")
                raise
            if ok:
                return (o, l_) if return_lse else o
    spec = kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                        block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                        rotary_interleaved=rotary_interleaved, causal=causal,
                        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, num_splits=num_splits,
                        cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale,
                        key_mask=key_mask)
    a = spec.attn
    given = check_outputs(a, {"out": out, "lse": lse},
                          {"out": (q.shape, a.dtype),
                           "lse": ((a.batch, a.nheads, a.seqlen_q), "float32")}) \
        if out is not None or lse is not None else {}
    with plans.record() as rec:
        out, lse = choose_kvcache(spec, backend).forward_kvcache(
            spec, q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
            block_table=block_table, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad, k_descale=k_descale,
            v_descale=v_descale, key_mask=key_mask, **given)
    if key is not None and spec.cache_seqlens_int is None:
        plans.remember(key, rec.plan(
            (("q", _ptr(q)), ("k", _ptr(k_cache)), ("v", _ptr(v_cache)), ("o", _ptr(out)),
             ("lse", _ptr(lse)), ("cache_seqlens", _ptr(cache_seqlens)),
             ("block_table", _ptr(block_table)), ("alibi_slopes", _ptr(alibi_slopes)),
             ("cache_leftpad", _ptr(cache_leftpad)), ("k_descale", _ptr(k_descale)),
             ("v_descale", _ptr(v_descale)), ("key_mask", _ptr(key_mask))), q.device.id))
    return (out, lse) if return_lse else out


def _kv_shape(q, k_cache):
    """(batch, nheads_k) read from q and k_cache's shapes, or None when they are not arrays of
    4 dimensions (the validation then names what is wrong)."""
    try:
        if len(q.shape) == 4 and len(k_cache.shape) == 4:
            return int(q.shape[0]), int(k_cache.shape[2])
    except (AttributeError, TypeError):
        pass
    return None


def merge_attention_states(outs, lses):
    """Merge partial attention results computed over disjoint sets of keys.

    If ``(outs[i], lses[i])`` is the attention of the same queries over the i-th part of the
    keys (any forward's ``(out, lse)``), the merge is the attention over all of them:
    ``lse = log Σ exp(lses[i])`` and ``out = Σ exp(lses[i] - lse) · outs[i]`` (the combine step
    of split-KV decoding). Parts where a row saw no key (lse -inf) contribute nothing; a row
    that no part saw gets out 0 and lse -inf, never NaN.

    Arguments:
        outs: a list of ``(batch, seqlen_q, nheads, headdim)`` arrays (or packed ``(total,
            nheads, headdim)``), or one stacked ``(n, ...)`` array.
        lses: the matching ``(batch, nheads, seqlen_q)`` (packed: ``(nheads, total)``) arrays,
            or one stacked ``(n, ...)`` array.

    NumPy, CuPy and torch arrays are merged with their own library's operations (on torch this
    is differentiable). Computed in float32 (float64 when the inputs are float64). Returns
    ``(out, lse)``: out in the dtype of ``outs``, lse float32 (float64 for float64 inputs).
    """
    lib, outs, lses = merge_spec(outs, lses)
    if lib == "torch":
        import torch
        ct = torch.float64 if torch.float64 in (outs[0].dtype, lses[0].dtype) else torch.float32
        L = torch.stack([x.to(ct) for x in lses])                      # (n, ..., h, s)
        m = torch.amax(L, dim=0)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        ssum = torch.exp(L - m).sum(dim=0)
        lse = torch.where(ssum > 0, m + torch.log(torch.where(ssum > 0, ssum, torch.ones_like(ssum))),
                          torch.full_like(ssum, float("-inf")))
        w = torch.exp(L - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
        # a part with weight 0 contributes nothing, even if its out holds NaN/garbage
        out = sum(torch.where((wi > 0).transpose(-1, -2).unsqueeze(-1),
                              wi.transpose(-1, -2).unsqueeze(-1) * o.to(ct), 0)
                  for wi, o in zip(w, outs))
        return out.to(outs[0].dtype), lse
    if lib == "cupy":
        import cupy as xp
    else:
        import numpy as xp
    return merge_states(outs, lses, xp)


def available_backends() -> dict[str, str | None]:
    """Every backend flashcore knows, mapped to None when usable here, else the reason why not."""
    return {name: b.unavailable_reason() for name, b in all_backends().items()}
