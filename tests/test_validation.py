"""Every validation rule: the exception type and a message naming the argument, before any
backend runs."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore.backends.base import NotSupportedError

rng = np.random.default_rng(0)


def arr(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


Q, K, V = arr(2, 8, 4, 16), arr(2, 10, 2, 16), arr(2, 10, 2, 16)


def call(**over):
    a = dict(q=Q, k=K, v=V)
    a.update(over)
    kw = {k: v for k, v in a.items() if k not in "qkv"}
    return flashcore.attention_forward(a["q"], a["k"], a["v"], **kw)


@pytest.mark.parametrize("over,exc,words", [
    (dict(q=arr(8, 4, 16)), ValueError, ["'q'", "4-dimensional", "(8, 4, 16)"]),
    (dict(k=arr(2, 10, 16)), ValueError, ["'k'", "4-dimensional"]),
    (dict(k=arr(3, 10, 2, 16), v=arr(3, 10, 2, 16)), ValueError, ["'k'", "batch 2"]),
    (dict(k=arr(2, 10, 2, 8), v=arr(2, 10, 2, 8)), ValueError, ["'k'", "headdim 16"]),
    (dict(v=arr(2, 11, 2, 16)), ValueError, ["'v'", "(2, 10, 2, 16)", "(2, 11, 2, 16)"]),
    (dict(k=arr(2, 10, 3, 16), v=arr(2, 10, 3, 16)), ValueError, ["'k'", "divides", "3 heads"]),
    (dict(q=arr(2, 8, 4, 16, dtype=np.int32) if False else rng.integers(0, 3, (2, 8, 4, 16))),
     TypeError, ["'q'", "floating dtype", "int64"]),
    (dict(k=arr(2, 10, 2, 16, dtype=np.float64)), TypeError, ["'k'", "float32", "float64"]),
    (dict(q=[[1.0]]), TypeError, ["'q'", "numpy.ndarray", "list"]),
    (dict(q=np.asfortranarray(arr(2, 8, 4, 16))), ValueError, ["'q'", "contiguous last dimension"]),
    (dict(window_size=(-2, 0)), ValueError, ["window_size[0]", ">= -1", "-2"]),
    (dict(window_size=(1,)), TypeError, ["window_size", "pair"]),
    (dict(window_size=(1.5, 0)), TypeError, ["window_size[0]", "int"]),
    (dict(softcap=-1.0), ValueError, ["'softcap'", ">= 0", "-1.0"]),
    (dict(softcap=float("nan")), ValueError, ["'softcap'", "finite"]),
    (dict(softmax_scale=float("inf")), ValueError, ["'softmax_scale'", "finite"]),
    (dict(softmax_scale="0.5"), TypeError, ["'softmax_scale'", "real number", "str"]),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, ["'alibi_slopes'", "(4,)", "(2, 4)", "(3,)"]),
    (dict(alibi_slopes=np.ones(4, np.int32)), TypeError, ["'alibi_slopes'", "float32", "int32"]),
    (dict(backend="nope"), ValueError, ["'backend'", "'nope'", "numpy"]),
    (dict(backend=3), TypeError, ["'backend'", "int"]),
    (dict(cu_seqlens_q=np.array([0, 8], np.int32)), TypeError, []),
])
def test_forward_rejects(over, exc, words):
    with pytest.raises(exc) as e:
        call(**over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_zero_heads_refused():
    with pytest.raises(ValueError, match="'q'.*at least one head"):
        call(q=arr(2, 8, 0, 16))


def test_other_strides_are_accepted():
    big = arr(2, 16, 8, 16)
    out, lse = flashcore.attention_forward(big[:, ::2, ::2], K, V)
    assert out.shape == (2, 8, 4, 16)


def test_backend_wrong_library_lists_reason():
    with pytest.raises(NotSupportedError, match="cupy.*cannot run|not available|takes cupy"):
        call(backend="cupy")


def varlen(**over):
    a = dict(q=arr(8, 4, 16), k=arr(9, 2, 16), v=arr(9, 2, 16),
             cu_seqlens_q=np.array([0, 3, 8], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32))
    a.update(over)
    return flashcore.varlen_attention_forward(a.pop("q"), a.pop("k"), a.pop("v"),
                                              a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), **a)


@pytest.mark.parametrize("over,exc,words", [
    (dict(cu_seqlens_q=np.array([0, 3, 8], np.int64)), TypeError, ["'cu_seqlens_q'", "int32", "int64"]),
    (dict(cu_seqlens_q=np.array([0, 5, 3, 8], np.int32)), ValueError, ["'cu_seqlens_q'", "non-decreasing"]),
    (dict(cu_seqlens_q=np.array([0, 3, 9], np.int32)), ValueError, ["'cu_seqlens_q'", "(8)", "9"]),
    (dict(cu_seqlens_q=np.array([1, 3, 8], np.int32)), ValueError, ["'cu_seqlens_q'", "== 0"]),
    (dict(cu_seqlens_q=np.array([8], np.int32)), ValueError, ["'cu_seqlens_q'", "batch+1"]),
    (dict(cu_seqlens_k=np.array([0, 9], np.int32)), ValueError, ["'cu_seqlens_k'", "length 3"]),
    (dict(cu_seqlens_k=None), ValueError, ["'cu_seqlens_k'", "None"]),
    (dict(max_seqlen_q=4), ValueError, ["'max_seqlen_q'", "longest", "(5)"]),
    (dict(cu_seqlens_q=np.array([[0, 3, 8]], np.int32)), ValueError, ["'cu_seqlens_q'", "1-dimensional"]),
    (dict(q=arr(2, 8, 4, 16)), ValueError, ["'q'", "3-dimensional"]),
])
def test_varlen_rejects(over, exc, words):
    # (a last entry below the packed rows is allowed: the rows after it belong to no sequence)
    with pytest.raises(exc) as e:
        varlen(**over)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_varlen_default_max_seqlen_ok():
    out, lse = varlen()
    assert out.shape == (8, 4, 16) and lse.shape == (4, 8)


@pytest.mark.parametrize("which,bad,exc,words", [
    ("dout", arr(2, 8, 4, 8), ValueError, ["'dout'", "shape of 'q'"]),
    ("out", arr(2, 8, 4, 16, dtype=np.float64), TypeError, ["'out'", "float32"]),
    ("lse", arr(2, 4, 9), ValueError, ["'lse'", "(2, 4, 8)"]),
    ("lse", arr(2, 4, 8, dtype=np.float16), TypeError, ["'lse'", "float32"]),
])
def test_backward_rejects(which, bad, exc, words):
    out, lse = flashcore.attention_forward(Q, K, V)
    a = dict(dout=arr(2, 8, 4, 16), out=out, lse=lse)
    a[which] = bad
    with pytest.raises(exc) as e:
        flashcore.attention_backward(a["dout"], Q, K, V, a["out"], a["lse"])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_backends_report():
    b = flashcore.available_backends()
    assert b["numpy"] is None
    for name in ("cupy", "torch"):
        assert name in b


def test_import_does_not_pull_torch_or_cupy():
    import subprocess
    import sys
    code = ("import sys, flashcore; import numpy as np; "
            "flashcore.attention(np.ones((1,2,1,8)), np.ones((1,2,1,8)), np.ones((1,2,1,8))); "
            "bad = [m for m in ('torch', 'cupy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_preallocated_outputs_are_for_cupy_only_and_named():
    q = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="argument 'out'"):
        flashcore.attention_forward(q, q, q, out=np.empty_like(q))
    out, lse = flashcore.attention_forward(q, q, q)
    with pytest.raises(TypeError, match="argument 'dk'"):
        flashcore.attention_backward(q, q, q, q, out, lse, dk=np.empty_like(q))


def test_window_size_as_any_pair_of_ints():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 9, 2, 8)).astype(np.float32)
    want, _ = flashcore.attention_forward(q, q, q, window_size=(3, 1))
    for w in ([3, 1], np.array([3, 1]), (np.int64(3), np.int32(1))):
        got, _ = flashcore.attention_forward(q, q, q, window_size=w)
        np.testing.assert_array_equal(got, want)
    torch = pytest.importorskip("torch")
    got, _ = flashcore.attention_forward(q, q, q, window_size=torch.tensor([3, 1]))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="window_size"):
        flashcore.attention_forward(q, q, q, window_size=np.array([3, 1, 2]))


def test_varlen_rows_past_the_last_sequence_are_ignored():
    """flash-attn's rule: rows past cu_seqlens[-1] belong to no sequence; the sequences'
    rows equal those of the same call without the trailing rows."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((8, 4, 16), (9, 2, 16), (9, 2, 16)))
    cu_q, cu_k = np.array([0, 3, 6], np.int32), np.array([0, 4, 7], np.int32)
    o, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k)
    o2, lse2 = flashcore.varlen_attention_forward(q[:6], k[:7], v[:7], cu_q, cu_k)
    np.testing.assert_array_equal(o[:6], o2)
    np.testing.assert_array_equal(lse[:, :6], lse2)


def test_out_of_memory_errors_become_device_memory_errors():
    """raise_oom (the full calls' and the launch plans' replays' path): an allocator's
    OutOfMemoryError (CuPy's or torch's, by class name) becomes DeviceMemoryError with the
    failed allocation's size; any other error is left to the caller."""
    from flashcore import DeviceMemoryError
    from flashcore.backends.base import raise_oom

    class OutOfMemoryError(Exception):
        pass
    with pytest.raises(DeviceMemoryError) as e:
        raise_oom(OutOfMemoryError("Out of memory allocating 8,388,608 bytes (allocated so "
                                   "far: 0 bytes, limit set to: 4,096 bytes)."), "forward")
    assert e.value.nbytes == 8_388_608 and "forward" in str(e.value)
    assert raise_oom(ValueError("allocating 8 bytes"), "forward") is None
