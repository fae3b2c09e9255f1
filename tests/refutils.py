"""Shared test helpers: random problems and the flash-attn correctness rule."""
from __future__ import annotations

import numpy as np

from flashcore.reference import naive_backward, naive_forward
from flashcore.spec import forward_spec


def rand(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def make_problem(rng, b=2, sq=33, sk=47, h=4, hk=2, d=16, dtype=np.float64):
    q = rand(rng, (b, sq, h, d), dtype)
    k = rand(rng, (b, sk, hk, d), dtype)
    v = rand(rng, (b, sk, hk, d), dtype)
    return q, k, v


def slopes_array(spec_like_alibi, b, h, rng):
    if spec_like_alibi is None:
        return None
    if spec_like_alibi == "per_head":
        return rng.uniform(0.01, 0.5, size=(h,)).astype(np.float32)
    return rng.uniform(0.01, 0.5, size=(b, h)).astype(np.float32)


def reference(q, k, v, dout=None, round_to=None, **kw):
    """Naive reference on float32/float64 NumPy arrays of dense layout: (out, lse[, grads])."""
    spec = forward_spec(q, k, v, **{x: y for x, y in kw.items() if x != "alibi_slopes"},
                        alibi_slopes=kw.get("alibi_slopes"))
    slopes = kw.get("alibi_slopes")
    if slopes is not None and np.ndim(slopes) == 1:
        slopes = np.broadcast_to(np.asarray(slopes)[None], (q.shape[0], len(slopes)))
    out, lse = naive_forward(spec, q, k, v, slopes, round_to=round_to)
    if dout is None:
        return out, lse
    return out, lse, naive_backward(spec, dout, q, k, v, slopes, round_to=round_to)


def max_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    with np.errstate(invalid="ignore"):
        d = np.where(both_inf, 0.0, np.abs(a - b))
    return float(np.nanmax(d)) if d.size else 0.0


def assert_flash_rule(name, got, ref_hi, ref_lo, factor, atol=1e-5):
    """flash-attn's rule: |got - ref_hi| <= factor * |ref_lo - ref_hi| + atol (max abs)."""
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any() or np.isnan(ref_hi).any(), f"{name}: NaN in result"
    e_got = max_err(got, ref_hi)
    e_lo = max_err(ref_lo, ref_hi)
    assert e_got <= factor * e_lo + atol, (
        f"{name}: max error {e_got:.3e} > {factor} x low-precision error {e_lo:.3e} + {atol:g}")
    return e_got, e_lo


def to_dev(x32, dtype):
    """A host float32 array as a CuPy array of ``dtype`` ('float16', 'bfloat16', ...)."""
    import cupy
    if dtype == "bfloat16":
        import ml_dtypes
        return cupy.asarray(x32.astype(ml_dtypes.bfloat16))
    return cupy.asarray(x32.astype(dtype))


def quantize(x32, dtype):
    """The values a ``dtype`` array holds, as float32 on the host."""
    from flashcore.reference import round_to_dtype
    return round_to_dtype(x32, dtype).astype(np.float32)


def inf_case(rng, where, b=3, sq=130, sk=150, h=4, hk=2, d=64):
    """float32 q, k, v with one +inf at [1, 5, 0, 3] of ``where`` (batch 1, row/key 5, head or
    kv head 0, column 3), and the (batch, row, head, column) mask of the outputs that exact
    causal attention (bottom-right) leaves non-finite or allows to be non-finite:
    returns (q, k, v, must_be_bad, may_be_bad), boolean masks shaped like the output.

    q: the row's score against key j is +-inf by the sign of k[1, j, 0, 3]; one +inf among
    its visible keys makes the row NaN (inf - inf in the softmax). k: a row i that sees key 5
    scores it +-inf by the sign of q[1, i, h, 3] (h = 0, 1 share kv head 0): +inf -> NaN row,
    -inf -> that key's probability is 0 and the row stays finite. v: column 3 of every row
    that sees key 5 is +inf or NaN (0 * inf where a probability underflows or is masked in the
    same key block), in heads 0, 1.
    """
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hk, d)).astype(np.float32)
    {"q": q, "k": k, "v": v}[where][1, 5, 0, 3] = np.inf
    off = sk - sq
    must = np.zeros(q.shape, bool)
    may = np.zeros(q.shape, bool)
    group = h // hk
    if where == "q":
        visible = k[1, : 5 + off + 1, 0, 3]
        assert (visible > 0).any(), "pick a seed where the row sees a positive k[..., 3]"
        must[1, 5, 0] = True
        may[1, 5, 0] = True
    else:
        sees = np.arange(sq) + off >= 5                      # rows i with key 5 visible
        for hh in range(group):                              # query heads of kv head 0
            if where == "k":
                pos = sees & (q[1, :, hh, 3] > 0)
                must[1, pos, hh] = True
                may[1, pos, hh] = True
            else:
                must[1, sees, hh, 3] = True
                may[1, :, hh, 3] = True
    return q, k, v, must, may
