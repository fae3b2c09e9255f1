"""The memo of validated calls in flashcore.spec: a repeated call gets the very spec a full
validation would give, anything that changes the answer changes the key, and a refused call
is refused again (never memoised)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from flashcore import spec as S
from test_fuzz_validation import attention_args


def _full(fn, *a, **kw):
    """The spec (or the exception) of a validation that bypasses the memo."""
    saved = dict(S._SPEC_MEMO)
    S._SPEC_MEMO.clear()
    try:
        return fn(*a, **kw)
    except (TypeError, ValueError) as e:
        return (type(e), str(e))
    finally:
        S._SPEC_MEMO.clear()
        S._SPEC_MEMO.update(saved)


def _memo(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except (TypeError, ValueError) as e:
        return (type(e), str(e))


@settings(max_examples=300, deadline=None)
@given(attention_args())
def test_memoised_forward_spec_equals_full_validation(case):
    _, a, kw = case
    first = _memo(S.forward_spec, a["q"], a["k"], a["v"], **kw)
    again = _memo(S.forward_spec, a["q"], a["k"], a["v"], **kw)
    assert first == again == _full(S.forward_spec, a["q"], a["k"], a["v"], **kw)


@settings(max_examples=200, deadline=None)
@given(attention_args())
def test_memoised_backward_spec_equals_full_validation(case):
    _, a, kw = case
    q = a["q"]
    if not hasattr(q, "shape") or len(getattr(q, "shape", ())) != 4:
        return
    lse = np.zeros((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    args = (q, q, a["k"], a["v"], q, lse)
    first = _memo(S.backward_spec, *args, **kw)
    again = _memo(S.backward_spec, *args, **kw)
    assert first == again == _full(S.backward_spec, *args, **kw)


def test_hit_returns_the_same_object_and_layout_changes_miss():
    S._SPEC_MEMO.clear()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 8, 4, 16))
    s1 = S.forward_spec(q, q, q, causal=True)
    assert S.forward_spec(q, q, q, causal=True) is s1
    assert S.forward_spec(q, q, q, causal=False).causal is False
    assert S.forward_spec(q, q, q, causal=True, softmax_scale=0.5).softmax_scale == 0.5
    assert S.forward_spec(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32),
                          causal=True).dtype == "float32"
    kv = rng.standard_normal((2, 5, 2, 16))
    assert S.forward_spec(q, kv, kv, causal=True).seqlen_k == 5
    # same shape, other strides: the last one is no longer contiguous -> refused every time
    bad = np.repeat(q, 2, axis=-1)[..., ::2]
    for _ in range(2):
        with pytest.raises(ValueError, match="argument 'q'"):
            S.forward_spec(bad, q, q)


def test_refusals_are_not_memoised():
    S._SPEC_MEMO.clear()
    q = np.zeros((1, 4, 2, 8))
    for _ in range(3):
        with pytest.raises(ValueError, match="softmax_scale"):
            S.forward_spec(q, q, q, softmax_scale=float("nan"))
    assert not S._SPEC_MEMO


def test_unkeyable_options_are_validated_in_full():
    S._SPEC_MEMO.clear()
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match="window_size"):
        S.forward_spec(q, q, q, window_size={"left": 1})
    assert S.forward_spec(q, q, q, window_size=[2, 0]).window_left == 2
    assert S._memo_key("fwd", (q,), None, ({1: 2},)) is None


def test_memo_is_bounded():
    S._SPEC_MEMO.clear()
    q = np.zeros((1, 4, 2, 8))
    for i in range(S._SPEC_MEMO_MAX + 10):
        S.forward_spec(q, q, q, softmax_scale=1.0 + i)
    assert len(S._SPEC_MEMO) <= S._SPEC_MEMO_MAX
