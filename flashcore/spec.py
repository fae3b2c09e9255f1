"""One frozen description of an attention call, and the validation that produces it.

Every user-facing error message is born here, before any backend or kernel runs. A message
names the argument, what was expected and what was given.
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

import numpy as np

from ._arrays import device_of, dtype_name, library_of, strides_in_elements, to_host

__all__ = ["AttentionSpec", "forward_spec", "backward_spec", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class AttentionSpec:
    """Shapes and options of one attention call (forward or backward).

    ``window_left``/``window_right`` are the effective window after folding in ``causal``
    (causal means right = 0); -1 means unbounded on that side.
    """
    library: str                 # 'numpy' | 'cupy' | 'torch'
    device: str                  # 'cpu' | 'cuda:N'
    dtype: str                   # one of FLOAT_DTYPES
    batch: int
    seqlen_q: int                # varlen: max_seqlen_q
    seqlen_k: int                # varlen: max_seqlen_k
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    window_left: int
    window_right: int
    softmax_scale: float
    softcap: float
    alibi: str | None            # None | 'per_head' | 'per_batch_head'
    deterministic: bool
    varlen: bool
    total_q: int | None = None
    total_k: int | None = None

    @property
    def group_size(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def flops_forward(self, seqlens=None) -> float:
        """The flash-attn convention: 4·b·h·sq·sk·d, halved for causal."""
        f = 4.0 * self.batch * self.nheads * self.seqlen_q * self.seqlen_k * self.headdim
        return f / 2 if self.causal else f


def _arg_error(cls, name, expected, got):
    return cls(f"argument '{name}': expected {expected}, got {got}")


def _describe(x) -> str:
    lib = library_of(x)
    if lib is None:
        return f"{type(x).__name__}"
    return f"{lib} array of shape {tuple(x.shape)} and dtype {dtype_name(x)} on {device_of(x)}"


def _torch_compiling() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.compiler.is_compiling())


def _check_array(name, x, ndim, lib=None, device=None):
    xlib = library_of(x)
    if xlib is None:
        raise _arg_error(TypeError, name, "a numpy.ndarray, cupy.ndarray or torch.Tensor",
                         type(x).__name__)
    if lib is not None and xlib != lib:
        raise _arg_error(TypeError, name,
                         f"a {lib} array like 'q' (arrays of different libraries cannot be mixed)",
                         f"a {xlib} array")
    if device is not None and device_of(x) != device:
        raise _arg_error(ValueError, name, f"an array on {device} like 'q'",
                         f"an array on {device_of(x)}")
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise _arg_error(ValueError, name, f"{ndim}-dimensional array", f"shape {tuple(x.shape)}")


def _check_last_contiguous(name, x):
    # an empty array, or a last dimension of size 1, has no meaningful last stride
    if x.shape[-1] > 1 and math.prod(x.shape) > 0 and strides_in_elements(x)[-1] != 1:
        raise _arg_error(ValueError, name,
                         "a contiguous last dimension (stride 1; other strides may be anything)",
                         f"strides {strides_in_elements(x)} (in elements)")


def _as_int(name, v, minimum=None):
    if isinstance(v, bool) or not isinstance(v, (numbers.Integral,)):
        raise _arg_error(TypeError, name, "an int", f"{type(v).__name__} {v!r}")
    v = int(v)
    if minimum is not None and v < minimum:
        raise _arg_error(ValueError, name, f"an int >= {minimum}", v)
    return v


def _as_float(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _arg_error(TypeError, name, "a real number", f"{type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise _arg_error(ValueError, name, "a finite number", v)
    return v


def _window(window_size, causal):
    if window_size is None:
        window_size = (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise _arg_error(TypeError, "window_size", "a pair (left, right) of ints >= -1",
                         repr(window_size))
    left = _as_int("window_size[0]", window_size[0])
    right = _as_int("window_size[1]", window_size[1])
    for n, v in (("window_size[0]", left), ("window_size[1]", right)):
        if v < -1:
            raise _arg_error(ValueError, n, "an int >= -1 (-1 means unbounded)", v)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _cu_seqlens(name, cu, lib, device, total, max_seqlen_name, max_seqlen):
    _check_array(name, cu, 1, lib, device)
    if dtype_name(cu) != "int32":
        raise _arg_error(TypeError, name, "an int32 array of length batch+1", f"dtype {dtype_name(cu)}")
    if cu.shape[0] < 2:
        raise _arg_error(ValueError, name, "length batch+1 >= 2", f"length {cu.shape[0]}")
    if lib == "torch" and _torch_compiling():
        # Under torch.compile the values are not known at trace time: they cannot be read
        # back, so the caller must state the longest sequence (as flash-attn always requires).
        if max_seqlen is None:
            raise _arg_error(ValueError, max_seqlen_name,
                             "an int under torch.compile (cu_seqlens cannot be read while tracing)",
                             "None")
        return cu.shape[0] - 1, _as_int(max_seqlen_name, max_seqlen, 0)
    h = np.asarray(to_host(cu)).astype(np.int64)
    if h[0] != 0:
        raise _arg_error(ValueError, name, "cu_seqlens[0] == 0", f"{h[0]}")
    d = np.diff(h)
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise _arg_error(ValueError, name, "a non-decreasing sequence",
                         f"{name}[{i + 1}] = {h[i + 1]} < {name}[{i}] = {h[i]}")
    if h[-1] != total:
        raise _arg_error(ValueError, name,
                         f"last entry equal to the number of packed tokens ({total})", f"{h[-1]}")
    longest = int(d.max()) if d.size else 0
    if max_seqlen is None:
        max_seqlen = longest
    max_seqlen = _as_int(max_seqlen_name, max_seqlen, 0)
    if max_seqlen < longest:
        raise _arg_error(ValueError, max_seqlen_name,
                         f"at least the longest sequence in {name} ({longest})", max_seqlen)
    return cu.shape[0] - 1, max_seqlen


def forward_spec(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, varlen=False) -> AttentionSpec:
    """Validate the forward arguments and return their spec. Raises TypeError/ValueError."""
    _check_array("q", q, 3 if varlen else 4)
    lib, device = library_of(q), device_of(q)
    _check_array("k", k, q.ndim, lib, device)
    _check_array("v", v, q.ndim, lib, device)
    dt = dtype_name(q)
    if dt not in FLOAT_DTYPES:
        raise _arg_error(TypeError, "q", f"a floating dtype in {FLOAT_DTYPES}", f"dtype {dt}")
    for n, x in (("k", k), ("v", v)):
        if dtype_name(x) != dt:
            raise _arg_error(TypeError, n, f"dtype {dt} like 'q'", f"dtype {dtype_name(x)}")
    layout = "(total, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)"
    *lead_q, nheads, headdim = q.shape
    *lead_k, nheads_k, hd_k = k.shape
    if headdim < 1:
        raise _arg_error(ValueError, "q", f"{layout} with headdim >= 1", f"shape {tuple(q.shape)}")
    if nheads < 1 or nheads_k < 1:
        raise _arg_error(ValueError, "q" if nheads < 1 else "k", "at least one head",
                         f"shape {tuple((q if nheads < 1 else k).shape)}")
    if hd_k != headdim:
        raise _arg_error(ValueError, "k", f"headdim {headdim} like 'q' in {layout}",
                         f"shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise _arg_error(ValueError, "v", f"the shape of 'k' {tuple(k.shape)}", f"shape {tuple(v.shape)}")
    if not varlen and lead_k[0] != lead_q[0]:
        raise _arg_error(ValueError, "k", f"batch {lead_q[0]} like 'q'", f"shape {tuple(k.shape)}")
    if nheads % nheads_k:
        raise _arg_error(ValueError, "k",
                         f"a number of heads that divides the {nheads} query heads (MQA/GQA)",
                         f"{nheads_k} heads")
    for n, x in (("q", q), ("k", k), ("v", v)):
        _check_last_contiguous(n, x)

    left, right = _window(window_size, bool(causal))
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    softmax_scale = _as_float("softmax_scale", softmax_scale)
    if softmax_scale <= 0:
        raise _arg_error(ValueError, "softmax_scale", "a finite number > 0", softmax_scale)
    softcap = _as_float("softcap", 0.0 if softcap is None else softcap)
    if softcap < 0:
        raise _arg_error(ValueError, "softcap", "a number >= 0 (0 disables it)", softcap)

    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise _arg_error(ValueError, "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k",
                             "an int32 array of length batch+1 for varlen attention", "None")
        batch, sq = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, lib, device, q.shape[0],
                                "max_seqlen_q", max_seqlen_q)
        batch_k, sk = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, lib, device, k.shape[0],
                                  "max_seqlen_k", max_seqlen_k)
        if batch_k != batch:
            raise _arg_error(ValueError, "cu_seqlens_k", f"length {batch + 1} like 'cu_seqlens_q'",
                             f"length {batch_k + 1}")
        total_q, total_k = q.shape[0], k.shape[0]
    else:
        for n, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if x is not None:
                raise _arg_error(ValueError, n, "None for padded (batch, seqlen, ...) inputs; "
                                 "use the varlen functions for packed inputs", "an array")
        batch, sq = q.shape[0], q.shape[1]
        sk = k.shape[1]
        total_q = total_k = None

    alibi = None
    if alibi_slopes is not None:
        _check_array("alibi_slopes", alibi_slopes, (1, 2), lib, device)
        if dtype_name(alibi_slopes) != "float32" and not (lib == "numpy" and dtype_name(alibi_slopes) == "float64"):
            raise _arg_error(TypeError, "alibi_slopes", "a float32 array", f"dtype {dtype_name(alibi_slopes)}")
        shp = tuple(alibi_slopes.shape)
        if shp == (nheads,):
            alibi = "per_head"
        elif shp == (batch, nheads):
            alibi = "per_batch_head"
        else:
            raise _arg_error(ValueError, "alibi_slopes", f"shape ({nheads},) or ({batch}, {nheads})",
                             f"shape {shp}")
        _check_last_contiguous("alibi_slopes", alibi_slopes)

    return AttentionSpec(
        library=lib, device=device, dtype=dt, batch=int(batch), seqlen_q=int(sq),
        seqlen_k=int(sk), nheads=int(nheads), nheads_k=int(nheads_k), headdim=int(headdim),
        causal=bool(causal), window_left=left, window_right=right,
        softmax_scale=softmax_scale, softcap=softcap, alibi=alibi,
        deterministic=bool(deterministic), varlen=bool(varlen),
        total_q=total_q, total_k=total_k,
    )


def backward_spec(dout, q, k, v, out, lse, **kw) -> AttentionSpec:
    """Validate the backward arguments: the forward's, plus dout/out like q and lse."""
    spec = forward_spec(q, k, v, **kw)
    for n, x in (("dout", dout), ("out", out)):
        _check_array(n, x, q.ndim, spec.library, spec.device)
        if tuple(x.shape) != tuple(q.shape):
            raise _arg_error(ValueError, n, f"the shape of 'q' {tuple(q.shape)}", f"shape {tuple(x.shape)}")
        if dtype_name(x) != spec.dtype:
            raise _arg_error(TypeError, n, f"dtype {spec.dtype} like 'q'", f"dtype {dtype_name(x)}")
        _check_last_contiguous(n, x)
    _check_array("lse", lse, 2 if spec.varlen else 3, spec.library, spec.device)
    want = (spec.nheads, spec.total_q) if spec.varlen else (spec.batch, spec.nheads, spec.seqlen_q)
    if tuple(lse.shape) != want:
        raise _arg_error(ValueError, "lse", f"shape {want} (float32 log-sum-exp from the forward)",
                         f"shape {tuple(lse.shape)}")
    if dtype_name(lse) != "float32" and not (spec.dtype == "float64" and dtype_name(lse) == "float64"):
        raise _arg_error(TypeError, "lse", "dtype float32", f"dtype {dtype_name(lse)}")
    return spec
