"""The device layer: what the launchers need from the CUDA runtime and from the caller's array
library, without importing CuPy on torch's calls (compiles aside).

The launchers are written in CuPy's array idiom (``xp.empty``, ``a.data.ptr``, strides in
bytes, NumPy dtypes). CuPy arrays go to them as they are, with the ``cupy`` module as their
namespace; torch CUDA tensors go wrapped in :class:`TorchArray`, which answers the same few
attributes from the tensor, with :data:`TORCH` as their namespace: it allocates through torch
(its caching allocator on its current stream, a CUDA graph's private pool under capture).
:func:`lib_of` gives an array's namespace and :func:`current_stream` the stream its library
launches on (CuPy's current stream, or torch's).

Every CUDA call goes to the driver through ctypes prototypes of its C signature
(:class:`_Driver`): the current device and context, device attributes, module loading, launches,
function attributes. CuPy's low-level bindings would import ``cupy`` at the first call of each
(their library loader logs through it; session 16, docs/performance-log.md), and torch has no
public launch call. Compiling a kernel still imports CuPy (NVRTC's bindings, :mod:`flashcore.jit`).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["driver", "libcuda", "CUDADriverError", "scope", "current_device", "lib_of",
           "current_stream", "TorchArray", "TORCH"]


class CUDADriverError(RuntimeError):
    """A CUDA driver call failed; ``status`` is its CUresult."""

    def __init__(self, status: int, call: str):
        super().__init__(f"{call} failed: CUDA driver error {status}")
        self.status = status


_P = ctypes.c_void_p
_U = ctypes.c_uint
_I = ctypes.c_int

# CUdevice_attribute values (cuda.h)
ATTR_MULTIPROCESSOR_COUNT = 16
ATTR_CC_MAJOR, ATTR_CC_MINOR = 75, 76
ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
ATTR_MEMORY_CLOCK_RATE, ATTR_GLOBAL_MEMORY_BUS_WIDTH = 36, 37   # kHz (peak), bits


class _Driver:
    """The CUDA driver calls flashcore makes, through ctypes prototypes of their C signatures.
    A failed call raises :class:`CUDADriverError`. ``launch`` is ``cuLaunchKernel`` itself,
    returning its CUresult (the hot path checks it)."""

    _PROTOS = {
        "cuInit": (_U,),
        "cuDeviceGetCount": (ctypes.POINTER(_I),),
        "cuDeviceGetAttribute": (ctypes.POINTER(_I), _I, _I),
        "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_P), _I),
        "cuCtxGetCurrent": (_P,),               # (CUcontext*, passed as an address)
        "cuCtxSetCurrent": (_P,),
        "cuCtxGetDevice": (ctypes.POINTER(_I),),
        "cuModuleLoadData": (ctypes.POINTER(_P), _P),
        "cuModuleGetFunction": (ctypes.POINTER(_P), _P, ctypes.c_char_p),
        "cuLaunchKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
        "cuFuncSetAttribute": (_P, _I, _I),
        "cuFuncGetAttribute": (ctypes.POINTER(_I), _I, _P),
    }

    def __init__(self, lib=None):
        lib = libcuda() if lib is None else lib
        self._fn = {name: ctypes.CFUNCTYPE(_I, *args)((name, lib))
                    for name, args in self._PROTOS.items()}
        self.launch = self._fn["cuLaunchKernel"]
        self._primary: dict = {}          # device -> its primary context (retained once)
        self._call("cuInit", 0)

    def _call(self, name, *args):
        rc = self._fn[name](*args)
        if rc != 0:
            raise CUDADriverError(rc, name)

    def _int(self, name, *args) -> int:
        out = _I()
        self._call(name, ctypes.byref(out), *args)
        return out.value

    def device_count(self) -> int:
        return self._int("cuDeviceGetCount")

    def device_attribute(self, attribute: int, device_id: int) -> int:
        return self._int("cuDeviceGetAttribute", attribute, device_id)

    def primary_context(self, device_id: int) -> int:
        """The device's primary context (the one the runtime, torch and CuPy use)."""
        ctx = self._primary.get(device_id)
        if ctx is None:
            c = _P()
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(c), device_id)
            ctx = self._primary.setdefault(device_id, c.value)
        return ctx

    def current_context(self) -> int:
        """The calling thread's current context (0: none)."""
        ctx = _P()
        self._call("cuCtxGetCurrent", ctypes.addressof(ctx))
        return ctx.value or 0

    def set_current_context(self, ctx: int) -> None:
        self._call("cuCtxSetCurrent", ctx or None)

    def current_device(self) -> int:
        """The current context's device; 0 on a thread with none (as the runtime answers)."""
        if not self.current_context():
            return 0
        return self._int("cuCtxGetDevice")

    def load_module(self, image: bytes) -> int:
        module = _P()
        buf = ctypes.create_string_buffer(image, len(image))
        self._call("cuModuleLoadData", ctypes.byref(module), ctypes.cast(buf, _P))
        return module.value

    def get_function(self, module: int, name: str) -> int:
        function = _P()
        self._call("cuModuleGetFunction", ctypes.byref(function), module, name.encode())
        return function.value

    def launch_kernel(self, f, gx, gy, gz, bx, by, bz, shared_mem, stream, params):
        rc = self.launch(f, gx, gy, gz, bx, by, bz, shared_mem, stream or None, params, None)
        if rc != 0:
            raise CUDADriverError(rc, "cuLaunchKernel")

    def set_function_attribute(self, f, attribute: int, value: int) -> None:
        self._call("cuFuncSetAttribute", f, attribute, value)

    def function_attribute(self, attribute: int, f) -> int:
        return self._int("cuFuncGetAttribute", attribute, f)


@functools.lru_cache(maxsize=None)
def libcuda():
    """The CUDA driver library (ctypes)."""
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def driver() -> _Driver:
    """The CUDA driver calls (:class:`_Driver`), made once (``cuInit`` with them)."""
    return _Driver()


def current_device() -> int:
    return driver().current_device()


class scope:
    """``with scope(device_id):`` that device's primary context current for the block (the
    one the runtime, CuPy and torch share), the previous context restored after (a thread
    that had none keeps it); None: the current device, untouched."""

    __slots__ = ("ctx", "prev")

    def __init__(self, device_id):
        self.ctx = None if device_id is None else driver().primary_context(int(device_id))

    def __enter__(self):
        if self.ctx is not None:
            drv = driver()
            self.prev = drv.current_context()
            if self.prev != self.ctx:
                drv.set_current_context(self.ctx)
        return self

    def __exit__(self, *exc):
        # (a thread that had no context keeps this one, as cudaSetDevice leaves it: torch's
        # autograd threads start with none, and unbinding it would send every later call on
        # them down the full path: plans.enter)
        if self.ctx is not None and self.prev != self.ctx and self.prev:
            driver().set_current_context(self.prev)
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
        return torch.device("cuda", current_device())

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
