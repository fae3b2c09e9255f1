"""Launch plans (flashcore/kernels/plans.py) replay exactly what the full launchers do.

Runs without a GPU: the kernels are stand-ins that record each launch (name, grid, block,
shared memory, the struct's bytes), the arrays are CuPy arrays over made-up addresses, and the
device queries are answered for an H200. For random layouts and options, the launches of a
replayed call must equal those of a full run of the launcher with the same arrays, byte for
byte, except the addresses of the per-call scratch buffers."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from flashcore import jit  # noqa: E402
from flashcore.kernels import backward, forward, plans  # noqa: E402
from flashcore.kernels.params import params_dtype  # noqa: E402

LOG: list = []
_NEXT = itertools.count(1)


class FakeKernel:
    def __init__(self, name):
        self.name = name

    def __call__(self, grid, block, args, shared_mem=0):
        LOG.append((self.name, tuple(grid), tuple(block), shared_mem, bytes(args[0].tobytes())))


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
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(cupy, "empty", _alloc)
    monkeypatch.setattr(cupy, "zeros", _alloc)
    monkeypatch.setattr(cupy, "empty_like", lambda a, **k: _alloc(a.shape, a.dtype))

    def ascontig(a, dtype=None):
        if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return _alloc(a.shape, dtype or a.dtype)    # a "copy": a new array
    monkeypatch.setattr(cupy, "ascontiguousarray", ascontig)

    def as_input(a):   # the launchers' copy of an input the kernels cannot read in place
        from flashcore.kernels.common import _used_strides_ok
        return a if a.size == 0 or _used_strides_ok(a, 8, 16) else _alloc(a.shape, a.dtype)
    for mod in (forward, backward):
        monkeypatch.setattr(mod, "_as_input", as_input)
    plans.clear()
    plans.set_enabled(True)
    LOG.clear()
    yield
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


def _forward(c, arrays):
    q, k, v, out, lse = arrays
    forward.launch_forward(q, k, v, out, lse, softmax_scale=c["scale"], window_left=c["wl"],
                           window_right=c["wr"], softcap=c["softcap"], alibi_slopes=c["alibi"])


def _backward(c, arrays):
    do, q, k, v, out, lse, dq, dk, dv = arrays
    backward.launch_backward(do, q, k, v, out, lse, dq, dk, dv, softmax_scale=c["scale"],
                             window_left=c["wl"], window_right=c["wr"], softcap=c["softcap"],
                             alibi_slopes=c["alibi"], deterministic=c["deterministic"])


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


def test_scratch_is_fresh_and_zeroed_where_needed(monkeypatch):
    made = []

    def alloc(shape, dtype=np.float32, **kw):
        a = _alloc(shape, dtype)
        made.append(("zeros" if alloc.zero else "empty", tuple(a.shape)))
        return a
    alloc.zero = False
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: (setattr(alloc, "zero", False), alloc(*a, **k))[1])
    monkeypatch.setattr(cupy, "zeros", lambda *a, **k: (setattr(alloc, "zero", True), alloc(*a, **k))[1])
    rng = np.random.default_rng(5)
    c = dict(_case(rng), deterministic=False, sq=100, sk=90, b=2, h=4, hk=2, d=64)
    arrays = _bwd_arrays(rng, c)
    _backward(c, arrays)
    made.clear()
    _backward(c, arrays)       # replay
    assert ("zeros", (2, 4, 100, 64)) in made        # the fp32 dQ accumulator, zero-filled
    assert ("empty", (2, 4, 100)) in made            # D = rowsum(dO * O)


def test_copies_and_unaligned_arrays_are_never_recorded():
    rng = np.random.default_rng(9)
    c = _case(rng)
    q, k, v, out, lse = _fwd_arrays(rng, c)
    odd = fake_array(q.shape, q.dtype, align=8)       # 8-byte aligned: the launcher copies it
    _forward(c, (odd, k, v, out, lse))
    assert not plans.PLANS
    _forward(c, (q, k, v, out, lse))
    assert len(plans.PLANS) == 1
    key = next(iter(plans.PLANS))
    assert ("fwd", 0) == key[:2]


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
    a plan recorded for one alignment must not serve another (review finding)."""
    a8 = fake_array((2, 8, 2, 64), np.float16, align=8)
    a2 = fake_array((2, 8, 2, 64), np.float16, align=2)
    a0 = fake_array((2, 8, 2, 64), np.float16)
    keys = {plans.layout_key(a) for a in (a8, a2, a0)}
    assert len(keys) == 3


def test_tile_overrides_and_kernel_reloads_drop_the_plans():
    rng = np.random.default_rng(12)
    c = _case(rng)
    _forward(c, _fwd_arrays(rng, c))
    assert plans.PLANS
    forward.set_tile_override(64, None)
    assert not plans.PLANS
    _forward(c, _fwd_arrays(rng, c))
    assert plans.PLANS
    jit.clear_memory_cache()
    assert not plans.PLANS


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
    LOG.append(("returned", decode.launch_decode(
        q, kc, vc, out, lse, cache_seqlens=seqlens, block_table=bt, softmax_scale=c["scale"],
        window_left=c["wl"], window_right=c["wr"], softcap=c["softcap"],
        num_splits=c["splits"]), (), 0, b""))


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
    monkeypatch.setattr(decode, "_as_input", lambda a: a)
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
