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
  that sees no key gets ``out = 0`` and ``lse = -inf``, never NaN. (float64 inputs, NumPy only:
  lse is float64.)
* The backward returns ``(dq, dk, dv)`` in the input dtypes; for GQA, dk/dv are summed over the
  query heads that share a key head.
"""
from __future__ import annotations

from ._arrays import library_of
from .backends.base import all_backends, choose
from .spec import backward_spec, forward_spec

__all__ = [
    "attention", "attention_forward", "attention_backward",
    "varlen_attention", "varlen_attention_forward", "varlen_attention_backward",
    "available_backends",
]


def _forward(q, k, v, backend, varlen, **kw):
    spec = forward_spec(q, k, v, varlen=varlen, **kw)
    b = choose(spec, backend)
    return b.forward(spec, q, k, v, alibi_slopes=kw.get("alibi_slopes"),
                     cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"))


def _backward(dout, q, k, v, out, lse, backend, varlen, **kw):
    spec = backward_spec(dout, q, k, v, out, lse, varlen=varlen, **kw)
    b = choose(spec, backend, backward=True)
    return b.backward(spec, dout, q, k, v, out, lse, alibi_slopes=kw.get("alibi_slopes"),
                      cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"))


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, deterministic=False, backend=None):
    """Forward pass. Returns ``(out, lse)``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    out: like q; lse: float32 (batch, nheads, seqlen_q). ``backend`` names one of
    :func:`backends` (default: the first that takes these arrays).
    """
    return _forward(q, k, v, backend, False, causal=causal, softmax_scale=softmax_scale,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, backend=None):
    """Backward pass from the forward's ``out`` and ``lse``. Returns ``(dq, dk, dv)``.

    ``deterministic=True`` gives bitwise identical gradients run after run.
    """
    return _backward(dout, q, k, v, out, lse, backend, False, causal=causal,
                     softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, deterministic=False, return_lse=False,
              backend=None):
    """softmax(q·kᵀ·scale + mask)·v, exactly, the FlashAttention way.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out (like q), or ``(out, lse)`` with ``return_lse=True``. On torch tensors the
    result is differentiable (autograd); on NumPy/CuPy arrays use :func:`attention_backward`.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    if library_of(q) == "torch":    # validated once, inside (this path is per-call overhead)
        from .backends.torch_backend import autograd_attention
        out, lse = autograd_attention(q, k, v, backend=backend, **kw)
    else:
        out, lse = _forward(q, k, v, backend, False, **kw)
    return (out, lse) if return_lse else out


def varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                             max_seqlen_k=None, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, backend=None):
    """Forward over packed variable-length sequences. Returns ``(out, lse)``.

    q: (total_q, nheads, headdim), k, v: (total_k, nheads_k, headdim); sequence b holds
    rows ``cu_seqlens[b]:cu_seqlens[b+1]`` (int32, length batch+1). lse: (nheads, total_q).
    ``max_seqlen_*`` default to the longest sequence (computed from cu_seqlens).
    """
    return _forward(q, k, v, backend, True, causal=causal, softmax_scale=softmax_scale,
                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k)


def varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, backend=None):
    """Backward over packed variable-length sequences. Returns ``(dq, dk, dv)``."""
    return _backward(dout, q, k, v, out, lse, backend, True, causal=causal,
                     softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                     alibi_slopes=alibi_slopes, deterministic=deterministic,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                     max_seqlen_k=None, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_lse=False, backend=None):
    """:func:`attention` over packed variable-length sequences (differentiable on torch)."""
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if library_of(q) == "torch":
        from .backends.torch_backend import autograd_attention
        out, lse = autograd_attention(q, k, v, backend=backend, varlen=True, **kw)
    else:
        out, lse = _forward(q, k, v, backend, True, **kw)
    return (out, lse) if return_lse else out


def available_backends() -> dict[str, str | None]:
    """Every backend flashcore knows, mapped to None when usable here, else the reason why not."""
    return {name: b.unavailable_reason() for name, b in all_backends().items()}
