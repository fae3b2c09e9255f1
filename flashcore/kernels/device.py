"""The device layer: what the launchers need from the CUDA runtime and from the caller's array
library, without importing CuPy on torch's calls (compiles aside).

The launchers are written in CuPy's array idiom (``xp.empty``, ``a.data.ptr``, strides in
bytes, NumPy dtypes). CuPy arrays go to them as they are, with the ``cupy`` module as their
namespace; torch CUDA tensors go wrapped in :class:`TorchArray`, which answers the same few
attributes from the tensor, with :data:`TORCH` as their namespace: it allocates through torch
(its caching allocator on its current stream, a CUDA graph's private pool under capture).
:func:`lib_of` gives an array's namespace and :func:`current_stream` the stream its library
launches on (CuPy's current stream, or torch's).

The driver calls (module loading, launches, the current context, function attributes) go
through ctypes prototypes of their C signatures (:class:`_Driver`): CuPy's low-level bindings
import ``cupy`` at the first call of each (their library loader logs through it; session 16,
docs/performance-log.md). The runtime calls (the current device, device attributes) go through
``cupy_backends.cuda.api.runtime``. Compiling a kernel still imports CuPy (NVRTC's bindings).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["runtime", "driver", "libcuda", "CUDADriverError", "scope", "current_device",
           "lib_of", "current_stream",
           "TorchArray", "TORCH"]


@functools.lru_cache(maxsize=None)
def runtime():
    """The CUDA runtime bindings (``cupy_backends.cuda.api.runtime``)."""
    from cupy_backends.cuda.api import runtime as rt
    return rt


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed; ``status`` is its CUresult."""

    def __init__(self, status: int, call: str):
        super().__init__(f"{call} failed: CUDA driver error {status}")
        self.status = status


_P = ctypes.c_void_p
_U = ctypes.c_uint


class _Driver:
    """The CUDA driver calls flashcore makes, through ctypes prototypes of their C signatures
    (``cupy_backends``' bindings would import ``cupy`` at their first call: their library
    loader logs through it). Method names and arguments as CuPy's bindings have them."""

    CUDADriverError = CUDADriverError
    _PROTOS = {
        "cuModuleLoadData": (ctypes.POINTER(_P), _P),
        "cuModuleGetFunction": (ctypes.POINTER(_P), _P, ctypes.c_char_p),
        "cuLaunchKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
        "cuCtxGetCurrent": (ctypes.POINTER(_P),),
        "cuFuncSetAttribute": (_P, ctypes.c_int, ctypes.c_int),
        "cuFuncGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, _P),
    }

    def __init__(self, lib=None):
        lib = libcuda() if lib is None else lib
        self._fn = {name: ctypes.CFUNCTYPE(ctypes.c_int, *args)((name, lib))
                    for name, args in self._PROTOS.items()}

    def _call(self, name, *args):
        rc = self._fn[name](*args)
        if rc != 0:
            raise CUDADriverError(rc, name)

    def moduleLoadData(self, image: bytes) -> int:
        module = _P()
        buf = ctypes.create_string_buffer(image, len(image))
        self._call("cuModuleLoadData", ctypes.byref(module), ctypes.cast(buf, _P))
        return module.value

    def moduleGetFunction(self, module: int, name: str) -> int:
        function = _P()
        self._call("cuModuleGetFunction", ctypes.byref(function), module, name.encode())
        return function.value

    def launchKernel(self, f, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
        self._call("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, shared_mem, stream or None,
                   params, extra or None)

    def ctxGetCurrent(self) -> int:
        ctx = _P()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        return ctx.value or 0

    def funcSetAttribute(self, f, attribute: int, value: int) -> None:
        self._call("cuFuncSetAttribute", f, attribute, value)

    def funcGetAttribute(self, attribute: int, f) -> int:
        out = ctypes.c_int()
        self._call("cuFuncGetAttribute", ctypes.byref(out), attribute, f)
        return out.value


@functools.lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library (ctypes)."""
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def driver() -> _Driver:
    """The CUDA driver calls (:class:`_Driver`), made once."""
    return _Driver()


def current_device() -> int:
    return runtime().getDevice()


class scope:
    """``with scope(device_id):`` that device current for the block (the runtime's, which CuPy
    and torch share: its primary context), the previous one restored after; None: the current
    device, untouched."""

    __slots__ = ("dev", "prev")

    def __init__(self, device_id):
        self.dev = None if device_id is None else int(device_id)

    def __enter__(self):
        if self.dev is not None:
            rt = runtime()
            self.prev = rt.getDevice()
            rt.setDevice(self.dev)   # (always: it also makes the primary context current on
        return self                  # a thread that has not used the runtime yet)

    def __exit__(self, *exc):
        if self.dev is not None and self.prev != self.dev:
            runtime().setDevice(self.prev)
        return False


# --------------------------------------------------------------------------------------------
# torch tensors in CuPy's idiom
# --------------------------------------------------------------------------------------------

_TORCH_OF_NP: dict = {}      # NumPy dtype -> torch dtype
_NP_OF_TORCH: dict = {}      # torch dtype -> NumPy dtype


def _dtype_tables():
    import torch
    pairs = [(np.float16, torch.float16), (np.float32, torch.float32),
             (np.float64, torch.float64), (np.int32, torch.int32), (np.int64, torch.int64),
             (np.uint8, torch.uint8), (np.int8, torch.int8), (np.bool_, torch.bool)]
    try:
        import ml_dtypes
        pairs.append((ml_dtypes.bfloat16, torch.bfloat16))
    except ImportError:      # (bfloat16 tensors are then refused by the torch backend)
        pass
    for n, t in pairs:
        _TORCH_OF_NP[np.dtype(n)] = t
        _NP_OF_TORCH[t] = np.dtype(n)


def torch_dtype(dtype):
    if not _TORCH_OF_NP:
        _dtype_tables()
    try:
        return _TORCH_OF_NP[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no torch dtype for {dtype!r}") from None


def numpy_dtype(tdtype):
    """The NumPy dtype of a torch dtype, or None (bfloat16 through ml_dtypes)."""
    if not _NP_OF_TORCH:
        _dtype_tables()
    return _NP_OF_TORCH.get(tdtype)


def _unwrap(x):
    if type(x) is TorchArray:
        return x.t
    if isinstance(x, tuple):
        return tuple(_unwrap(i) for i in x)
    if isinstance(x, np.generic):
        return x.item()
    return x


class TorchArray:
    """A torch CUDA tensor ``t`` as the launchers read an array: ``shape``, ``dtype`` (NumPy),
    ``strides`` (bytes), ``size``, ``nbytes``, ``ndim``, ``data.ptr``, ``flags.c_contiguous``,
    ``device.id``; ``view``/``astype``/``reshape``, indexing, assignment and the arithmetic
    that the rotary reference uses. Results are TorchArrays over torch's results. (``data``,
    ``flags`` and ``device`` are the object itself, which has ``ptr``, ``c_contiguous`` and
    ``id``.)"""

    __slots__ = ("t", "dtype")

    def __init__(self, t, dtype=None):
        self.t = t
        self.dtype = dtype if dtype is not None else numpy_dtype(t.dtype)

    shape = property(lambda self: tuple(self.t.shape))
    strides = property(lambda self: tuple(s * self.dtype.itemsize for s in self.t.stride()))
    size = property(lambda self: self.t.numel())
    nbytes = property(lambda self: self.t.numel() * self.dtype.itemsize)
    ndim = property(lambda self: self.t.dim())
    ptr = property(lambda self: self.t.data_ptr())
    c_contiguous = property(lambda self: self.t.is_contiguous())
    id = property(lambda self: self.t.device.index)
    data = flags = device = property(lambda self: self)

    def view(self, dtype):
        return TorchArray(self.t.view(torch_dtype(dtype)), np.dtype(dtype))

    def astype(self, dtype):
        return TorchArray(self.t.to(torch_dtype(dtype)), np.dtype(dtype))

    def reshape(self, *shape):
        return TorchArray(self.t.reshape(*_unwrap(shape)), self.dtype)

    def __getitem__(self, idx):
        return TorchArray(self.t[_unwrap(idx)])

    def __setitem__(self, idx, value):
        self.t[_unwrap(idx)] = _unwrap(value)

    def __add__(self, o):
        return TorchArray(self.t + _unwrap(o))

    __radd__ = __add__

    def __sub__(self, o):
        return TorchArray(self.t - _unwrap(o))

    def __mul__(self, o):
        return TorchArray(self.t * _unwrap(o))

    __rmul__ = __mul__

    def __repr__(self):
        return f"TorchArray({self.t!r})"


class _TorchLib:
    """The namespace of :class:`TorchArray`: the few CuPy functions the launchers call, made
    on the current device by torch."""

    int32, int64, uint8 = (np.dtype(x) for x in (np.int32, np.int64, np.uint8))
    float32, float64 = np.dtype(np.float32), np.dtype(np.float64)
    inf = float("inf")

    @staticmethod
    def _device():
        import torch
        return torch.device("cuda", runtime().getDevice())

    def empty(self, shape, dtype=np.float32):
        import torch
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        return TorchArray(torch.empty(shape, dtype=torch_dtype(dtype), device=self._device()),
                          np.dtype(dtype))

    def zeros(self, shape, dtype=np.float32):
        a = self.empty(shape, dtype)
        a.t.zero_()
        return a

    def full(self, shape, value, dtype=np.float32):
        a = self.empty(shape, dtype)
        a.t.fill_(_unwrap(value))
        return a

    def empty_like(self, a):
        import torch
        return TorchArray(torch.empty_like(a.t), a.dtype)

    def ascontiguousarray(self, a, dtype=None):
        """``a`` itself when it is contiguous and of ``dtype`` already (as CuPy's)."""
        dtype = a.dtype if dtype is None else np.dtype(dtype)
        if dtype == a.dtype and a.t.is_contiguous():
            return a
        return TorchArray(a.t.to(torch_dtype(dtype)).contiguous(), dtype)

    def broadcast_to(self, a, shape):
        return TorchArray(a.t.expand(*shape), a.dtype)

    def stack(self, arrays, axis=0):
        import torch
        return TorchArray(torch.stack([a.t for a in arrays], dim=axis))

    def concatenate(self, arrays, axis=0):
        import torch
        return TorchArray(torch.cat([a.t for a in arrays], dim=axis))


TORCH = _TorchLib()


def lib_of(a):
    """The namespace of a launcher's array: :data:`TORCH` for a :class:`TorchArray`, else the
    ``cupy`` module."""
    if type(a) is TorchArray:
        return TORCH
    import cupy
    return cupy


_TORCH_STREAM: list = []


def torch_stream_getter():
    """``index -> handle`` of torch's current stream on that device (torch's own fast accessor,
    the one its compiled code uses, where this torch has it)."""
    if _TORCH_STREAM:
        return _TORCH_STREAM[0]
    import torch
    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _TORCH_STREAM.append(f if f is not None else
                         (lambda i: torch.cuda.current_stream(i).cuda_stream))
    return _TORCH_STREAM[0]


def current_stream(xp, device_id: int) -> int:
    """The handle of the stream that namespace ``xp``'s library launches on, on ``device_id``."""
    if xp is TORCH:
        return torch_stream_getter()(device_id)
    return xp.cuda.get_current_stream(device_id).ptr
