"""Launch plans (flashcore/kernels/plans.py) replay exactly what the full launchers do.

Runs without a GPU: the kernels are stand-ins that record each launch (name, grid, block,
shared memory, the struct's bytes), ``cuLaunchKernel`` is a stand-in that records the same of a
replay, the arrays are CuPy arrays over made-up addresses, and the device queries are answered
for an H200. The calls here play the part of the API's call sites (key a call by its layouts,
replay its plan, else run it in full and record it). For random layouts and options, the
launches of a replayed call must equal those of a full run of the launcher with the same
arrays, byte for byte, except the addresses of the per-call scratch buffers."""
from __future__ import annotations

import ctypes
import itertools
import struct

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from flashcore import config, jit  # noqa: E402
from flashcore.kernels import backward, device, forward, plans, tma  # noqa: E402
from flashcore.kernels.params import params_dtype  # noqa: E402

LOG: list = []
_NEXT = itertools.count(1)
STREAM = {"ptr": 0x7000}     # the fake current stream's handle (decode counters are per stream)


FUNCTIONS: dict = {}    # CUfunction stand-in -> kernel name


class FakeDriver:
    """flashcore.kernels.device.driver()'s stand-in: the calls the launchers and plans make."""

    @staticmethod
    def set_function_attribute(*a):
        pass


DRIVER = FakeDriver()


class FakeKernel:
    def __init__(self, name):
        self.name = name
        self.ptr = 0xF000 + 16 * len(FUNCTIONS)
        FUNCTIONS[self.ptr] = name

    def set_attribute(self, attribute, value):
        DRIVER.set_function_attribute(self.ptr, attribute, value)

    def __call__(self, grid, block, args, shared_mem=0, stream=0):
        assert stream == STREAM["ptr"]
        assert len(args) == (2 if _n_maps(self.name) else 1)     # the struct (and the maps)
        LOG.append((self.name, plans._dim3(grid), plans._dim3(block), shared_mem,
                    b"".join(bytes(a.tobytes()) for a in args)))


def _n_maps(name):
    """Tensor maps a kernel takes after the struct (the warp-specialised Hopper kernels, the
    FP8 forward among them: q, k, v and the output's, or q's again, in the forward; four in the
    backward)."""
    ws = any(t in name for t in ("_ws_kernel", "_d256_kernel", "_fp8_kernel"))
    return 4 if ws else 0


def fake_launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """cuLaunchKernel's stand-in (``driver().launch``, returning the CUresult): params is a
    void*[] pointing at the struct's bytes (and, for a kernel that takes them, the tensor
    maps')."""
    assert extra is None and stream == STREAM["ptr"]
    name = FUNCTIONS[func]
    arg = ctypes.c_void_p.from_address(params).value
    raw = ctypes.string_at(arg, params_dtype().itemsize)
    if _n_maps(name):
        maps = ctypes.c_void_p.from_address(params + 8).value
        raw += ctypes.string_at(maps, _n_maps(name) * tma.MAP_BYTES)
    LOG.append((name, (gx, gy, gz), (bx, by, bz), smem, raw))
    return 0


def _launch_callback(*args):
    """ctypes ignores a callback's exceptions: a failed check returns an error status instead,
    which the plan raises as CUDADriverError."""
    try:
        return fake_launch_kernel(*args)
    except Exception as e:  # noqa: BLE001
        LAUNCH_ERRORS.append(e)
        return 999


LAUNCH_ERRORS: list = []
# the stand-in behind cuLaunchKernel's own prototype: the arguments go through the same ctypes
# conversions as the real call's (the plans pass ctypes objects, the launchers ints)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, *device._Driver._PROTOS["cuLaunchKernel"])(
    _launch_callback)


def fake_encode(out, dtype_code, rank, pointer, dims, strides, box, elem_strides, interleave,
                swizzle, l2, oob):
    """cuTensorMapEncodeTiled's stand-in: the map's bytes are its arguments."""
    vals = ([pointer, dtype_code, rank] + list((ctypes.c_uint64 * 4).from_address(dims))
            + list((ctypes.c_uint64 * 3).from_address(strides))
            + list((ctypes.c_uint32 * 4).from_address(box)) + [swizzle, oob])
    ctypes.memmove(out, struct.pack("<16Q", *vals), tma.MAP_BYTES)
    return 0


def _layout(a):
    return None if a is None else (a.shape, a.strides, a.dtype, a.data.ptr % 16)


def _ptr(a):
    return 0 if a is None else a.data.ptr


def call(kind, run, arrays, roles, options):
    """A call site: the plan of this layout replayed, else ``run()`` in full and recorded.
    ``run()`` returns (result, piece); ``roles`` names ``arrays`` for the plan."""
    key = (kind, *(_layout(a) for a in arrays), options, config.get())
    plan = plans.lookup(key)
    if plan is not None:
        def alloc(nbytes):
            a = cupy.empty((nbytes,), np.uint8)
            return a, a.data.ptr
        done = plan.run(tuple(_ptr(a) for a in arrays), STREAM["ptr"], alloc)
        if done is not None:
            return plan.result
    with plans.record() as rec:
        result, piece = run()
        plans.offer(piece)
    plans.remember(key, rec.plan(tuple(zip(roles, (_ptr(a) for a in arrays))), 0, result))
    return result


class FakeDevice:
    def __init__(self, i=0):
        self.id = i

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def fake_array(shape, dtype, strides=None, align=256):
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
    extent = (1 + sum((n - 1) * st for n, st in zip(shape, strides))) * 1 if shape else 1
    ptr = (1 << 40) + next(_NEXT) * (1 << 30)
    ptr += align % 256 if align != 256 else 0
    mem = cupy.cuda.UnownedMemory(ptr, max(extent, 16), None, 0)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0), strides)


def _alloc(shape, dtype=np.float32, **kw):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return fake_array(shape, dtype)


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    kernels = {}
    monkeypatch.setattr(jit, "get_kernel",
                        lambda src, name, *a, **k: kernels.setdefault(name, FakeKernel(name)))
    monkeypatch.setattr(jit, "device_facts", lambda i: (90, 232448, 132))
    monkeypatch.setattr(jit, "peak_memory_bandwidth", lambda i: 4.8e12)     # (an H200)
    monkeypatch.setattr(device, "scope", FakeDevice)
    driver = DRIVER
    monkeypatch.setattr(device, "driver", lambda: DRIVER)
    monkeypatch.setattr(driver, "launch", LAUNCH, raising=False)
    monkeypatch.setattr(tma, "_ENCODE", [fake_encode])
    monkeypatch.setattr(driver, "current_context", lambda: 0xC0, raising=False)
    monkeypatch.setattr(driver, "primary_context", lambda device_id: 0xC0, raising=False)
    monkeypatch.setattr(cupy, "empty", _alloc)
    monkeypatch.setattr(cupy, "zeros", _alloc)
    monkeypatch.setattr(cupy, "empty_like", lambda a, **k: _alloc(a.shape, a.dtype))

    def ascontig(a, dtype=None):
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return _alloc(a.shape, dtype or a.dtype)    # a "copy": a new array
    monkeypatch.setattr(cupy, "ascontiguousarray", ascontig)

    def as_input(a, multiple=8):   # the launchers' copy of an input the kernels cannot read
        from flashcore.kernels.common import _used_strides_ok        # in place
        return a if a.size == 0 or _used_strides_ok(a, multiple, 16) else _alloc(a.shape, a.dtype)
    for mod in (forward, backward):
        monkeypatch.setattr(mod, "_as_input", as_input)
    # decoding's fused split combine: the current stream (answered here) picks the persistent
    # counter array; fresh counters per test, the real ones restored after it
    from flashcore.kernels import decode
    STREAM["ptr"] = 0x7000
    monkeypatch.setattr(device, "current_stream", lambda xp, dev: STREAM["ptr"])
    monkeypatch.setattr(decode, "_COUNTERS", {})
    # the cluster merge (sm_90) has tests of its own below; the others test the global paths
    was = config.set(decode_fused_combine=True, decode_cluster=False)
    monkeypatch.setattr(decode, "_CLUSTER_REFUSED", set())
    plans.clear()
    plans.set_enabled(True)
    LOG.clear()
    yield
    config.set(**was._asdict())
    plans.clear()


def _scratch_words():
    dt = params_dtype()
    return [dt.fields[n][1] // 8 for n in ("dq_accum", "dsoftmax_sum")]


def _masked(log):
    out = []
    for name, grid, block, smem, raw in log:
        w = np.frombuffer(raw, np.uint64).copy()
        w[_scratch_words()] = 0
        out.append((name, grid, block, smem, w.tobytes()))
    return out


def _qkv(rng, dtype, b, sq, sk, h, hk, d, strided):
    def mk(s, n, heads):
        if strided:   # a wider head and seq stride, contiguous last dim, 16-byte aligned
            st = np.dtype(dtype).itemsize
            strides = (s * (heads + 2) * (d + 8) * st, (heads + 2) * (d + 8) * st, (d + 8) * st, st)
            return fake_array((b, s, heads, d), dtype, strides)
        return fake_array((b, s, heads, d), dtype)
    return mk(sq, "q", h), mk(sk, "k", hk), mk(sk, "v", hk)


def _case(rng):
    dtype = rng.choice(["float16", ml_dtypes.bfloat16])
    d = int(rng.choice([32, 64, 72, 128, 200, 256]))
    hk = int(rng.choice([1, 2]))
    h = hk * int(rng.choice([1, 3]))
    b, sq, sk = int(rng.integers(1, 3)), int(rng.integers(1, 700)), int(rng.integers(1, 700))
    wl, wr = [(-1, -1), (-1, 0), (30, 5), (0, -1)][rng.integers(4)]
    softcap = float(rng.choice([0.0, 0.0, 20.0]))
    alibi = None
    if rng.random() < 0.25:
        alibi = fake_array((h,) if rng.random() < 0.5 else (b, h), np.float32)
    return dict(dtype=dtype, b=b, sq=sq, sk=sk, h=h, hk=hk, d=d, wl=wl, wr=wr, softcap=softcap,
                alibi=alibi, strided=bool(rng.random() < 0.3),
                deterministic=bool(rng.random() < 0.3), scale=float(rng.uniform(0.05, 0.2)))


def _options(c, *names):
    return tuple(c[n] for n in ("scale", "wl", "wr", "softcap") + names)


def _forward(c, arrays):
    q, k, v, out, lse = arrays
    return call("fwd", lambda: (None, forward.launch_forward(
        q, k, v, out, lse, softmax_scale=c["scale"], window_left=c["wl"], window_right=c["wr"],
        softcap=c["softcap"], alibi_slopes=c["alibi"])),
        (q, k, v, out, lse, c["alibi"]), ("q", "k", "v", "o", "lse", "alibi_slopes"),
        _options(c))


def _backward(c, arrays):
    do, q, k, v, out, lse, dq, dk, dv = arrays
    return call("bwd", lambda: (None, backward.launch_backward(
        do, q, k, v, out, lse, dq, dk, dv, softmax_scale=c["scale"], window_left=c["wl"],
        window_right=c["wr"], softcap=c["softcap"], alibi_slopes=c["alibi"],
        deterministic=c["deterministic"])),
        (do, q, k, v, out, lse, dq, dk, dv, c["alibi"]),
        ("dout", "q", "k", "v", "o", "lse", "dq", "dk", "dv", "alibi_slopes"),
        _options(c, "deterministic"))


def _fwd_arrays(rng, c):
    q, k, v = _qkv(rng, c["dtype"], c["b"], c["sq"], c["sk"], c["h"], c["hk"], c["d"], c["strided"])
    return q, k, v, fake_array(q.shape, q.dtype), fake_array((c["b"], c["h"], c["sq"]), np.float32)


def _bwd_arrays(rng, c):
    q, k, v, out, lse = _fwd_arrays(rng, c)
    return (fake_array(q.shape, q.dtype), q, k, v, out, lse, fake_array(q.shape, q.dtype),
            fake_array(k.shape, k.dtype), fake_array(v.shape, v.dtype))


def _check(run, make, c, rng):
    a1 = make(rng, c)
    run(c, a1)                         # full run: records the plan
    full1 = list(LOG)
    LOG.clear()
    run(c, a1)                         # replay, same arrays
    assert _masked(LOG) == _masked(full1), "replay differs from the full launcher"
    assert len(plans.PLANS) == 1
    a2 = make(rng, c)                  # same layout, other addresses
    LOG.clear()
    run(c, a2)
    replay2 = list(LOG)
    plans.set_enabled(False)
    LOG.clear()
    run(c, a2)
    plans.set_enabled(True)
    assert _masked(replay2) == _masked(LOG), "replay with new pointers differs"
    assert replay2 and replay2[0][4] != full1[0][4], "pointers were not updated"


@pytest.mark.parametrize("seed", range(40))
def test_forward_replay_equals_full_launch(seed):
    rng = np.random.default_rng(seed)
    _check(_forward, _fwd_arrays, _case(rng), rng)


@pytest.mark.parametrize("seed", range(40))
def test_backward_replay_equals_full_launch(seed):
    rng = np.random.default_rng(1000 + seed)
    _check(_backward, _bwd_arrays, _case(rng), rng)


@pytest.mark.parametrize("seed", range(40))
def test_backward_replay_equals_full_launch_ampere_class(seed):
    """(The Hopper kernels reduce dQ in tile order: here the Ampere-class kernels' element-wise
    reduction.)"""
    rng = np.random.default_rng(1000 + seed)
    with config.override(sm90_bwd=False):
        _check(_backward, _bwd_arrays, _case(rng), rng)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dq_tiled_launches(d):
    """A dense call whose arrays TMA can read runs the whole-tile preprocess, the Hopper dK/dV
    kernel and the tiled convert kernel, over an accumulator of whole 64-row tiles; with the
    Hopper backward off, the Ampere-class preprocess, kernel and convert over seqlen_q rows."""
    rng = np.random.default_rng(d)
    c = dict(_case(rng), dtype="float16", d=d, sq=100, sk=90, b=2, h=4, hk=2, wl=-1, wr=0,
             softcap=0.0, alibi=None, strided=False, deterministic=False)
    for hopper in (False, True):
        with config.override(sm90_bwd=hopper):
            LOG.clear()
            plans.clear()
            _backward(c, _bwd_arrays(rng, c))
            names = [n for n, *_ in LOG]
        words = np.frombuffer(LOG[0][4][:params_dtype().itemsize], np.int64)
        dt = params_dtype()
        head_stride = int(words[dt.fields["dq_accum_head_stride"][1] // 8])
        assert head_stride == (128 if hopper else 100) * d
        if not hopper:
            assert names[0] == "flash_bwd_preprocess_kernel<fc_fp16>"
            assert names[2] == "flash_bwd_convert_dq_kernel<fc_fp16>"
            continue
        kernel = (backward.sm90_d256_kernel_name("float16", True) if d == 256
                  else backward.sm90_ws_kernel_name("float16", d, True))
        assert names == ["flash_bwd_preprocess_kernel<fc_fp16, true>", kernel,
                         backward.sm90_convert_tiled_name("float16", d)]
        smem = (backward.sm90_d256_smem() if d == 256
                else backward.sm90_ws_smem(d, backward.sm90_ws_block_m(d)))
        assert LOG[1][3] == smem and smem <= 232448


_VARLEN_LENS = [70, 0, 257, 33]      # one empty sequence, none a multiple of the tile


def _varlen_arrays(d):
    """Packed sequences of _VARLEN_LENS, 4 query heads over 2 kv heads: cu_seqlens, the total
    rows, q, k, v, out and lse."""
    cu = fake_array((len(_VARLEN_LENS) + 1,), np.int32)
    total = sum(_VARLEN_LENS)
    q, k, v = (fake_array((total, h, d), np.float16) for h in (4, 2, 2))
    return cu, total, q, k, v, fake_array(q.shape, np.float16), fake_array((4, total), np.float32)


def _varlen_backward(d):
    """launch_backward over _varlen_arrays (causal); returns the total rows and q, k, v, dout."""
    cu, total, q, k, v, out, lse = _varlen_arrays(d)
    do, dq = (fake_array(q.shape, np.float16) for _ in range(2))
    dk, dv = (fake_array(k.shape, np.float16) for _ in range(2))
    LOG.clear()
    backward.launch_backward(do, q, k, v, out, lse, dq, dk, dv, softmax_scale=0.1,
                             window_left=-1, window_right=0, cu_seqlens_q=cu,
                             cu_seqlens_k=cu, max_seqlen_q=257, max_seqlen_k=257)
    return total, (q, k, v, do)


@pytest.mark.parametrize("d", [64, 128])
def test_dq_tiled_varlen_launches(d):
    """Varlen calls on the cp.async kernel (sm90_bwd_ws off): the
    whole-tile preprocess, the kernel and the tiled convert kernel over an accumulator of
    total_q + 64 x batch rows a head (each sequence starts a tile)."""
    plans.clear()
    with config.override(sm90_bwd_ws=False):
        total, _ = _varlen_backward(d)
    names = [n for n, *_ in LOG]
    assert names == ["flash_bwd_preprocess_kernel<fc_fp16, true>",
                     backward.sm90_kernel_name("float16", d, True),
                     backward.sm90_convert_tiled_name("float16", d)]
    assert LOG[0][1] == LOG[2][1] == (5, 4, 4)        # ceil(257 / 64) tiles, heads, batch
    assert LOG[1][3] == backward.sm90_smem(d, backward.sm90_block_m(d))
    words = np.frombuffer(LOG[0][4][:params_dtype().itemsize], np.int64)
    dt = params_dtype()
    head_stride = int(words[dt.fields["dq_accum_head_stride"][1] // 8])
    assert head_stride == (total + 64 * len(_VARLEN_LENS)) * d


@pytest.mark.parametrize("d", [64, 128, 256])
def test_ws_varlen_launches(d):
    """Varlen calls: the warp-specialised kernel's varlen instantiation (d64, d128; d256 its own
    kernel), its grid over the longest sequence, and tensor maps over the packed arrays seen
    as one sequence of total rows (dims innermost first: head dim, total, heads, 1), at the
    arrays' own addresses. With sm90_bwd_ws off, neither takes a warp-specialised kernel."""
    total, arrays = _varlen_backward(d)
    names = [n for n, *_ in LOG]
    kernel = (backward.sm90_d256_kernel_name("float16", True, varlen=True) if d == 256
              else backward.sm90_ws_kernel_name("float16", d, True, varlen=True))
    assert names == ["flash_bwd_preprocess_kernel<fc_fp16, true>", kernel,
                     backward.sm90_convert_tiled_name("float16", d)]
    block_n = backward.SM90_D256_BLOCK if d == 256 else 128
    assert LOG[1][1] == (-(-257 // block_n), 2, 4)
    assert LOG[1][2] == (384, 1, 1)
    raw = LOG[1][4][params_dtype().itemsize:]
    maps = [struct.unpack_from("<16Q", raw, i * tma.MAP_BYTES) for i in range(4)]
    for words, a, heads in zip(maps, arrays, (4, 2, 2, 4)):
        assert words[0] == a.data.ptr and words[2] == 4
        assert tuple(words[3:7]) == (d, total, heads, 1)
    with config.override(sm90_bwd_ws=False):
        _varlen_backward(d)
    assert "_ws_kernel" not in LOG[1][0] and "_d256_kernel" not in LOG[1][0]


@pytest.mark.parametrize("d", [128, 256])
def test_forward_ws_varlen_launches(d):
    """Varlen forward calls: the warp-specialised kernel's varlen instantiation (one tile a
    CTA: grid (query blocks of the longest sequence, heads, sequences)) and tensor maps over
    the packed arrays seen as one sequence; with sm90_fwd_ws off, not the warp-specialised
    kernel."""
    cu, total, q, k, v, out, lse = _varlen_arrays(d)

    def run():
        LOG.clear()
        forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                               window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=257, max_seqlen_k=257)
        return LOG[0]
    name, grid, block, _, raw = run()
    block_m = forward.sm90_ws_tile(d, True)[0]
    assert name == forward.sm90_ws_kernel_name("float16", d, True, seqlen_k=257, varlen=True)
    assert name.endswith(", false, true>")          # (not persistent; varlen)
    assert grid == (-(-257 // block_m), 4, 4) and block == (128 + 2 * block_m, 1, 1)
    maps = [struct.unpack_from("<16Q", raw, params_dtype().itemsize + i * tma.MAP_BYTES)
            for i in range(3)]
    for words, a, heads in zip(maps, (q, k, v), (4, 2, 2)):
        assert words[0] == a.data.ptr and tuple(words[3:7]) == (d, total, heads, 1)
    with config.override(sm90_fwd_ws=False):
        assert "_ws_kernel" not in run()[0]


@pytest.mark.parametrize("d", [128, 256])
def test_forward_fp8_varlen_and_softcap_launches(d):
    """FP8 varlen and softcap calls: the FP8 kernel's varlen instantiation (one tile a CTA,
    grid (query blocks of the longest sequence, heads, sequences)), maps over the packed byte
    arrays, the params' cu_seqlens, totals and packed strides, lse (heads, total); softcap: its
    instantiation, the softcap and an exponent multiplier of softcap log2(e)."""
    cu = fake_array((len(_VARLEN_LENS) + 1,), np.int32)
    total = sum(_VARLEN_LENS)
    q, k, v = (fake_array((total, h, d), np.uint8) for h in (4, 2, 2))
    out, lse = fake_array(q.shape, np.float16), fake_array((4, total), np.float32)

    def run(**kw):
        LOG.clear()
        forward.launch_forward_fp8(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                                   window_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=257, max_seqlen_k=257, **kw)
        (entry,) = LOG
        return entry
    name, grid, block, _, raw = run()
    assert name == forward.fp8_kernel_name("float16", d, True, varlen=True)
    assert name.endswith(", false, true>")          # (not persistent; varlen)
    assert grid == (-(-257 // 128), 4, 4) and block == (384, 1, 1)
    p = np.frombuffer(raw[:params_dtype().itemsize], params_dtype())[0]
    assert p["cu_seqlens_q"] == p["cu_seqlens_k"] == cu.data.ptr
    assert (p["total_q"], p["total_k"], p["batch"], p["seqlen_q"]) == (total, total, 4, 257)
    assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == (0, 4 * d, d)
    assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == (0, 2 * d, d)
    assert (p["o_batch_stride"], p["o_row_stride"]) == (0, 4 * d)
    assert (p["lse_batch_stride"], p["lse_head_stride"]) == (0, total)
    assert p["softcap"] == 0.0 and np.isclose(p["scale_log2"], 0.1 * 1.4426950408889634)
    maps = [struct.unpack_from("<16Q", raw, params_dtype().itemsize + i * tma.MAP_BYTES)
            for i in range(3)]
    for words, a, heads in zip(maps, (q, k, v), (4, 2, 2)):
        assert words[0] == a.data.ptr and tuple(words[3:7]) == (d, total, heads, 1)
    name, _, _, _, raw = run(softcap=7.5)
    assert name == forward.fp8_kernel_name("float16", d, True, varlen=True, softcap=True)
    assert name.endswith(", false, true, true>")
    p = np.frombuffer(raw[:params_dtype().itemsize], params_dtype())[0]
    assert p["softcap"] == np.float32(7.5)
    assert np.isclose(p["scale_log2"], 7.5 * 1.4426950408889634)


@pytest.mark.parametrize("out_dtype,want", [("float16", True), ("float32", False)])
def test_forward_fp8_output_route(out_dtype, want):
    """The dense FP8 forward at head dim 128: a 16-bit output goes through the O buffers (the
    output's tensor map, ``o_tma`` set, the buffered instantiation and its shared memory); a
    float32 one takes the instantiation without buffers, stored from the registers (a kernel
    with O buffers is never launched with ``o_tma`` 0)."""
    from flashcore.kernels import forward
    q, k, v = (fake_array((2, 300, h, 128), np.uint8) for h in (4, 2, 2))
    out, lse = fake_array(q.shape, out_dtype), fake_array((2, 4, 300), np.float32)
    LOG.clear()
    forward.launch_forward_fp8(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                               window_right=-1)
    (name, _, _, smem, raw), = LOG
    assert name == forward.fp8_kernel_name(out_dtype, 128, False, o_tma=want)
    assert name.endswith(", 2>") == want
    assert smem == forward.fp8_smem(128, o_tma=want)
    n = params_dtype().itemsize
    o_tma = np.frombuffer(raw[:n], np.int32)[params_dtype().fields["o_tma"][1] // 4]
    fourth = struct.unpack_from("<Q", raw, n + 3 * tma.MAP_BYTES)[0]
    assert bool(o_tma) == want
    assert fourth == (out.data.ptr if want else q.data.ptr)


def test_scratch_is_fresh_and_never_filled(monkeypatch):
    made = []
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32, **k: (
        made.append(("empty", shape, np.dtype(dtype))), _alloc(shape, dtype))[1])
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32, **k: (
        made.append(("zeros", shape, np.dtype(dtype))), _alloc(shape, dtype))[1])
    rng = np.random.default_rng(5)
    c = dict(_case(rng), deterministic=False, sq=100, sk=90, b=2, h=4, hk=2, d=64)
    arrays = _bwd_arrays(rng, c)
    _backward(c, arrays)
    made.clear()
    _backward(c, arrays)       # replay: one fresh buffer for the fp32 dQ accumulator (zeroed
    # by the preprocess kernel) and D = rowsum(dO * O), each 256-byte aligned in it, no fill
    dq_acc, d_rows = 2 * 4 * 100 * 64 * 4, 2 * 4 * 100 * 4
    scratch = [m for m in made if m[2] == np.uint8]
    assert scratch == [("empty", (-(-dq_acc // 256) * 256 + -(-d_rows // 256) * 256,), np.uint8)]
    assert not any(kind == "zeros" for kind, *_ in made)


def test_copies_and_unaligned_arrays_are_never_recorded():
    rng = np.random.default_rng(9)
    c = _case(rng)
    q, k, v, out, lse = _fwd_arrays(rng, c)
    odd = fake_array(q.shape, q.dtype, align=8)       # 8-byte aligned: the launcher copies it
    _forward(c, (odd, k, v, out, lse))
    assert not plans.PLANS
    _forward(c, (q, k, v, out, lse))
    assert len(plans.PLANS) == 1
    assert next(iter(plans.PLANS))[0] == "fwd"


def test_options_are_part_of_the_key():
    rng = np.random.default_rng(11)
    c = _case(rng)
    arrays = _fwd_arrays(rng, c)
    _forward(c, arrays)
    _forward(dict(c, scale=c["scale"] * 2), arrays)
    _forward(dict(c, wl=3, wr=3), arrays)
    assert len(plans.PLANS) == 3


def test_key_holds_the_address_modulo_16():
    """The backward writes dq/dk/dv in place when 4-byte aligned, else through a temporary:
    a plan recorded for one alignment must not serve another (review finding). Both call
    sites' keys (CuPy arrays in flashcore.api, tensors in the torch ops) hold it."""
    from flashcore import api
    a8 = fake_array((2, 8, 2, 64), np.float16, align=8)
    a2 = fake_array((2, 8, 2, 64), np.float16, align=2)
    a0 = fake_array((2, 8, 2, 64), np.float16)
    assert len({api._cupy_layout(a) for a in (a8, a2, a0)}) == 3


def test_a_plan_refuses_an_address_it_cannot_fill_in():
    """A struct field holding an address that is not the call's array of that name (a copy the
    launcher made, say) makes the call unrecordable."""
    rng = np.random.default_rng(13)
    c = _case(rng)
    q, k, v, out, lse = _fwd_arrays(rng, c)
    with plans.record() as rec:
        piece = forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                                       window_right=-1)
        plans.offer(piece)
    other = fake_array(q.shape, q.dtype)
    assert rec.plan((("q", q.data.ptr), ("k", k.data.ptr), ("v", v.data.ptr),
                     ("o", out.data.ptr), ("lse", lse.data.ptr)), 0) is not None
    assert rec.plan((("q", other.data.ptr), ("k", k.data.ptr), ("v", v.data.ptr),
                     ("o", out.data.ptr), ("lse", lse.data.ptr)), 0) is None
    with plans.record() as rec:     # two offers in one call, or an unrecordable piece
        plans.offer(piece)
        plans.offer(piece)
    assert rec.plan((), 0) is None
    with plans.record() as rec:
        plans.offer(piece, None)
    assert rec.plan((), 0) is None


def test_tile_overrides_and_kernel_reloads_drop_the_plans():
    rng = np.random.default_rng(12)
    c = _case(rng)
    _forward(c, _fwd_arrays(rng, c))
    assert plans.PLANS
    forward.set_tile_override(64, None)
    assert not plans.PLANS
    _forward(c, _fwd_arrays(rng, c))
    assert plans.PLANS
    jit.clear_memory_cache()          # the recorded plans are not replayed: launched in full
    assert all(plans.lookup(key) is None for key in plans.PLANS)


# ---------------- decoding (flashcore/kernels/decode.py) ----------------

def _decode_case(rng):
    from flashcore.kernels import decode  # noqa: F401
    dtype = rng.choice(["float16", ml_dtypes.bfloat16])
    d = int(rng.choice([64, 128, 256]))
    hk = int(rng.choice([1, 2, 8]))
    h = hk * int(rng.choice([1, 4]))
    b, sq = int(rng.integers(1, 5)), int(rng.choice([1, 1, 3]))
    paged = bool(rng.random() < 0.5)
    cap = int(rng.choice([256, 4096, 65536]))
    wl, wr = [(-1, -1), (-1, 0), (511, 0)][rng.integers(3)]
    return dict(dtype=dtype, d=d, hk=hk, h=h, b=b, sq=sq, paged=paged, cap=cap, wl=wl, wr=wr,
                splits=int(rng.choice([0, 0, 1, 3])), scale=float(rng.uniform(0.05, 0.2)),
                softcap=float(rng.choice([0.0, 30.0])))


def _decode_arrays(rng, c):
    q = fake_array((c["b"], c["sq"], c["h"], c["d"]), c["dtype"])
    if c["paged"]:
        page = 256
        nblk = c["b"] * c["cap"] // page
        kc = fake_array((nblk, page, c["hk"], c["d"]), c["dtype"])
        vc = fake_array((nblk, page, c["hk"], c["d"]), c["dtype"])
        bt = fake_array((c["b"], c["cap"] // page), np.int32)
    else:
        kc = fake_array((c["b"], c["cap"], c["hk"], c["d"]), c["dtype"])
        vc = fake_array((c["b"], c["cap"], c["hk"], c["d"]), c["dtype"])
        bt = None
    return (q, kc, vc, fake_array(q.shape, q.dtype),
            fake_array((c["b"], c["h"], c["sq"]), np.float32), fake_array((c["b"],), np.int32), bt)


def _decode(c, arrays):
    from flashcore.kernels import decode
    q, kc, vc, out, lse, seqlens, bt = arrays
    LOG.append(("returned", call("dec", lambda: decode.decode_launches(
        q, kc, vc, out, lse, cache_seqlens=seqlens, block_table=bt, softmax_scale=c["scale"],
        window_left=c["wl"], window_right=c["wr"], softcap=c["softcap"],
        num_splits=c["splits"]), (q, kc, vc, out, lse, seqlens, bt),
        ("q", "k", "v", "o", "lse", "cache_seqlens", "block_table"),
        _options(c, "splits")), (), 0, b""))


def _decode_masked(log):
    from flashcore.kernels.params import params_dtype
    dt = params_dtype()
    words = [dt.fields[n][1] // 8 for n in ("o_accum", "lse_accum")]
    out = []
    for name, grid, block, smem, raw in log:
        if raw:
            w = np.frombuffer(raw, np.uint64).copy()
            w[words] = 0
            raw = w.tobytes()
        out.append((name, grid, block, smem, raw))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_decode_replay_equals_full_launch(seed, monkeypatch):
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    rng = np.random.default_rng(2000 + seed)
    c = _decode_case(rng)
    a1 = _decode_arrays(rng, c)
    _decode(c, a1)
    full1 = list(LOG)
    LOG.clear()
    _decode(c, a1)
    assert _decode_masked(LOG) == _decode_masked(full1)
    a2 = _decode_arrays(rng, c)
    LOG.clear()
    _decode(c, a2)
    replay2 = list(LOG)
    plans.set_enabled(False)
    LOG.clear()
    _decode(c, a2)
    plans.set_enabled(True)
    assert _decode_masked(replay2) == _decode_masked(LOG)
    assert replay2[0][4] != full1[0][4], "pointers were not updated"


# ---------------- decoding: a plan for another cache length ----------------

def _growing_cache(c, cap, heads_first, masked):
    """A contiguous cache of ``cap`` keys as a transformers DynamicCache holds it ((b, hk, s, d),
    passed as its (b, s, hk, d) view: ``heads_first``) or as (b, s, hk, d), and a key mask."""
    b, hk, d = c["b"], c["hk"], c["d"]
    isz = np.dtype(c["dtype"]).itemsize
    if heads_first:
        st = (hk * cap * d * isz, d * isz, cap * d * isz, isz)
        kc, vc = (fake_array((b, cap, hk, d), c["dtype"], st) for _ in "kv")
    else:
        kc, vc = (fake_array((b, cap, hk, d), c["dtype"]) for _ in "kv")
    mask = fake_array((b, cap), np.bool_) if masked else None
    return kc, vc, mask


def _decode_full(c, q, kc, vc, out, lse, seqlens, mask):
    from flashcore.kernels import decode
    with plans.record() as rec:
        _, piece = decode.decode_launches(
            q, kc, vc, out, lse, cache_seqlens=seqlens, softmax_scale=c["scale"],
            window_left=c["wl"], window_right=c["wr"], softcap=c["softcap"],
            num_splits=c["splits"], key_mask=mask)
        plans.offer(piece)
    return rec.plan(tuple(zip(("q", "k", "v", "o", "lse", "cache_seqlens", "key_mask"),
                              map(_ptr, (q, kc, vc, out, lse, seqlens, mask)))), 0)


@pytest.mark.parametrize("seed", range(24))
def test_decode_plan_for_another_length_equals_full_launch(seed, monkeypatch):
    """A decode plan recorded at one cache length and written for another
    (Plan.for_length) launches what the full launcher launches at that length, byte for byte;
    it declines exactly where the full launch differs in kernel, grid, block or shared memory."""
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    rng = np.random.default_rng(9000 + seed)
    c = _decode_case(rng)
    c["paged"] = False
    config.set(decode_cluster=bool(rng.random() < 0.6))
    heads_first, masked = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
    cap1 = int(rng.integers(1, 9000))
    q = fake_array((c["b"], c["sq"], c["h"], c["d"]), c["dtype"])
    out, lse = fake_array(q.shape, q.dtype), fake_array((c["b"], c["h"], c["sq"]), np.float32)
    seqlens = fake_array((c["b"],), np.int32)
    if seed % 3 == 2:       # an FP8 cache (bytes; strides halved, 16-element steps)
        c["d"] = int(rng.choice([128, 256]))
        q = fake_array((c["b"], c["sq"], c["h"], c["d"]), c["dtype"])
        out = fake_array(q.shape, q.dtype)
        c = dict(c, dtype=np.uint8, q_dtype=c["dtype"])
    kc, vc, mask = _growing_cache(c, cap1, heads_first, masked)
    LOG.clear()
    plan = _decode_full(c, q, kc, vc, out, lse, seqlens, mask)
    assert plan is not None and plan.relength is not None
    first = [e[:4] for e in LOG]
    made = 0
    for cap2 in (cap1 + 1, cap1 + 2, cap1 + 63, cap1 + 700, max(1, cap1 - 1),
                 int(rng.integers(1, 70000))):
        kc, vc, mask = _growing_cache(c, cap2, heads_first, masked)
        LOG.clear()
        _decode_full(c, q, kc, vc, out, lse, seqlens, mask)
        full = list(LOG)
        other = plan.for_length(cap2, decode._strides(kc), decode._strides(vc),
                                0 if mask is None else mask.strides[0])
        if other is None:
            assert [e[:4] for e in full] != first, f"declined {cap2} that launches alike"
            continue
        made += 1
        LOG.clear()

        def alloc(nbytes):
            a = cupy.empty((nbytes,), np.uint8)
            return a, a.data.ptr
        assert other.run(tuple(map(_ptr, (q, kc, vc, out, lse, seqlens, mask))), STREAM["ptr"],
                         alloc) is not None
        assert _decode_masked(LOG) == _decode_masked(full), cap2
    assert made, "no other length launched alike"


def test_decode_plan_for_another_length_declines_a_layout_it_would_copy(monkeypatch):
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    c = _fused_case(splits=0)
    q = fake_array((1, 1, 32, 128), c["dtype"])
    out, lse = fake_array(q.shape, q.dtype), fake_array((1, 32, 1), np.float32)
    kc, vc, _ = _growing_cache(c, 4096, False, False)
    plan = _decode_full(c, q, kc, vc, out, lse, fake_array((1,), np.int32), None)
    st = decode._strides(kc)
    assert plan.for_length(4100, st, st, 0) is not None
    assert plan.for_length(4100, (st[0], st[1] + 4) + st[2:], st, 0) is None  # rows not 16 B
    assert plan.for_length(4100, (st[0] + 4,) + st[1:], st, 0) is not None   # (batch 1: unused,
    #                                                                    as the launcher has it)
    assert plan.for_length(4100, st[:3] + (2,), st, 0) is None            # not the last dim
    assert plan.for_length(0, st, st, 0) is None
    # a field that would turn non-zero (or zero) would change the plan's word runs: declined
    relength = plan.relength
    for value in (5, 0):
        plan.relength = lambda *a, v=value: dict(relength(*a), key_mask_batch_stride=v,
                                                 seqlen_k=v or 4100)
        assert (plan.for_length(4100, st, st, 0) is None) == (value == 5)
        plan.relength = lambda *a, v=value: dict(relength(*a), k_head_stride=v)
        assert (plan.for_length(4100, st, st, 0) is None) == (value == 0)


def _refusing_clusters(monkeypatch, status):
    """Cluster launches refused with the driver error ``status["code"]`` (a stand-in device
    that cannot place them); other launches logged. The decode launcher's copies off."""
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    monkeypatch.setattr(DRIVER, "set_function_attribute", lambda *a: None)
    config.set(decode_cluster=True)

    class DriverError(device.CUDADriverError):
        def __init__(self, status):
            Exception.__init__(self, f"CUDA driver error {status} (stand-in)")
            self.status = status

    def call(self, grid, block, args, shared_mem=0, stream=0):
        if self.name.startswith("flash_decode_cluster_kernel"):
            raise DriverError(status["code"])
        LOG.append((self.name, tuple(grid), tuple(block), shared_mem, bytes(args[0].tobytes())))
    monkeypatch.setattr(FakeKernel, "__call__", call)


def test_decode_plan_for_another_length_after_a_cluster_refusal(monkeypatch):
    """A device that refuses the cluster launch: the call falls back to the global merge, and
    a plan it records, written for another length, launches what the full launcher launches
    there (whose split rule runs again for that length), or declines."""
    from flashcore.kernels import decode
    _refusing_clusters(monkeypatch, {"code": 912})     # every cluster size refused
    c = _fused_case(splits=0, b=1, hk=8, h=32)
    q = fake_array((1, 1, 32, 128), c["dtype"])
    out, lse = fake_array(q.shape, q.dtype), fake_array((1, 32, 1), np.float32)
    seqlens = fake_array((1,), np.int32)
    LOG.clear()
    plan = _decode_full(c, q, *_growing_cache(c, 500, True, False)[:2], out, lse, seqlens, None)
    assert decode._CLUSTER_REFUSED and _kernel_launches()[0][0].startswith("flash_decode_kernel<")
    made = 0
    for cap in (501, 520, 695, 1000, 3000, 9000):
        kc, vc, _ = _growing_cache(c, cap, True, False)
        LOG.clear()
        _decode_full(c, q, kc, vc, out, lse, seqlens, None)
        full = list(LOG)
        other = plan.for_length(cap, decode._strides(kc), decode._strides(vc), 0)
        if other is None:
            continue
        made += 1
        LOG.clear()
        other.run(tuple(map(_ptr, (q, kc, vc, out, lse, seqlens, None))), STREAM["ptr"],
                  lambda n: (lambda a: (a, a.data.ptr))(cupy.empty((n,), np.uint8)))
        assert _decode_masked(LOG) == _decode_masked(full), cap
    assert made


# ---------------- decoding: the fused split combine ----------------

def _counter_word():
    return params_dtype().fields["split_counter"][1] // 8


def _word(raw, i):
    return int(np.frombuffer(raw, np.uint64)[i])


def _kernel_launches():
    return [e for e in LOG if e[0] != "returned"]


def _fused_case(**over):
    c = dict(dtype=ml_dtypes.bfloat16, d=128, hk=8, h=32, b=1, sq=1, paged=False, cap=4096,
             wl=-1, wr=-1, splits=3, scale=0.1, softcap=0.0)
    c.update(over)
    return c


@pytest.mark.parametrize("paged", [False, True])
def test_decode_fused_combine_is_one_launch(paged, monkeypatch):
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    rng = np.random.default_rng(3)
    c = _fused_case(paged=paged)
    arrays = _decode_arrays(rng, c)
    _decode(c, arrays)
    (name, grid, block, smem, raw), = _kernel_launches()
    assert name.startswith("flash_decode_kernel<") and name.endswith("true, false>")   # Is_split, not FP8
    assert grid == (8, 1, 3)
    buf = decode._COUNTERS[(0, STREAM["ptr"])]
    assert buf.dtype == np.int32 and buf.size >= 8
    assert _word(raw, _counter_word()) == buf.data.ptr
    # the two-kernel path: the decode kernel without counters, then the combine kernel
    decode.set_fused_combine(False)
    LOG.clear()
    _decode(c, arrays)
    (n1, g1, _, _, r1), (n2, g2, _, _, r2) = _kernel_launches()
    assert n1 == name and g1 == grid and n2.startswith("flash_decode_combine_kernel<")
    assert _word(r1, _counter_word()) == 0 and _word(r2, _counter_word()) == 0
    assert len(plans.PLANS) == 2, "the choice is part of the plan key"
    # no split: one launch, no counters, whichever the switch
    for on in (True, False):
        decode.set_fused_combine(on)
        LOG.clear()
        _decode(dict(c, splits=1), arrays)
        (n, g, _, _, r), = _kernel_launches()
        assert g == (8, 1, 1) and n.endswith("false, false>") and _word(r, _counter_word()) == 0


def test_decode_counters_are_per_stream_and_replayed(monkeypatch):
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    rng = np.random.default_rng(4)
    c = _fused_case()
    arrays = _decode_arrays(rng, c)
    seen = {}
    for stream in (0x7000, 0x9000, 0x7000, 0x9000):
        STREAM["ptr"] = stream
        LOG.clear()
        _decode(c, arrays)            # the first is a full launch, the others replays
        (_, _, _, _, raw), = _kernel_launches()
        seen.setdefault(stream, set()).add(_word(raw, _counter_word()))
    assert len(plans.PLANS) == 1
    assert seen[0x7000] == {decode._COUNTERS[(0, 0x7000)].data.ptr}
    assert seen[0x9000] == {decode._COUNTERS[(0, 0x9000)].data.ptr}
    assert seen[0x7000] != seen[0x9000]


def test_decode_counters_grow_zero_filled(monkeypatch):
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    made = []

    def zeros(shape, dtype=np.float32, **kw):
        made.append((tuple(shape) if not isinstance(shape, int) else (shape,), np.dtype(dtype)))
        return _alloc(shape, dtype)
    monkeypatch.setattr(cupy, "zeros", zeros)
    rng = np.random.default_rng(5)
    small = _fused_case(b=2)
    _decode(small, _decode_arrays(rng, small))
    assert made == [((1024,), np.dtype(np.int32))]
    # 600 sequences x 8 kv heads = 4800 groups: a new, larger zero-filled array
    big = _fused_case(b=600, cap=256)
    LOG.clear()
    _decode(big, _decode_arrays(rng, big))
    (_, grid, _, _, raw), = _kernel_launches()
    assert grid[0] * grid[1] == 4800
    assert made[-1][1] == np.int32 and made[-1][0][0] >= 4800
    assert _word(raw, _counter_word()) == decode._COUNTERS[(0, STREAM["ptr"])].data.ptr
    # replaying the small layout keeps the grown array
    LOG.clear()
    n = len(made)
    _decode(small, _decode_arrays(rng, small))
    (_, _, _, _, raw), = _kernel_launches()
    assert len(made) == n
    assert _word(raw, _counter_word()) == decode._COUNTERS[(0, STREAM["ptr"])].data.ptr


def test_decode_fused_switch_from_the_environment():
    import os
    import pathlib
    import subprocess
    import sys
    root = str(pathlib.Path(__file__).resolve().parents[1])    # this checkout's flashcore
    code = ("import flashcore.kernels.decode as d, pathlib, sys; "
            f"assert pathlib.Path(d.__file__).resolve().is_relative_to({root!r}), d.__file__; "
            "print(d.fused_combine_enabled())")
    for val, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = dict(os.environ, PYTHONPATH=root)
        env.pop("FLASHCORE_DECODE_FUSED_COMBINE", None)
        if val is not None:
            env["FLASHCORE_DECODE_FUSED_COMBINE"] = val
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == want, (val, out)


# ---------------- decoding: the split merge inside a thread-block cluster (sm_90) ----------------

def _accum_words():
    dt = params_dtype()
    return [dt.fields[n][1] // 8 for n in ("o_accum", "lse_accum")]


@pytest.mark.parametrize("paged", [False, True])
def test_decode_cluster_merge_is_one_launch_without_scratch(paged, monkeypatch):
    driver = DRIVER
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    config.set(decode_cluster=True)
    attrs = []
    monkeypatch.setattr(driver, "set_function_attribute", lambda *a: attrs.append(a))
    made = []
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: (made.append(a), _alloc(*a, **k))[1])
    rng = np.random.default_rng(6)
    for splits, want_attr in ((3, False), (16, True)):
        c = _fused_case(paged=paged, splits=splits)
        arrays = _decode_arrays(rng, c)
        made.clear()
        attrs.clear()
        LOG.clear()
        _decode(c, arrays)
        (name, grid, block, smem, raw), = _kernel_launches()
        assert name.startswith("flash_decode_cluster_kernel<") and name.endswith(f", {splits}, false>")
        assert grid == (8, 1, splits)
        assert _word(raw, _counter_word()) == 0, "no arrival counter"
        assert all(_word(raw, w) == 0 for w in _accum_words()), "no global partials"
        assert not made, "no scratch allocated"
        assert LOG[-1] == ("returned", splits, (), 0, b"")
        # a count above 8 is a non-portable cluster size: allowed on the function first
        ptr = next(f for f, n in FUNCTIONS.items() if n == name)
        assert attrs == ([(ptr, 14, 1)] if want_attr else [])
        # the replay launches the same
        full = list(LOG)
        LOG.clear()
        _decode(c, arrays)
        assert LOG == full
    assert not decode._COUNTERS, "the cluster path needs no counters"


def test_decode_cluster_merge_only_where_it_applies(monkeypatch):
    """Not for one split, more than 16 splits, the two-kernel path, the switch off, or a device
    before sm_90; the choice is part of the plan key."""
    driver = DRIVER
    from flashcore import jit
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    monkeypatch.setattr(driver, "set_function_attribute", lambda *a: None)
    config.set(decode_cluster=True)
    rng = np.random.default_rng(7)

    def kernel_of(**over):
        c = _fused_case(**over)
        LOG.clear()
        _decode(c, _decode_arrays(rng, c))
        return _kernel_launches()[0][0]
    assert kernel_of(splits=8).startswith("flash_decode_cluster_kernel<")
    assert kernel_of(splits=1).startswith("flash_decode_kernel<")
    assert kernel_of(splits=17).startswith("flash_decode_kernel<")
    decode.set_fused_combine(False)
    assert kernel_of(splits=8).startswith("flash_decode_kernel<")
    decode.set_fused_combine(True)
    decode.set_cluster_merge(False)
    assert kernel_of(splits=8).startswith("flash_decode_kernel<")
    decode.set_cluster_merge(True)
    monkeypatch.setattr(jit, "device_facts", lambda i: (80, 166912, 108))
    plans.clear()
    assert kernel_of(splits=8).startswith("flash_decode_kernel<")


def test_decode_cluster_refused_falls_back_to_the_global_merge(monkeypatch):
    """A device that refuses the cluster launch (say, a size it cannot place) gets the fused
    global-memory merge for that split count, on that call and the later ones."""
    from flashcore.kernels import decode
    status = {"code": 912}    # CUDA_ERROR_INVALID_CLUSTER_SIZE
    _refusing_clusters(monkeypatch, status)
    rng = np.random.default_rng(8)
    c = _fused_case(splits=12)
    arrays = _decode_arrays(rng, c)
    for _ in range(2):
        LOG.clear()
        _decode(c, arrays)
        (name, grid, _, _, raw), = _kernel_launches()
        assert name.startswith("flash_decode_kernel<") and grid == (8, 1, 12)
        assert _word(raw, _counter_word()) != 0, "the fused global merge, with its counters"
        assert LOG[-1][1] == 12
    refused = {n for dev, n in decode._CLUSTER_REFUSED if dev == 0}
    assert len(refused) == 1 and next(iter(refused)).endswith(", 12, false>")
    # another kernel (here: 8 splits) is not affected by that refusal ...
    status["code"] = 700      # ... and an error that is no refusal (an earlier fault) is raised
    with pytest.raises(device.CUDADriverError):
        _decode(_fused_case(splits=8), _decode_arrays(rng, _fused_case(splits=8)))
    assert len(decode._CLUSTER_REFUSED) == 1


def test_decode_cluster_rule_declining_means_the_global_merge(monkeypatch):
    """One MQA sequence: the cluster rule would leave the GPU idle and hands the count to the
    global rule, whose count (even one of 16 or fewer) then merges through global memory."""
    driver = DRIVER
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    monkeypatch.setattr(driver, "set_function_attribute", lambda *a: None)
    config.set(decode_cluster=True)
    rng = np.random.default_rng(10)
    c = _fused_case(b=1, cap=4096, hk=1, h=8, splits=0)
    _decode(c, _decode_arrays(rng, c))
    (name, grid, _, _, raw), = _kernel_launches()
    assert 1 < grid[2] <= decode.MAX_CLUSTER, grid
    assert name.startswith("flash_decode_kernel<") and _word(raw, _counter_word()) != 0


def test_decode_cluster_skipped_for_an_override_that_leaves_no_room(monkeypatch):
    """A tile override too small for the cluster kernel's partials (its static_assert) takes the
    global merge instead of failing to compile."""
    driver = DRIVER
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    monkeypatch.setattr(driver, "set_function_attribute", lambda *a: None)
    config.set(decode_cluster=True)
    assert not decode._cluster_layout_fits(128, 1, decode.DecodeConfig(16, 1, 2))
    assert decode._cluster_layout_fits(128, 1, decode.DecodeConfig(128, 4, 3))
    assert decode._cluster_layout_fits(128, 2, decode.DecodeConfig(64, 4, 3))
    decode.set_config_override(128, (16, 1, 2))
    try:
        rng = np.random.default_rng(11)
        c = _fused_case(splits=3)
        _decode(c, _decode_arrays(rng, c))
        (name, grid, _, _, _), = _kernel_launches()
        assert name.startswith("flash_decode_kernel<") and grid == (8, 1, 3)
    finally:
        decode.set_config_override(128, None)


def test_decode_cluster_split_rule():
    from flashcore.kernels.decode import cluster_num_splits
    # 32 q over 8 kv heads: batch 1 -> 8 splits, batch 8 -> 2, batch 64 -> no split
    assert cluster_num_splits(8, 132, 32) == 8
    assert cluster_num_splits(64, 132, 32) == 2
    assert cluster_num_splits(512, 132, 32) == 1
    assert cluster_num_splits(110, 132, 32) == 1       # 80% of the SMs already
    assert cluster_num_splits(8, 132, 6) == 3          # at most half the key blocks
    assert cluster_num_splits(8, 132, 3) == 1
    assert cluster_num_splits(1, 132, 1000) == 0       # 8 CTAs on 132 SMs: the global rule
    assert cluster_num_splits(4, 132, 1000) == 0       # 32 CTAs: under a quarter of the SMs
    assert cluster_num_splits(5, 132, 1000) == 8       # 40 CTAs


@pytest.mark.parametrize("b, cap, hk, h, sq, want", [
    (1, 4096, 8, 32, 1, ("cluster", 8, 128, 3)),
    (8, 16384, 8, 32, 1, ("cluster", 2, 128, 3)),
    (64, 4096, 8, 32, 1, ("plain", 1, 64, 3)),        # 512 CTAs, short: 1.94 waves of 2 per SM
    (64, 16384, 8, 32, 1, ("plain", 1, 64, 4)),       # the same, long: 3.88 waves of 1 per SM
    (128, 4096, 8, 32, 1, ("plain", 1, 64, 4)),       # 1024 CTAs: 7.76 waves of 1 per SM
    (17, 4096, 8, 32, 1, ("plain", 1, 64, 3)),        # 136 CTAs: one wave of 2 per SM
    (1, 131072, 1, 8, 1, ("global", None, 64, 3)),    # MQA, one sequence: many splits
    (1, 4096, 8, 32, 5, ("cluster", 8, 64, 3)),       # 20 packed rows: two m16 slices
    # one sequence, 8 kv heads, 128k keys: the H200 (the fixture's bandwidth) takes the global
    # rule's 16 splits over the cluster's 8 long walks; the H100's slower memory (below) not
    (1, 131072, 8, 32, 1, ("global16", 16, 64, 3)),
    (1, 131072, 8, 32, 1, ("cluster", 8, 128, 3, 3.35e12)),
])
def test_decode_default_split_and_tile(b, cap, hk, h, sq, want, monkeypatch):
    """num_splits=0 on sm_90: the cluster rule and its 128-key tile at d128 (one m16 slice),
    the global rule where the cluster rule would leave the GPU idle, or would walk long key
    ranges on half the SMs of a device with an H200's memory bandwidth."""
    driver = DRIVER
    from flashcore.kernels import decode
    monkeypatch.setattr(decode, "_as_input", lambda a, *_: a)
    monkeypatch.setattr(driver, "set_function_attribute", lambda *a: None)
    if len(want) > 4:       # another device's peak bandwidth
        monkeypatch.setattr(jit, "peak_memory_bandwidth", lambda i, bw=want[4]: bw)
        want = want[:4]
    plans.clear()
    config.set(decode_cluster=True)
    rng = np.random.default_rng(9)
    c = _fused_case(b=b, cap=cap, hk=hk, h=h, sq=sq, splits=0)
    _decode(c, _decode_arrays(rng, c))
    (name, grid, _, _, _), = _kernel_launches()
    kind, splits, block_n, stages = want
    args = [a.strip() for a in name[name.index("<") + 1:-1].split(",")]
    assert int(args[2]) == block_n and int(args[4]) == stages, name
    if kind == "cluster":
        assert name.startswith("flash_decode_cluster_kernel<") and grid[2] == splits
    elif kind == "plain":
        assert name.startswith("flash_decode_kernel<") and grid[2] == 1
    elif kind == "global16":
        assert name.startswith("flash_decode_kernel<") and grid[2] == splits
    else:
        assert name.startswith("flash_decode_kernel<") and grid[2] > decode.MAX_CLUSTER


def test_kernels_unloaded_during_a_recording_are_not_recorded_and_plans_keep_theirs():
    rng = np.random.default_rng(14)
    c = _case(rng)
    q, k, v, out, lse = _fwd_arrays(rng, c)
    roles = (("q", q.data.ptr), ("k", k.data.ptr), ("v", v.data.ptr), ("o", out.data.ptr),
             ("lse", lse.data.ptr))
    with plans.record() as rec:
        plans.offer(forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1,
                                           window_left=-1, window_right=-1))
    plan = rec.plan(roles, 0)
    assert plan is not None and plan.kernels and all(isinstance(x, FakeKernel)
                                                     for x in plan.kernels)
    with plans.record() as rec:
        plans.offer(forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1,
                                           window_left=-1, window_right=-1))
        jit.clear_memory_cache()
    assert rec.plan(roles, 0) is None


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_tensor_maps_follow_the_arrays(which):
    """The warp-specialised Hopper kernels take tensor maps that hold the arrays' addresses:
    a replay with other arrays encodes them again (the fake encoder writes the address first)."""
    rng = np.random.default_rng(5)
    c = dict(dtype="float16", b=2, sq=300, sk=333, h=4, hk=2, d=128, wl=-1, wr=0, softcap=0.0,
             alibi=None, strided=False, deterministic=False, scale=0.1)
    run, make = (_forward, _fwd_arrays) if which == "forward" else (_backward, _bwd_arrays)
    n_args = params_dtype().itemsize
    for _ in range(2):                  # recorded, then replayed with new arrays
        arrays = make(rng, c)
        LOG.clear()
        run(c, arrays)
        ws = [raw for name, *_, raw in LOG if "_ws_kernel" in name]
        assert len(ws) == 1, [name for name, *_ in LOG]
        q, k, v = arrays[:3] if which == "forward" else arrays[1:4]
        # (the forward's fourth map: the output's, which its O buffers' TMA stores write)
        order = (q, k, v, arrays[3]) if which == "forward" else (q, k, v, arrays[0])
        for i, a in enumerate(order):
            off = n_args + i * tma.MAP_BYTES
            assert struct.unpack_from("<Q", ws[0], off)[0] == a.data.ptr


@pytest.mark.parametrize("d,causal,out_dtype,want", [(128, True, "float16", True),
                                                      (128, False, "float16", True),
                                                      (128, True, "float32", False),
                                                      (64, True, "float16", True),
                                                      (256, False, "float16", False),
                                                      (256, True, "float16", True)])
def test_output_tensor_map_where_the_kernel_has_o_buffers(d, causal, out_dtype, want):
    """The warp-specialised forward's fourth tensor map: the output's, with ``o_tma`` set,
    where the kernel has O buffers (head dims 64, 128, 256 with a window) and the output is
    16-bit; else q's again (unused), ``o_tma`` 0 and the instantiation without O buffers and
    their shared memory (a float32 output, head dim 256 without a window): the kernel then
    stores from the registers. A kernel with O buffers is never launched with ``o_tma`` 0."""
    from flashcore.kernels import forward
    q, k, v = _qkv(None, "float16", 2, 300, 333, 4, 2, d, False)
    out = fake_array(q.shape, out_dtype)
    lse = fake_array((2, 4, 300), np.float32)
    with config.override(sm90_fwd_d64_min_seqlen_k=0):
        forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                               window_right=0 if causal else -1)
    (name, _, _, smem, raw), = LOG
    assert "_ws_kernel" in name and smem <= 232448
    assert want == (name.count(",") == 10)
    assert smem == forward.sm90_ws_smem(d, causal, want)
    assert name == forward.sm90_ws_kernel_name("float16", d, causal, seqlen_k=333, o_tma=want)
    n = params_dtype().itemsize
    o_tma = np.frombuffer(raw[:n], np.int32)[params_dtype().fields["o_tma"][1] // 4]
    fourth = struct.unpack_from("<Q", raw, n + 3 * tma.MAP_BYTES)[0]
    assert bool(o_tma) == want
    assert fourth == (out.data.ptr if want else q.data.ptr)


@pytest.mark.parametrize("d,causal,dropout,sq,h,want_block,want_grid",
                         [(128, False, False, 300, 4, 384, (24, 1, 1)),      # 3 x 4 x 2 tiles
                          (128, True, False, 5000, 40, 384, (132, 1, 1)),    # one CTA per SM
                          (64, False, False, 1000, 4, 512, (48, 1, 1)),      # 192-row tiles
                          (64, True, True, 1000, 4, 512, (48, 1, 1)),        # dropout too
                          (128, False, True, 300, 4, 384, (24, 1, 1)),       # (ping-pong)
                          (256, True, False, 300, 4, 384, (3, 4, 2)),        # d256 windowed
                          (256, False, False, 300, 4, 384, (24, 1, 1))])
def test_warp_specialised_forward_grid(d, causal, dropout, sq, h, want_block, want_grid):
    """The Hopper forward's launch: persistent CTAs (one per SM at most, one per tile at
    least) taking tiles from the stream's counter, except where no persistent kernel exists
    (head dim 256 with a window); 192 query rows (three consumer warpgroups) at head dim 64,
    with dropout too; the shared memory within the H200's opt-in limit."""
    q, k, v = _qkv(None, "float16", 2, sq, 2048, h, 2, d, False)
    out = fake_array(q.shape, "float16")
    lse = fake_array((2, h, sq), np.float32)
    rng = fake_array((2,), np.int64) if dropout else None
    with config.override(sm90_fwd_d64_min_seqlen_k=0):
        forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                               window_right=0 if causal else -1,
                               dropout_p=0.1 if dropout else 0.0, rng_state=rng)
    (name, grid, block, smem, raw), = LOG
    assert "_ws_kernel" in name and block == (want_block, 1, 1) and grid == want_grid
    assert smem <= 232448
    persistent = grid[1:] == (1, 1) and name[name.index("<") + 1:-1].split(", ")[8] == "true"
    assert persistent == forward.ws_persistent_exists(d, causal, dropout)
    counter = np.frombuffer(raw, np.uint64)[params_dtype().fields["split_counter"][1] // 8]
    from flashcore.kernels import decode
    if persistent:     # the decode kernels' per-stream counter, zero between launches
        assert counter == decode.existing_split_counter(0, STREAM["ptr"], 1) != 0
    else:
        assert counter == 0
    with config.override(sm90_fwd_persistent=False, sm90_fwd_d64_min_seqlen_k=0):
        LOG.clear()
        forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                               window_right=0 if causal else -1,
                               dropout_p=0.1 if dropout else 0.0, rng_state=rng)
        (name, grid, *_), = LOG
        bm = 192 if d == 64 else 128
        assert (name[name.index("<") + 1:-1].split(", ")[8] == "false"
                and grid == (-(-sq // bm), h, 2))


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, False), (256, False),
                                      (256, True)])
def test_dropout_takes_the_tile_and_shared_memory_of_the_call_without(d, causal):
    """The warp-specialised forward with dropout: the tile, O buffers and shared memory of the
    same call without dropout (sm90_ws_smem), within the opt-in limit; the instantiation
    differs in its dropout flag alone."""
    from flashcore.kernels import forward
    q, k, v = _qkv(None, "float16", 2, 300, 333, 4, 2, d, False)
    out = fake_array(q.shape, "float16")
    lse = fake_array((2, 4, 300), np.float32)
    rng = fake_array((2,), np.int64)
    got = {}
    for p in (0.0, 0.1):
        LOG.clear()
        with config.override(sm90_fwd_d64_min_seqlen_k=0):
            forward.launch_forward(q, k, v, out, lse, softmax_scale=0.1, window_left=-1,
                                   window_right=0 if causal else -1, dropout_p=p,
                                   rng_state=rng if p else None)
        (name, _, _, smem, _), = LOG
        assert smem <= 232448 and smem == forward.sm90_ws_smem(d, causal), (p, smem)
        got[p] = name.split(", ")
    plain, drop = got[0.0], got[0.1]
    assert plain[5] == "false" and drop[5] == "true", drop
    assert plain[:5] + plain[6:] == drop[:5] + drop[6:], (plain, drop)


def test_warp_specialised_tiles_fit_shared_memory():
    for (d, local) in forward._WS_TILES:
        assert forward.sm90_ws_smem(d, local) <= 232448, (d, local)
