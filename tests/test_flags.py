"""Every flag of every public function is a bool: ``causal="no"`` (truthy) or ``1`` must be
refused by name before anything runs, never read as its truth value. ``numpy.bool_`` counts as
a bool. NumPy arrays and, where torch is installed, torch's CPU tensors (their own route)."""
from __future__ import annotations

import numpy as np
import pytest

import flashcore
from flashcore import config
from flashcore import flash_attn as fa

BAD = ["no", 1, 0, None, 1.0]
B, S, H, HK, D = 2, 8, 4, 2, 16


def _arrays(lib):
    rng = np.random.default_rng(0)
    a = dict(q=rng.standard_normal((B, S, H, D)), k=rng.standard_normal((B, S, HK, D)),
             v=rng.standard_normal((B, S, HK, D)), dout=rng.standard_normal((B, S, H, D)),
             k_cache=rng.standard_normal((B, 2 * S, HK, D)),
             v_cache=rng.standard_normal((B, 2 * S, HK, D)),
             k_new=rng.standard_normal((B, 1, HK, D)), v_new=rng.standard_normal((B, 1, HK, D)))
    a = {n: x.astype(np.float32) for n, x in a.items()}
    a["cu"] = np.array([0, S, 2 * S], np.int32)
    a["seqlens"] = np.array([3, 5], np.int32)
    if lib == "torch":
        torch = pytest.importorskip("torch")
        a = {n: torch.from_numpy(x) for n, x in a.items()}
    a["out"], a["lse"] = flashcore.attention_forward(a["q"], a["k"], a["v"])
    packed = {n: a[n].reshape(B * S, *a[n].shape[2:]) for n in ("q", "k", "v", "dout")}
    a["vout"], a["vlse"] = flashcore.varlen_attention_forward(
        packed["q"], packed["k"], packed["v"], a["cu"], a["cu"])
    a["packed"] = packed
    return a


def _host(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def _kvcache(fn, a, **flags):
    return fn(a["q"][:, :1], a["k_cache"], a["v_cache"], a["k_new"], a["v_new"],
              cache_seqlens=a["seqlens"], **flags)


def _varlen(fn, a, **flags):
    p = a["packed"]
    return fn(p["q"], p["k"], p["v"], a["cu"], a["cu"], S, S, **flags)


#: (name, call(arrays, **flags), the flags it takes)
CALLS = [
    ("attention", lambda a, **f: flashcore.attention(a["q"], a["k"], a["v"], **f),
     ["causal", "deterministic", "return_lse"]),
    ("attention_forward", lambda a, **f: flashcore.attention_forward(a["q"], a["k"], a["v"], **f),
     ["causal", "deterministic"]),
    ("attention_backward", lambda a, **f: flashcore.attention_backward(
        a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **f), ["causal", "deterministic"]),
    ("varlen_attention", lambda a, **f: _varlen(flashcore.varlen_attention, a, **f),
     ["causal", "deterministic", "return_lse"]),
    ("varlen_attention_forward", lambda a, **f: _varlen(flashcore.varlen_attention_forward, a,
                                                        **f), ["causal", "deterministic"]),
    ("varlen_attention_backward", lambda a, **f: flashcore.varlen_attention_backward(
        a["packed"]["dout"], a["packed"]["q"], a["packed"]["k"], a["packed"]["v"], a["vout"],
        a["vlse"], a["cu"], a["cu"], S, S, **f), ["causal", "deterministic"]),
    ("attention_with_kvcache", lambda a, **f: _kvcache(flashcore.attention_with_kvcache, a, **f),
     ["causal", "rotary_interleaved", "return_lse"]),
    ("flash_attn_func", lambda a, **f: fa.flash_attn_func(a["q"], a["k"], a["v"], **f),
     ["causal", "deterministic", "return_attn_probs"]),
    ("flash_attn_varlen_func", lambda a, **f: _varlen(fa.flash_attn_varlen_func, a, **f),
     ["causal", "deterministic", "return_attn_probs"]),
    ("flash_attn_with_kvcache", lambda a, **f: _kvcache(fa.flash_attn_with_kvcache, a, **f),
     ["causal", "rotary_interleaved", "return_softmax_lse"]),
]
CASES = [(name, call, flag) for name, call, flags in CALLS for flag in flags]
IDS = [f"{name}-{flag}" for name, _, flag in CASES]


@pytest.fixture(scope="module", params=["numpy", "torch"])
def arrays(request):
    return _arrays(request.param)


@pytest.mark.parametrize("name,call,flag", CASES, ids=IDS)
def test_a_flag_that_is_not_a_bool_is_refused_by_name(arrays, name, call, flag):
    cache = _host(arrays["k_cache"]).copy()
    for bad in BAD:
        with pytest.raises(TypeError) as e:
            call(arrays, **{flag: bad})
        assert f"argument '{flag}'" in str(e.value) and "a bool" in str(e.value), str(e.value)
    # refused before anything ran: the cache the KV-cache calls append to is as it was
    np.testing.assert_array_equal(_host(arrays["k_cache"]), cache)


@pytest.mark.parametrize("name,call,flag", CASES, ids=IDS)
def test_numpy_bool_is_a_bool(arrays, name, call, flag):
    """np.bool_ (what a comparison of NumPy values gives) is taken, as its value."""
    as_python = call(arrays, **{flag: True})
    as_numpy = call(arrays, **{flag: np.bool_(True)})
    assert type(as_python) is type(as_numpy)
    if isinstance(as_python, tuple):
        assert len(as_python) == len(as_numpy)


@pytest.mark.parametrize("fn", ["ring_attention", "varlen_attention_all_gather"])
def test_distributed_flags_are_bools(fn):
    torch = pytest.importorskip("torch")
    from flashcore import distributed
    q = torch.zeros(1, 4, 2, 8) if fn == "ring_attention" else torch.zeros(4, 2, 8)
    args = (q, q, q) if fn == "ring_attention" else (q, q, q, [0, 4])
    flags = ["causal", "return_lse"] if fn == "ring_attention" else ["causal"]
    for flag in flags:
        # refused by name before the check for an initialised process group
        with pytest.raises(TypeError, match=f"argument '{flag}': expected a bool"):
            getattr(distributed, fn)(*args, **{flag: "no"})


def test_config_flags_are_bools():
    flags = [n for n, v in config.get()._asdict().items() if isinstance(v, bool)]
    assert "debug" in flags and len(flags) >= 5
    before = config.get()
    for name in flags:
        for bad in ("no", 1, None):
            with pytest.raises(TypeError, match=f"argument '{name}': expected a bool"):
                config.set(**{name: bad})
    assert config.get() == before            # nothing changed by a refused call
    with config.override(debug=True):
        assert config.debug() is True


def test_sm90_defines_come_from_the_environment_and_are_checked():
    """FLASHCORE_SM90_DEFINES (space-separated -DNAME[=VALUE]) sets ``sm90_defines`` at import,
    so that the GPU tests can run against a candidate define; anything but defines is refused
    by name, from the environment and from config.set alike."""
    import os
    import subprocess
    import sys
    code = "from flashcore import config; print(config.get().sm90_defines)"
    env = dict(os.environ, FLASHCORE_SM90_DEFINES=" -DFC_A  -DFC_B=2 ")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('-DFC_A', '-DFC_B=2')"
    env["FLASHCORE_SM90_DEFINES"] = "-DFC_A -O3"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "FLASHCORE_SM90_DEFINES" in out.stderr and "-O3" in out.stderr
    before = config.get()
    with pytest.raises(ValueError, match="argument 'sm90_defines'"):
        config.set(sm90_defines=["-DFC_A", "--use_fast_math"])
    with pytest.raises(TypeError, match="argument 'sm90_defines'"):
        config.set(sm90_defines="-DFC_A")
    assert config.get() == before
    with config.override(sm90_defines=["-DFC_A"]):
        assert config.get().sm90_defines == ("-DFC_A",)
    assert config.get() == before
