"""One frozen description of an attention call, and the validation that produces it.

Every user-facing error message is born here, before any backend or kernel runs. A message
names the argument, what was expected and what was given.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from . import config
from ._arrays import (device_of, dtype_name, is_host, library_of, strides_in_elements,
                      to_host, torch_compiling)

__all__ = ["AttentionSpec", "KVCacheSpec", "forward_spec", "backward_spec", "kvcache_spec",
           "merge_spec", "FLOAT_DTYPES", "FP8_DTYPES", "FP8_CACHE_Q_DTYPES", "fp8_out_dtype",
           "exact_descale", "cache_dtype_of"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# FP8 inputs (FlashAttention-3's e4m3 forward): forward only, with per-(batch, key head)
# descale factors; NumPy arrays (ml_dtypes) and torch CPU tensors on the NumPy reference, CuPy
# arrays (uint8 holding the bits: see cache_dtype_of) and CUDA tensors on the Hopper kernel
# (the CuPy backend says by name what it refuses: other devices, head dims, varlen, ...).
# Decoding (attention_with_kvcache) takes FP8 caches with 16-bit queries, on every library.
FP8_DTYPES = ("float8_e4m3fn",)


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
    page_size: int = 0           # varlen over a paged cache (block_table): rows per block
    num_blocks: int = 0          # ... and blocks in the pool
    dropout_p: float = 0.0       # attention dropout (flashcore.dropout's stream), 0 <= p < 1

    @property
    def paged(self) -> bool:
        return self.page_size > 0

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


def lse_shape(q_shape, varlen: bool = False) -> tuple:
    """The log-sum-exp's shape for a q of ``q_shape``: ``(nheads, total_q)`` packed (varlen),
    else ``(batch, nheads, seqlen_q)``."""
    return (q_shape[1], q_shape[0]) if varlen else (q_shape[0], q_shape[2], q_shape[1])


def _arg_error(cls, name, expected, got):
    return cls(f"argument '{name}': expected {expected}, got {got}")


def _describe(x) -> str:
    lib = library_of(x)
    if lib is None:
        return f"{type(x).__name__}"
    return f"{lib} array of shape {tuple(x.shape)} and dtype {dtype_name(x)} on {device_of(x)}"


def _reads_values(x) -> bool:
    """Whether validation reads the values of the index array ``x`` (lengths, block tables):
    when they are in host memory (free), or in debug mode (flashcore.config: a device sync);
    never while torch.compile traces. Otherwise the kernels guard every address they form."""
    return (is_host(x) or config.debug()) and not torch_compiling(x)


def _check_array(name, x, ndim, lib=None, device=None, like="q"):
    """x is an array of ``ndim`` dimensions (an int or a tuple of them) and, when given, of
    library ``lib`` on ``device``, those of the argument named ``like``."""
    xlib = library_of(x)
    if xlib is None:
        raise _arg_error(TypeError, name, "a numpy.ndarray, cupy.ndarray or torch.Tensor",
                         type(x).__name__)
    if lib is not None and xlib != lib:
        raise _arg_error(TypeError, name,
                         f"a {lib} array like '{like}' (arrays of different libraries cannot "
                         "be mixed)", f"a {xlib} array")
    if device is not None and device_of(x) != device:
        raise _arg_error(ValueError, name, f"an array on {device} like '{like}'",
                         f"an array on {device_of(x)}")
    if ndim is not None and x.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise _arg_error(ValueError, name, f"{ndim}-dimensional array", f"shape {tuple(x.shape)}")


def _check_q_and_kv(q, k, v, k_name, v_name, q_ndim, kv_ndim=None, fp8=False):
    """q a floating array of q_ndim dimensions (``fp8``: or float8_e4m3fn); k and v arrays of
    kv_ndim (default: q's) dimensions and of q's library, device and dtype. Returns (library,
    device, dtype name)."""
    _check_array("q", q, q_ndim)
    kv_ndim = q.ndim if kv_ndim is None else kv_ndim
    lib, device = library_of(q), device_of(q)
    _check_array(k_name, k, kv_ndim, lib, device)
    _check_array(v_name, v, kv_ndim, lib, device)
    dt = dtype_name(q)
    if fp8:      # (a CuPy uint8 array holds float8_e4m3fn bits: CuPy has no float8 dtype)
        dt = cache_dtype_of(q)
    if dt in FP8_DTYPES and not fp8:
        raise _arg_error(TypeError, "q", f"a floating dtype in {FLOAT_DTYPES} (float8_e4m3fn "
                         "inputs are taken by the forward functions only)", f"dtype {dt}")
    if dt not in FLOAT_DTYPES + (FP8_DTYPES if fp8 else ()):
        raise _arg_error(TypeError, "q", f"a floating dtype in {FLOAT_DTYPES}", f"dtype {dt}")
    for n, x in ((k_name, k), (v_name, v)):
        xdt = cache_dtype_of(x) if fp8 else dtype_name(x)
        if xdt != dt:
            raise _arg_error(TypeError, n, f"dtype {dt} like 'q'", f"dtype {xdt}")
    return lib, device, dt


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


def as_flag(name, v) -> bool:
    """A flag: bool (or numpy.bool_) only; ``causal="no"`` must not count as causal. Every
    flag of the public functions (``causal``, ``deterministic``, ``return_lse``, ...) is read
    through this, before anything runs."""
    if v is True or v is False:
        return v
    if not isinstance(v, np.bool_):
        raise _arg_error(TypeError, name, "a bool", f"{type(v).__name__} {v!r}")
    return bool(v)


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
    if library_of(window_size) is not None and window_size.ndim == 1:
        # flash-attn takes any pair of ints: a NumPy array or a tensor is read as host ints
        window_size = tuple(int(x) for x in np.asarray(to_host(window_size)).tolist())
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


def _cu_seqlens(name, cu, lib, device, total, max_seqlen_name, max_seqlen, device_default=None):
    _check_array(name, cu, 1, lib, device)
    if dtype_name(cu) != "int32":
        raise _arg_error(TypeError, name, "an int32 array of length batch+1", f"dtype {dtype_name(cu)}")
    if cu.shape[0] < 2:
        raise _arg_error(ValueError, name, "length batch+1 >= 2", f"length {cu.shape[0]}")
    if max_seqlen is not None:
        max_seqlen = _as_int(max_seqlen_name, max_seqlen, 0)
    if not _reads_values(cu):
        # The values stay on the device (no sync; capturable in a CUDA graph): the longest
        # sequence is at most the packed total, which sizes the grid when it is not given.
        if max_seqlen is None:
            max_seqlen = total if device_default is None else device_default
        return cu.shape[0] - 1, max_seqlen
    h = np.asarray(to_host(cu)).astype(np.int64)
    if h[0] != 0:
        raise _arg_error(ValueError, name, "cu_seqlens[0] == 0", f"{h[0]}")
    d = np.diff(h)
    if (d < 0).any():
        i = int(np.argmax(d < 0))
        raise _arg_error(ValueError, name, "a non-decreasing sequence",
                         f"{name}[{i + 1}] = {h[i + 1]} < {name}[{i}] = {h[i]}")
    if h[-1] > total:      # (rows past the last entry belong to no sequence, as in flash-attn)
        raise _arg_error(ValueError, name,
                         f"last entry at most the number of packed tokens ({total})", f"{h[-1]}")
    longest = int(d.max()) if d.size else 0
    if max_seqlen is None:
        max_seqlen = longest
    if max_seqlen < longest:
        raise _arg_error(ValueError, max_seqlen_name,
                         f"at least the longest sequence in {name} ({longest})", max_seqlen)
    return cu.shape[0] - 1, max_seqlen


# ---- keys of plain option values (flashcore.api keys CuPy calls' launch plans on them) ------

_PLAIN_SCALARS = frozenset((bool, int, float, str, type(None)))


def _scalar_key(v):
    t = type(v)
    if t in _PLAIN_SCALARS or isinstance(v, np.number):
        return (t, v)
    if t is tuple or t is list:
        return (t,) + tuple(_scalar_key(e) for e in v)
    raise TypeError


def forward_spec(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, varlen=False, block_table=None, dropout_p=0.0,
                 rng_state=None, q_descale=None, k_descale=None,
                 v_descale=None) -> AttentionSpec:
    """Validate the forward arguments and return their spec. Raises TypeError/ValueError."""
    spec = _forward_spec(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, varlen=varlen, block_table=block_table)
    p = _dropout(dropout_p, rng_state, spec)
    _fp8(spec, p, (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    return spec if p == 0.0 else dataclasses.replace(spec, dropout_p=p)


def _fp8(spec, dropout_p, descales) -> None:
    """FP8 inputs: no dropout, each descale None (1.0) or a float32 array of q's library and
    device broadcastable to (batch, nheads_k), as FlashAttention-3 defines them; other inputs
    take no descale. (Which devices and options the kernels take is the backends' to say.)"""
    if spec.dtype not in FP8_DTYPES:
        for name, d in descales:
            if d is not None:
                raise _arg_error(ValueError, name, "None unless q, k and v are float8_e4m3fn",
                                 _describe(d))
        return
    if dropout_p:
        raise _arg_error(ValueError, "dropout_p", "0.0 with float8_e4m3fn inputs (FP8 attention "
                         "is forward only, for inference)", dropout_p)
    for name, d in descales:
        _check_descale(name, d, spec.library, spec.device, spec.batch, spec.nheads_k)


def _check_descale(name, d, lib, device, batch, nheads_k) -> None:
    """An FP8 descale: None (1.0), or a float32 array of library ``lib`` on ``device``
    (q's) broadcastable to (batch, nheads_k) (at most 2 dimensions)."""
    if d is None:
        return
    _check_array(name, d, None, lib, device)
    if dtype_name(d) != "float32":
        raise _arg_error(TypeError, name, "a float32 array broadcastable to (batch, nheads_k)",
                         f"dtype {dtype_name(d)}")
    if not _broadcastable(d, batch, nheads_k):
        raise _arg_error(ValueError, name, "a float32 array broadcastable to (batch, nheads_k) "
                         f"= ({batch}, {nheads_k})", f"shape {tuple(d.shape)}")


def _broadcastable(d, batch, nheads_k) -> bool:
    try:
        np.broadcast_shapes(tuple(d.shape), (batch, nheads_k))
    except ValueError:
        return False
    return len(d.shape) <= 2


def exact_descale(d, batch, nheads_k):
    """A descale as the backends take it: a contiguous float32 array of shape exactly
    ``(batch, nheads_k)`` in ``d``'s own library (``d`` itself when it is one already; None
    stays None). Anything else (a wrong dtype, shape or library) comes back unchanged, for the
    validation to name what is wrong."""
    if d is None:
        return None
    lib = library_of(d)
    if lib is None or dtype_name(d) != "float32" or not _broadcastable(d, batch, nheads_k):
        return d
    shape = (batch, nheads_k)
    if lib == "torch":
        if tuple(d.shape) == shape and d.is_contiguous():
            return d
        return d.expand(shape).contiguous()
    if tuple(d.shape) == shape and d.flags.c_contiguous:
        return d
    if lib == "cupy":
        import cupy as xp
    else:
        xp = np
    return xp.ascontiguousarray(xp.broadcast_to(d, shape))


def fp8_out_dtype(out_dtype) -> str:
    """The output dtype of a float8_e4m3fn forward: bfloat16 (None), or float16 / float32 on
    request (any spelling)."""
    if out_dtype is None:
        return "bfloat16"
    name = _dtype_spelled(out_dtype)
    if name not in ("bfloat16", "float16", "float32"):
        raise _arg_error(TypeError, "out_dtype", "None (bfloat16), bfloat16, float16 or float32 "
                         "for float8_e4m3fn inputs", repr(out_dtype))
    return name


def _dropout(dropout_p, rng_state, spec) -> float:
    """The validated drop probability; with p > 0, ``rng_state`` must be the call's random
    state: an int64 array of 2 elements (seed, offset) of q's library and device."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (numbers.Real,)):
        raise _arg_error(TypeError, "dropout_p", "a float in [0, 1)", repr(dropout_p))
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise _arg_error(ValueError, "dropout_p", "a float in [0, 1)", p)
    if p == 0.0:
        return p
    if spec.paged:
        raise _arg_error(ValueError, "dropout_p", "0.0 over a paged cache (forward-only "
                         "inference; flash-attn's rule too)", p)
    if rng_state is None:
        raise _arg_error(ValueError, "rng_state", "the call's random state with dropout_p > 0: "
                         "an int64 array (seed, offset), the same in the forward and the "
                         "backward", "None")
    _check_array("rng_state", rng_state, 1, spec.library, spec.device)
    if dtype_name(rng_state) != "int64" or int(rng_state.shape[0]) != 2:
        raise _arg_error(TypeError, "rng_state", "an int64 array of 2 elements (seed, offset)",
                         f"dtype {dtype_name(rng_state)} and shape {tuple(rng_state.shape)}")
    if strides_in_elements(rng_state) != (1,):
        raise _arg_error(ValueError, "rng_state", "a contiguous array", "a strided one")
    return p


# Varlen over a paged cache: pages of any multiple of 16 rows, as the decode's (a thread of the
# forward copies at most 16 consecutive keys of a tile, which then lie in one page).
PAGED_VARLEN_PAGE_MULTIPLE = 16


def _forward_spec(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes,
                  deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  varlen, block_table=None) -> AttentionSpec:
    paged = block_table is not None
    if paged and not varlen:
        raise _arg_error(ValueError, "block_table",
                         "None for padded (batch, seqlen, ...) inputs (a paged cache goes with "
                         "the varlen functions, as in flash-attn, or attention_with_kvcache)",
                         "an array")
    lib, device, dt = _check_q_and_kv(q, k, v, "k", "v", 3 if varlen else 4, 4 if paged else None,
                                      fp8=True)
    layout = ("(num_blocks, page_size, nheads_k, headdim) (paged, with block_table)" if paged
              else "(total, nheads, headdim)" if varlen else "(batch, seqlen, nheads, headdim)")
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

    causal = as_flag("causal", causal)
    deterministic = as_flag("deterministic", deterministic)
    left, right = _window(window_size, causal)
    softmax_scale, softcap = _scale_and_softcap(softmax_scale, softcap, headdim)

    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise _arg_error(ValueError, "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k",
                             "an int32 array of length batch+1 for varlen attention", "None")
        batch, sq = _cu_seqlens("cu_seqlens_q", cu_seqlens_q, lib, device, q.shape[0],
                                "max_seqlen_q", max_seqlen_q)
        if paged:
            page_size, num_blocks = _paged_varlen_layout(k, block_table, lib, device, batch,
                                                         layout)
            capacity = int(block_table.shape[1]) * page_size
            batch_k, sk = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, lib, device,
                                      batch * capacity, "max_seqlen_k", max_seqlen_k,
                                      capacity if max_seqlen_k is None else None)
            if sk > capacity:
                raise _arg_error(ValueError, "max_seqlen_k" if max_seqlen_k is not None else
                                 "cu_seqlens_k", f"at most the keys block_table holds per "
                                 f"sequence ({capacity})", sk)
            _check_block_values(block_table, cu_seqlens_k, page_size, num_blocks)
            total_k = batch * capacity
        else:
            page_size = num_blocks = 0
            batch_k, sk = _cu_seqlens("cu_seqlens_k", cu_seqlens_k, lib, device, k.shape[0],
                                      "max_seqlen_k", max_seqlen_k)
            total_k = k.shape[0]
        if batch_k != batch:
            raise _arg_error(ValueError, "cu_seqlens_k", f"length {batch + 1} like 'cu_seqlens_q'",
                             f"length {batch_k + 1}")
        total_q = q.shape[0]
    else:
        for n, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if x is not None:
                raise _arg_error(ValueError, n, "None for padded (batch, seqlen, ...) inputs; "
                                 "use the varlen functions for packed inputs", "an array")
        batch, sq = q.shape[0], q.shape[1]
        sk = k.shape[1]
        total_q = total_k = None
        page_size = num_blocks = 0

    alibi = _alibi_kind(alibi_slopes, lib, device, batch, nheads)

    return AttentionSpec(
        library=lib, device=device, dtype=dt, batch=int(batch), seqlen_q=int(sq),
        seqlen_k=int(sk), nheads=int(nheads), nheads_k=int(nheads_k), headdim=int(headdim),
        causal=bool(causal), window_left=left, window_right=right,
        softmax_scale=softmax_scale, softcap=softcap, alibi=alibi,
        deterministic=bool(deterministic), varlen=bool(varlen),
        total_q=total_q, total_k=total_k, page_size=int(page_size), num_blocks=int(num_blocks),
    )


def _paged_varlen_layout(k, block_table, lib, device, batch, layout):
    """(page_size, num_blocks) of a varlen call over a paged cache, its block_table checked."""
    _int32_array("block_table", block_table, 2, lib, device, "(batch, max_blocks_per_seq)")
    if int(block_table.shape[0]) != batch or int(block_table.shape[1]) < 1:
        raise _arg_error(ValueError, "block_table",
                         f"shape ({batch}, max_blocks_per_seq >= 1) (batch like 'cu_seqlens_q')",
                         f"shape {tuple(block_table.shape)}")
    num_blocks, page_size = int(k.shape[0]), int(k.shape[1])
    if page_size < PAGED_VARLEN_PAGE_MULTIPLE or page_size % PAGED_VARLEN_PAGE_MULTIPLE:
        raise _arg_error(ValueError, "k", f"{layout} with page_size a multiple of "
                         f"{PAGED_VARLEN_PAGE_MULTIPLE} (flash-attn's paged varlen takes "
                         f"multiples of 256)", f"shape {tuple(k.shape)}")
    if num_blocks < 1:
        raise _arg_error(ValueError, "k", f"{layout} with at least one block",
                         f"shape {tuple(k.shape)}")
    return page_size, num_blocks


def _check_block_values(block_table, cu_seqlens_k, page_size, num_blocks):
    """The blocks each sequence uses exist, where the values may be read (host arrays, debug
    mode); device arrays are trusted and the kernel clamps its table reads into the pool."""
    if not (_reads_values(block_table) and _reads_values(cu_seqlens_k)):
        return
    bt = np.asarray(to_host(block_table)).astype(np.int64)
    lens = np.diff(np.asarray(to_host(cu_seqlens_k)).astype(np.int64))
    used = (lens + page_size - 1) // page_size
    mask = np.arange(bt.shape[1])[None, :] < used[:, None]
    bad = mask & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise _arg_error(ValueError, "block_table",
                         f"block indices in [0, {num_blocks}) (the blocks of 'k') for every "
                         f"block a sequence uses", f"block_table[{i}, {j}] = {bt[i, j]}")


def backward_spec(dout, q, k, v, out, lse, **kw) -> AttentionSpec:
    """Validate the backward arguments: the forward's, plus dout/out like q and lse."""
    spec = forward_spec(q, k, v, **kw)
    if spec.dtype in FP8_DTYPES:
        raise _arg_error(TypeError, "q", "a floating dtype in " f"{FLOAT_DTYPES}: float8_e4m3fn "
                         "attention is forward only (as in FlashAttention-3)", f"dtype {spec.dtype}")
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


# --------------------------------------------------------------------------------------------
# Decoding with a KV cache
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVCacheSpec:
    """Shapes and options of one :func:`flashcore.attention_with_kvcache` call.

    ``attn`` describes the attention part (its ``seqlen_k`` is the cache *capacity*, the same
    from one decoding step to the next, so that backend choice stays memoised); the per-sequence
    key counts are ``cache_seqlens + seqlen_new``, known only to the call.
    """
    attn: AttentionSpec
    paged: bool
    page_size: int | None        # paged: rows per block
    num_blocks: int | None       # paged: blocks in the cache
    max_blocks: int | None       # paged: block_table.shape[1]
    capacity: int                # keys one sequence can hold
    seqlen_new: int              # rows of k/v appended (0 when k, v are None)
    rotary_dim: int              # 0 without rotary
    rotary_interleaved: bool
    num_splits: int              # 0: heuristic
    cache_seqlens_int: int | None  # cache_seqlens given as a Python int
    cache_dtype: str | None = None  # 'float8_e4m3fn' for an FP8 cache, else None (q's dtype)

    @property
    def fp8(self) -> bool:
        """Whether the cache is float8_e4m3fn (q is then float16 or bfloat16), its values
        ``k_cache * k_descale[b, key head]`` (and v likewise)."""
        return self.cache_dtype is not None

    @property
    def rotary_per_row(self) -> bool:
        """flash-attn's rule: with causal or a window, q row i is rotated at position
        ``cache_seqlens + i``; otherwise every q row sits at position ``cache_seqlens``."""
        return self.attn.causal or self.attn.is_local

    @property
    def appends(self) -> bool:
        return self.seqlen_new > 0


def _scale_and_softcap(softmax_scale, softcap, headdim):
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    softmax_scale = _as_float("softmax_scale", softmax_scale)
    if softmax_scale <= 0:
        raise _arg_error(ValueError, "softmax_scale", "a finite number > 0", softmax_scale)
    softcap = _as_float("softcap", 0.0 if softcap is None else softcap)
    if softcap < 0:
        raise _arg_error(ValueError, "softcap", "a number >= 0 (0 disables it)", softcap)
    return softmax_scale, softcap


def _alibi_kind(alibi_slopes, lib, device, batch, nheads):
    if alibi_slopes is None:
        return None
    _check_array("alibi_slopes", alibi_slopes, (1, 2), lib, device)
    if dtype_name(alibi_slopes) != "float32" and not (lib == "numpy" and dtype_name(alibi_slopes) == "float64"):
        raise _arg_error(TypeError, "alibi_slopes", "a float32 array", f"dtype {dtype_name(alibi_slopes)}")
    shp = tuple(alibi_slopes.shape)
    if shp == (nheads,):
        kind = "per_head"
    elif shp == (batch, nheads):
        kind = "per_batch_head"
    else:
        raise _arg_error(ValueError, "alibi_slopes", f"shape ({nheads},) or ({batch}, {nheads})",
                         f"shape {shp}")
    _check_last_contiguous("alibi_slopes", alibi_slopes)
    return kind


def _int32_array(name, x, ndim, lib, device, shape_desc):
    _check_array(name, x, ndim, lib, device)
    if dtype_name(x) != "int32":
        raise _arg_error(TypeError, name, f"an int32 array {shape_desc}", f"dtype {dtype_name(x)}")


def kvcache_spec(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=False, causal=False,
                 softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 num_splits=0, cache_leftpad=None, k_descale=None,
                 v_descale=None, key_mask=None) -> KVCacheSpec:
    """Validate the arguments of a KV-cache decoding call and return their spec.

    Besides shapes and dtypes, the *values* of ``cache_seqlens`` and ``block_table`` are
    checked (every append fits in the cache, every block used exists) where reading them costs
    nothing: an int, host arrays. Device arrays are read only in debug mode (flashcore.config;
    a device sync): by default the kernels clamp every address formed from them, so a bad value
    gives a wrong result and never touches memory outside the cache.

    FP8 caches (:data:`FP8_DTYPES`; on CuPy, which has no float8 dtype, uint8 arrays holding
    float8_e4m3fn bits) with float16 / bfloat16 q: read-only (no ``k``/``v`` appended), with
    ``k_descale``/``v_descale`` None or float32 broadcastable to (batch, nheads_k).
    """
    return _kvcache_spec(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, num_splits=num_splits, cache_leftpad=cache_leftpad,
        k_descale=k_descale, v_descale=v_descale, key_mask=key_mask)


#: The query dtypes that decoding over an FP8 cache takes (FlashAttention-3's FP8 KV cache
#: with 16-bit queries: the cache's values are dequantised, q is not quantised).
FP8_CACHE_Q_DTYPES = ("float16", "bfloat16")


def cache_dtype_of(x) -> str:
    """The dtype a KV cache array stands for: its own, except a CuPy uint8 array, which holds
    float8_e4m3fn bits (CuPy has no float8 dtype)."""
    dt = dtype_name(x)
    if dt == "uint8" and library_of(x) == "cupy":
        return "float8_e4m3fn"
    return dt


def _check_q_and_cache(q, k_cache, v_cache):
    """q a 4-dimensional floating array; k_cache and v_cache 4-dimensional arrays of q's
    library and device, either both of q's dtype or both FP8 (with a 16-bit q). Returns
    (library, device, q's dtype name, the cache's FP8 dtype name or None)."""
    _check_array("q", q, 4)
    lib, device = library_of(q), device_of(q)
    _check_array("k_cache", k_cache, 4, lib, device)
    _check_array("v_cache", v_cache, 4, lib, device)
    dt = dtype_name(q)
    kdt, vdt = cache_dtype_of(k_cache), cache_dtype_of(v_cache)
    if dt in FP8_DTYPES:
        raise _arg_error(TypeError, "q", f"a floating dtype in {FLOAT_DTYPES} (decoding takes "
                         "float8_e4m3fn caches with a float16 or bfloat16 q, never an FP8 q)",
                         f"dtype {dt}")
    if dt not in FLOAT_DTYPES:
        raise _arg_error(TypeError, "q", f"a floating dtype in {FLOAT_DTYPES}", f"dtype {dt}")
    if kdt not in FP8_DTYPES and vdt not in FP8_DTYPES:
        for n, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if dtype_name(x) != dt:
                raise _arg_error(TypeError, n, f"dtype {dt} like 'q'", f"dtype {dtype_name(x)}")
        return lib, device, dt, None
    if kdt != vdt:      # one FP8 cache, the other not
        raise _arg_error(TypeError, "v_cache", f"dtype {dtype_name(k_cache)} like 'k_cache' "
                         f"(k_cache and v_cache are both float8_e4m3fn, or both q's dtype {dt})",
                         f"dtype {dtype_name(v_cache)}")
    if dt not in FP8_CACHE_Q_DTYPES:
        raise _arg_error(TypeError, "q", "float16 or bfloat16 with float8_e4m3fn caches",
                         f"dtype {dt}")
    return lib, device, dt, kdt


def _kvcache_spec(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, rotary_cos,
                  rotary_sin, rotary_interleaved, causal, softmax_scale, window_size, softcap,
                  alibi_slopes, num_splits, cache_leftpad, k_descale=None,
                  v_descale=None, key_mask=None) -> KVCacheSpec:
    lib, device, dt, cache_dt = _check_q_and_cache(q, k_cache, v_cache)
    batch, sq, nheads, headdim = (int(n) for n in q.shape)
    c0, c1, nheads_k, hd_k = (int(n) for n in k_cache.shape)
    paged = block_table is not None
    layout = ("(num_blocks, page_size, nheads_k, headdim) (paged, with block_table)" if paged
              else "(batch, seqlen_cache, nheads_k, headdim)")
    if headdim < 1:
        raise _arg_error(ValueError, "q", "(batch, seqlen_q, nheads, headdim) with headdim >= 1",
                         f"shape {tuple(q.shape)}")
    if nheads < 1:
        raise _arg_error(ValueError, "q", "at least one head", f"shape {tuple(q.shape)}")
    if nheads_k < 1:
        raise _arg_error(ValueError, "k_cache", "at least one head", f"shape {tuple(k_cache.shape)}")
    if hd_k != headdim:
        raise _arg_error(ValueError, "k_cache", f"{layout} with headdim {headdim} like 'q'",
                         f"shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise _arg_error(ValueError, "v_cache", f"the shape of 'k_cache' {tuple(k_cache.shape)}",
                         f"shape {tuple(v_cache.shape)}")
    if nheads % nheads_k:
        raise _arg_error(ValueError, "k_cache",
                         f"a number of heads that divides the {nheads} query heads (MQA/GQA)",
                         f"{nheads_k} heads")
    for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_last_contiguous(n, x)

    # -- the cache layout --------------------------------------------------------------------
    if paged:
        _int32_array("block_table", block_table, 2, lib, device, "(batch, max_blocks_per_seq)")
        if int(block_table.shape[0]) != batch or int(block_table.shape[1]) < 1:
            raise _arg_error(ValueError, "block_table",
                             f"shape ({batch}, max_blocks_per_seq >= 1) (batch like 'q')",
                             f"shape {tuple(block_table.shape)}")
        num_blocks, page_size, max_blocks = c0, c1, int(block_table.shape[1])
        if page_size < 16 or page_size % 16:
            raise _arg_error(ValueError, "k_cache",
                             f"{layout} with page_size a multiple of 16",
                             f"page_size {page_size} (shape {tuple(k_cache.shape)})")
        if num_blocks < 1:
            raise _arg_error(ValueError, "k_cache", f"{layout} with at least one block",
                             f"shape {tuple(k_cache.shape)}")
        capacity = max_blocks * page_size
    else:
        if c0 != batch:
            raise _arg_error(ValueError, "k_cache", f"{layout} with batch {batch} like 'q' "
                             "(slice a larger cache: a view is still updated in place)",
                             f"shape {tuple(k_cache.shape)}")
        num_blocks = page_size = max_blocks = None
        capacity = c1

    # -- FP8 caches: their descales (16-bit caches take none) --------------------------------
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if cache_dt is None:
            if d is not None:
                raise _arg_error(ValueError, name, "None unless k_cache and v_cache are "
                                 "float8_e4m3fn (the descales of an FP8 cache)", _describe(d))
        else:
            _check_descale(name, d, lib, device, batch, nheads_k)

    # -- new keys and values -----------------------------------------------------------------
    if (k is None) != (v is None):
        missing, given = ("v", "k") if v is None else ("k", "v")
        raise _arg_error(ValueError, missing, f"an array when '{given}' is given (both or neither)",
                         "None")
    if cache_dt is not None and k is not None:
        raise _arg_error(ValueError, "k", "None with float8_e4m3fn caches (nothing is appended "
                         "to an FP8 cache: quantise the new keys and values and write them into "
                         "the cache yourself, then advance cache_seqlens)", _describe(k))
    seqlen_new = 0
    if k is not None:
        _check_array("k", k, 4, lib, device)
        _check_array("v", v, 4, lib, device)
        for n, x in (("k", k), ("v", v)):
            if dtype_name(x) != dt:
                raise _arg_error(TypeError, n, f"dtype {dt} like 'q'", f"dtype {dtype_name(x)}")
        kb, seqlen_new, kh, kd = (int(n) for n in k.shape)
        if kb != batch or kh != nheads_k or kd != headdim:
            raise _arg_error(ValueError, "k", f"shape ({batch}, seqlen_new, {nheads_k}, {headdim}) "
                             "(batch like 'q', heads and headdim like 'k_cache')",
                             f"shape {tuple(k.shape)}")
        if tuple(v.shape) != tuple(k.shape):
            raise _arg_error(ValueError, "v", f"the shape of 'k' {tuple(k.shape)}",
                             f"shape {tuple(v.shape)}")
        for n, x in (("k", k), ("v", v)):
            _check_last_contiguous(n, x)

    # -- cache_seqlens -----------------------------------------------------------------------
    seqlens_int = None
    if cache_seqlens is None:
        raise _arg_error(ValueError, "cache_seqlens",
                         f"an int or an int32 array of shape ({batch},): the cached lengths", "None")
    if library_of(cache_seqlens) is None:
        seqlens_int = _as_int("cache_seqlens", cache_seqlens, 0)
    else:
        _int32_array("cache_seqlens", cache_seqlens, 1, lib, device, f"of shape ({batch},)")
        if tuple(cache_seqlens.shape) != (batch,):
            raise _arg_error(ValueError, "cache_seqlens", f"shape ({batch},) (batch like 'q')",
                             f"shape {tuple(cache_seqlens.shape)}")

    # -- cache_leftpad: sequence b's keys start at row cache_leftpad[b] of its cache ----------
    if cache_leftpad is not None:
        _int32_array("cache_leftpad", cache_leftpad, 1, lib, device, f"of shape ({batch},)")
        if tuple(cache_leftpad.shape) != (batch,):
            raise _arg_error(ValueError, "cache_leftpad", f"shape ({batch},) (batch like 'q')",
                             f"shape {tuple(cache_leftpad.shape)}")
        if paged:
            raise _arg_error(ValueError, "cache_leftpad",
                             "None with a paged cache (block_table given; flash-attn's rule)",
                             "an array")
        _check_last_contiguous("cache_leftpad", cache_leftpad)

    # -- key_mask: key t of sequence b attended only where key_mask[b, t] ------------------
    if key_mask is not None:
        _check_array("key_mask", key_mask, 2, lib, device)
        if dtype_name(key_mask) != "bool":
            raise _arg_error(TypeError, "key_mask", f"a bool array of shape ({batch}, "
                             f"{capacity})", f"dtype {dtype_name(key_mask)}")
        if tuple(key_mask.shape) != (batch, capacity):
            where = "max_blocks * page_size" if paged else "seqlen_cache of 'k_cache'"
            raise _arg_error(ValueError, "key_mask", f"shape ({batch}, {capacity}): (batch like "
                             f"'q', the cache capacity {where})",
                             f"shape {tuple(key_mask.shape)}")
        _check_last_contiguous("key_mask", key_mask)

    # -- rotary ------------------------------------------------------------------------------
    rotary_interleaved = as_flag("rotary_interleaved", rotary_interleaved)
    rotary_dim = 0
    if (rotary_cos is None) != (rotary_sin is None):
        missing, given = (("rotary_sin", "rotary_cos") if rotary_sin is None
                          else ("rotary_cos", "rotary_sin"))
        raise _arg_error(ValueError, missing, f"an array when '{given}' is given (both or neither)",
                         "None")
    seqlen_ro = None
    if rotary_cos is not None:
        if k is None:
            raise _arg_error(ValueError, "rotary_cos",
                             "None when no new 'k'/'v' are appended (rotary applies to the new "
                             "keys and to q)", "an array")
        for n, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_array(n, x, 2, lib, device)
            if dtype_name(x) != dt:
                raise _arg_error(TypeError, n, f"dtype {dt} like 'q'", f"dtype {dtype_name(x)}")
            _check_last_contiguous(n, x)
        seqlen_ro, half = (int(n) for n in rotary_cos.shape)
        if tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
            raise _arg_error(ValueError, "rotary_sin", f"the shape of 'rotary_cos' "
                             f"{tuple(rotary_cos.shape)}", f"shape {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * half
        if rotary_dim < 16 or rotary_dim % 16 or rotary_dim > headdim:
            raise _arg_error(ValueError, "rotary_cos",
                             f"shape (seqlen_ro, rotary_dim / 2) with rotary_dim a multiple of 16 "
                             f"and at most headdim {headdim}",
                             f"shape {tuple(rotary_cos.shape)} (rotary_dim {rotary_dim})")

    # -- options -----------------------------------------------------------------------------
    causal = as_flag("causal", causal)
    left, right = _window(window_size, causal)
    softmax_scale, softcap = _scale_and_softcap(softmax_scale, softcap, headdim)
    alibi = _alibi_kind(alibi_slopes, lib, device, batch, nheads)
    num_splits = _as_int("num_splits", num_splits, 0)

    # -- values: every append fits, every block used exists (where they are read) ------------
    if seqlens_int is not None or _reads_values(cache_seqlens):
        if seqlens_int is not None:
            before = np.full((batch,), seqlens_int, np.int64)
        else:
            before = np.asarray(to_host(cache_seqlens)).astype(np.int64)
            if (before < 0).any():
                i = int(np.argmax(before < 0))
                raise _arg_error(ValueError, "cache_seqlens", "lengths >= 0",
                                 f"cache_seqlens[{i}] = {before[i]}")
        after = before + seqlen_new
        if batch and (after > capacity).any():
            i = int(np.argmax(after > capacity))
            where = (f"{max_blocks} blocks of {page_size} in 'block_table'" if paged
                     else "seqlen_cache of 'k_cache'")
            raise _arg_error(ValueError, "cache_seqlens",
                             f"cache_seqlens + seqlen_new <= the cache capacity {capacity} "
                             f"({where})",
                             f"sequence {i}: {before[i]} cached + {seqlen_new} new = {after[i]}")
        if cache_leftpad is not None and _reads_values(cache_leftpad) and batch:
            lp = np.asarray(to_host(cache_leftpad)).astype(np.int64)
            bad = (lp < 0) | (lp > before)
            if bad.any():
                i = int(np.argmax(bad))
                raise _arg_error(ValueError, "cache_leftpad",
                                 "0 <= cache_leftpad[b] <= cache_seqlens[b]",
                                 f"cache_leftpad[{i}] = {lp[i]} (cache_seqlens[{i}] = {before[i]})")
        if seqlen_ro is not None and batch and seqlen_ro < int(after.max()):
            raise _arg_error(ValueError, "rotary_cos",
                             f"at least {int(after.max())} rows (positions up to "
                             f"max(cache_seqlens + seqlen_new) - 1)",
                             f"shape {tuple(rotary_cos.shape)}")
        if paged and batch and _reads_values(block_table):
            bt = np.asarray(to_host(block_table)).astype(np.int64)
            used = (after + page_size - 1) // page_size       # blocks each sequence touches
            mask = np.arange(max_blocks)[None, :] < used[:, None]
            bad = mask & ((bt < 0) | (bt >= num_blocks))
            if bad.any():
                i, j = (int(x) for x in np.argwhere(bad)[0])
                raise _arg_error(ValueError, "block_table",
                                 f"block indices in [0, {num_blocks}) (the blocks of 'k_cache') "
                                 f"for every block a sequence uses",
                                 f"block_table[{i}, {j}] = {bt[i, j]}")

    attn = AttentionSpec(
        library=lib, device=device, dtype=dt, batch=batch, seqlen_q=sq, seqlen_k=int(capacity),
        nheads=nheads, nheads_k=nheads_k, headdim=headdim, causal=bool(causal),
        window_left=left, window_right=right, softmax_scale=softmax_scale, softcap=softcap,
        alibi=alibi, deterministic=True, varlen=False)
    return KVCacheSpec(
        attn=attn, paged=paged, page_size=page_size, num_blocks=num_blocks,
        max_blocks=max_blocks, capacity=int(capacity), seqlen_new=seqlen_new,
        rotary_dim=rotary_dim, rotary_interleaved=bool(rotary_interleaved),
        num_splits=num_splits, cache_seqlens_int=seqlens_int, cache_dtype=cache_dt)


# --------------------------------------------------------------------------------------------
# Caller-owned outputs (CuPy: the outputs of a call captured in a CUDA graph)
# --------------------------------------------------------------------------------------------

def _dtype_spelled(out_dtype) -> str | None:
    """The name of a dtype however it is spelled ("float32", numpy's, torch's: no torch import
    here; "bfloat16" without ml_dtypes), or None."""
    name = str(out_dtype)
    if name.startswith("torch."):
        return name[len("torch."):]
    if name == "bfloat16":
        return name
    try:
        return np.dtype(out_dtype).name
    except TypeError:
        return None


def out_fp32(out_dtype, dtype: str) -> bool:
    """Whether a forward with ``out_dtype`` writes its output in float32 over ``dtype`` inputs:
    ``out_dtype`` None (the inputs' dtype) or float32 (any spelling: "float32", numpy's,
    torch's), which keeps 16-bit inputs' outputs unrounded (partial results that are merged
    through their lse, as ring attention does)."""
    if out_dtype is None:
        return False
    if _dtype_spelled(out_dtype) != "float32":
        raise _arg_error(TypeError, "out_dtype", "None or float32", repr(out_dtype))
    if dtype == "float64":
        raise _arg_error(ValueError, "out_dtype", "None for float64 inputs (float32 would round "
                         "them)", repr(out_dtype))
    return dtype in ("float16", "bfloat16")


def check_outputs(spec: AttentionSpec, given: dict, expected: dict,
                  fp32_out: bool = False) -> dict:
    """Validate preallocated outputs ``given`` {name: array or None} against ``expected``
    {name: (shape, dtype name)}: arrays of the call's library (CuPy only), device, shape and
    dtype, with a contiguous last dimension (lse: C-contiguous). Returns the given ones."""
    given = {n: x for n, x in given.items() if x is not None}
    if given and spec.library != "cupy":
        n = next(iter(given))
        raise _arg_error(TypeError, n, "None: preallocated outputs are for CuPy arrays (a CuPy "
                         "graph capture needs its outputs to outlive it; torch.cuda.graph serves "
                         "them from its own pool)", f"an array with {spec.library} inputs")
    for n, x in given.items():
        shape, dt = expected[n]
        _check_array(n, x, len(shape), spec.library, spec.device)
        if fp32_out and n == "out" and dt in ("float16", "bfloat16") \
                and dtype_name(x) == "float32":
            dt = "float32"        # (the forward's unrounded float32 output, see out_fp32)
        if tuple(x.shape) != tuple(shape) or dtype_name(x) != dt:
            raise _arg_error(ValueError, n, f"an array of shape {tuple(shape)} and dtype {dt}",
                             f"shape {tuple(x.shape)} and dtype {dtype_name(x)}")
        if n == "lse" and not x.flags.c_contiguous:
            raise _arg_error(ValueError, n, "a C-contiguous array", f"strides {x.strides}")
        _check_last_contiguous(n, x)
    return given


# --------------------------------------------------------------------------------------------
# Merging partial attention results
# --------------------------------------------------------------------------------------------

def merge_spec(outs, lses):
    """Validate :func:`flashcore.merge_attention_states` arguments.

    Returns ``(library, outs, lses)`` with ``outs``/``lses`` as lists of arrays. Each out is
    ``(..., seqlen, nheads, headdim)`` and its lse ``(..., nheads, seqlen)``: ``(b, sq, h, d)``
    with ``(b, h, sq)``, or packed ``(total, h, d)`` with ``(h, total)``.
    """
    def as_list(name, x):
        if library_of(x) is not None:
            if x.ndim < 1 or x.shape[0] < 1:
                raise _arg_error(ValueError, name, "a non-empty stack (n, ...) of partial results",
                                 f"shape {tuple(x.shape)}")
            return [x[i] for i in range(x.shape[0])]
        if isinstance(x, (list, tuple)):
            if not x:
                raise _arg_error(ValueError, name, "at least one partial result", "an empty sequence")
            return list(x)
        raise _arg_error(TypeError, name, "a list of arrays or one stacked array",
                         type(x).__name__)

    outs, lses = as_list("outs", outs), as_list("lses", lses)
    if len(outs) != len(lses):
        raise _arg_error(ValueError, "lses", f"{len(outs)} partial results like 'outs'",
                         f"{len(lses)}")
    _check_array("outs[0]", outs[0], (3, 4))
    lib, device = library_of(outs[0]), device_of(outs[0])
    shape, dt = tuple(outs[0].shape), dtype_name(outs[0])
    if dt not in FLOAT_DTYPES:
        raise _arg_error(TypeError, "outs[0]", f"a floating dtype in {FLOAT_DTYPES}", f"dtype {dt}")
    want = shape[:-3] + (shape[-2], shape[-3])
    for i, (o, l) in enumerate(zip(outs, lses)):
        _check_array(f"outs[{i}]", o, len(shape), lib, device, like="outs[0]")
        if tuple(o.shape) != shape:
            raise _arg_error(ValueError, f"outs[{i}]", f"shape {shape} like 'outs[0]'",
                             f"shape {tuple(o.shape)}")
        if dtype_name(o) != dt:
            raise _arg_error(TypeError, f"outs[{i}]", f"dtype {dt} like 'outs[0]'",
                             f"dtype {dtype_name(o)}")
        _check_array(f"lses[{i}]", l, len(want), lib, device, like="outs[0]")
        if tuple(l.shape) != want:
            raise _arg_error(ValueError, f"lses[{i}]",
                             f"shape {want} (nheads before seqlen, like the forward's lse)",
                             f"shape {tuple(l.shape)}")
        if dtype_name(l) not in ("float32", "float64"):
            raise _arg_error(TypeError, f"lses[{i}]", "dtype float32 (or float64)",
                             f"dtype {dtype_name(l)}")
    return lib, outs, lses
