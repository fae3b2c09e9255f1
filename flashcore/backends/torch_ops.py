"""The torch route, flash-attn's, the same eagerly and under ``torch.compile``:

1. Three ``torch.library`` ops, ``flashcore::fwd``, ``flashcore::bwd`` and
   ``flashcore::kvcache`` (which writes the cache in place), with fake (shape-only)
   implementations: ``torch.compile(fullgraph=True)`` traces through flashcore without a
   graph break and ``torch.library.opcheck`` passes. One op serves padded and varlen calls:
   ``cu_seqlens_q`` present means varlen. Their kernels replay the launch plan recorded for
   the call's layout (flashcore.kernels.plans: the one per-layout cache, keyed on the op's
   arguments), or validate the call in full, run it through the torch backend
   (:mod:`flashcore.backends.torch_backend`) and record it.
2. An autograd Function over the ops: the forward saves ``(q, k, v, out, lse)``, the backward
   calls ``flashcore::bwd``. ``lse`` is not differentiable; differentiating the backward
   (double backward) is refused.
3. :func:`autograd_attention` (behind ``flashcore.attention``) turns plain option values into
   the ops' arguments (anything else is validated by flashcore.spec first, as is every call
   traced by torch.compile) and applies the Function; :func:`kvcache_attention` (behind
   ``flashcore.attention_with_kvcache``) calls the kvcache op the same way.

Nothing here imports torch at flashcore import time: the ops are defined when torch is
imported (an import hook, or at once if torch is already loaded) or at the first call.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import threading

from .. import config
from .._arrays import dtype_name
from ..jit import _GENERATION
from ..kernels import plans
from ..kernels.plans import PLANS
from ..spec import backward_spec, forward_spec, lse_shape, out_fp32
from .base import choose, choose_kvcache
from .torch_backend import _BACKEND, layout, replay

__all__ = ["autograd_attention", "kvcache_attention", "kvcache_read", "torch_ops",
           "DOUBLE_BACKWARD_MESSAGE"]

DOUBLE_BACKWARD_MESSAGE = (
    "flashcore: double backward is not supported (the attention backward is not itself "
    "differentiable); use torch.nn.functional.scaled_dot_product_attention's math backend "
    "for higher-order gradients")


# --------------------------------------------------------------------------------------------
# Layer 2: torch.library custom ops with fake implementations
# --------------------------------------------------------------------------------------------

# The call's scalar options cross the op boundary as one float list (a schema cannot take a
# spec; one list argument costs the dispatcher ~1 us a call less than eight scalars):
# [max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
#  deterministic], ints and bools as floats (exact), the window already folded with `causal`
# by flashcore.spec, -1 meaning unbounded. _unpacked() reads it back.
_OPTIONS = "float[] options"
# The options come right after the tensors every call has; every other argument follows, with
# a default, and a call leaves out those it does not use (the dense call: fwd(q, k, v,
# options), bwd(dout, q, k, v, out, lse, options)): each argument given costs the dispatcher,
# None too (stubbed: ~0.3 us a call for the three optional tensors). (block_table: varlen over
# a paged cache, forward only; out_fp32: the output in float32 for 16-bit inputs, for partial
# results.)
_FWD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}, Tensor? alibi_slopes=None, "
               "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? block_table=None, "
               "bool out_fp32=False, float dropout_p=0.0, Tensor? rng_state=None) "
               "-> (Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
               f"{_OPTIONS}, Tensor? alibi_slopes=None, Tensor? cu_seqlens_q=None, "
               "Tensor? cu_seqlens_k=None, float dropout_p=0.0, Tensor? rng_state=None) "
               "-> (Tensor, Tensor, Tensor)")


# The decode ops' scalar options, likewise one float list: [cache_seqlens_int (the lengths
# when cache_seqlens is an int, then cache_seqlens is None), rotary_interleaved, causal,
# softmax_scale, window_left, window_right, softcap, num_splits]; every optional tensor after
# it, with a default (a decoding step over a plain cache passes five arguments).
_KV_SCHEMA = ("(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
              f"Tensor? cache_seqlens, {_OPTIONS}, Tensor? block_table=None, "
              "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? alibi_slopes=None, "
              "Tensor? cache_leftpad=None, Tensor? key_mask=None) -> (Tensor, Tensor)")


# The decode op without appending: nothing is written but the outputs, so the schema declares
# no mutation (a mutable schema costs the dispatcher ~15 us a call on the H200 host). An FP8
# cache (torch.float8_e4m3fn, read only: only this op takes one) comes with its descales:
# float32 (batch, nheads_k), contiguous. The optional tensors come in the order the common
# calls need them (a paged cache's table, then the transformers route's key mask and left
# padding), so that those calls pass few Nones. Its options may hold a ninth entry,
# heads_first: q, k_cache and v_cache then come as (batch, heads, seq, dim), the layout
# transformers hands its attention functions (three transposed views a call fewer: 1-3 us of
# host time a decoding layer on the H100's host, run 228), and out comes as (batch, seq_q,
# heads, dim), contiguous.
_KV_READ_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cache_seqlens, "
                   f"{_OPTIONS}, Tensor? block_table=None, Tensor? key_mask=None, "
                   "Tensor? cache_leftpad=None, Tensor? alibi_slopes=None, "
                   "Tensor? k_descale=None, Tensor? v_descale=None) -> (Tensor, Tensor)")

_OPS: list = []   # [torch.ops.flashcore], filled by torch_ops() on first use
_OPS_LOCK = threading.Lock()


def torch_ops():
    """``torch.ops.flashcore`` with ``fwd`` and ``bwd`` defined (imports torch on first use)."""
    if _OPS:
        return _OPS[0]
    with _OPS_LOCK:      # (first calls from several threads at once define them once)
        if _OPS:
            return _OPS[0]
        import torch
        if torch.compiler.is_compiling():
            # Defining an op is not traceable. The ops are defined when flashcore is imported
            # after torch, or at the first eager call; here neither happened.
            raise RuntimeError(
                "flashcore: the torch custom ops are not defined yet and cannot be defined while "
                "torch.compile traces; import torch before flashcore, or call "
                "flashcore.backends.torch_ops.torch_ops() once before compiling")
        _OPS.append(_define_ops())
    return _OPS[0]


# The ops' kernels. A call whose layout ran before replays that run's launch plan
# (flashcore.kernels.plans: the per-layout launch cache, keyed here on the op's own arguments),
# else runs in full through the torch backend and is recorded.

def _unpacked(options) -> tuple:
    """(max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
    deterministic) from the ops' float list."""
    ms_q, ms_k, causal, scale, left, right, cap, det = options
    return int(ms_q), int(ms_k), bool(causal), scale, int(left), int(right), cap, bool(det)


def _fwd_impl(q, k, v, options, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
              block_table=None, out_fp32=False, dropout_p=0.0, rng_state=None):
    import torch
    key = None
    cfg = config.get()
    if q.is_cuda and not cfg.debug:     # (debug mode validates every call)
        # the key holds layout() of every tensor, q's, k's and v's written out: their addresses
        # and q's shape and device are read once, for the key and the replay
        pq, pk, pv, shape, device = q.data_ptr(), k.data_ptr(), v.data_ptr(), q.shape, q.device
        key = ("fwd", (shape, q.stride(), q.dtype, device, pq & 15),
               (k.shape, k.stride(), k.dtype, k.device, pk & 15),
               (v.shape, v.stride(), v.dtype, v.device, pv & 15),
               None if alibi_slopes is None else layout(alibi_slopes),
               None if cu_seqlens_q is None else layout(cu_seqlens_q),
               None if cu_seqlens_k is None else layout(cu_seqlens_k), tuple(options), cfg,
               None if block_table is None else layout(block_table), out_fp32, dropout_p,
               None if rng_state is None else layout(rng_state))
        plan = plans.lookup(key)
        if plan is not None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format) if not out_fp32 \
                else torch.empty_like(q, dtype=torch.float32,
                                      memory_format=torch.contiguous_format)
            # lse_shape(shape, varlen), its ints given one by one (the parser's fast case)
            lse = q.new_empty(shape[0], shape[2], shape[1], dtype=torch.float32) \
                if cu_seqlens_q is None else q.new_empty(shape[1], shape[0], dtype=torch.float32)
            if replay(torch, plan, (
                    pq, pk, pv, out.data_ptr(), lse.data_ptr(),
                    0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                    0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
                    0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
                    0 if block_table is None else block_table.data_ptr(),
                    0 if rng_state is None else rng_state.data_ptr()), device):
                return out, lse
    spec = _validated(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *_unpacked(options),
                      block_table=block_table, dropout_p=dropout_p, rng_state=rng_state)
    with plans.record() as rec:
        out, lse = _BACKEND.forward(spec, q, k, v, alibi_slopes=alibi_slopes,
                                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    block_table=block_table,
                                    out_fp32=out_fp32 and spec.dtype in ("float16", "bfloat16"),
                                    rng_state=rng_state if spec.dropout_p else None)
    if key is not None:
        plans.remember(key, rec.plan(_roles(q=q, k=k, v=v, o=out, lse=lse,
                                            alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                                            cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                                            dropout_rng=rng_state), q.device.index))
    return out, lse


def _bwd_impl(dout, q, k, v, out, lse, options, alibi_slopes=None, cu_seqlens_q=None,
              cu_seqlens_k=None, dropout_p=0.0, rng_state=None):
    import torch
    key = None
    cfg = config.get()
    if q.is_cuda and not cfg.debug:     # (debug mode validates every call)
        # layout() of every tensor, the six always given written out (as in _fwd_impl)
        pdo, pq, pk, pv, po, pl = (dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                   out.data_ptr(), lse.data_ptr())
        device = q.device
        key = ("bwd", (dout.shape, dout.stride(), dout.dtype, dout.device, pdo & 15),
               (q.shape, q.stride(), q.dtype, device, pq & 15),
               (k.shape, k.stride(), k.dtype, k.device, pk & 15),
               (v.shape, v.stride(), v.dtype, v.device, pv & 15),
               (out.shape, out.stride(), out.dtype, out.device, po & 15),
               (lse.shape, lse.stride(), lse.dtype, lse.device, pl & 15),
               None if alibi_slopes is None else layout(alibi_slopes),
               None if cu_seqlens_q is None else layout(cu_seqlens_q),
               None if cu_seqlens_k is None else layout(cu_seqlens_k),
               tuple(options), cfg, dropout_p, None if rng_state is None else layout(rng_state))
        plan = plans.lookup(key)
        if plan is not None:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            if replay(torch, plan, (
                    pdo, pq, pk, pv, po, pl, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                    0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                    0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr(),
                    0 if cu_seqlens_k is None else cu_seqlens_k.data_ptr(),
                    0 if rng_state is None else rng_state.data_ptr()), device):
                return dq, dk, dv
    spec = _validated(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *_unpacked(options),
                      (dout, out, lse), dropout_p=dropout_p, rng_state=rng_state)
    with plans.record() as rec:
        dq, dk, dv = _BACKEND.backward(spec, dout, q, k, v, out, lse, alibi_slopes=alibi_slopes,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       rng_state=rng_state if spec.dropout_p else None)
    if key is not None:
        plans.remember(key, rec.plan(_roles(dout=dout, q=q, k=k, v=v, o=out, lse=lse, dq=dq,
                                            dk=dk, dv=dv, alibi_slopes=alibi_slopes,
                                            cu_seqlens_q=cu_seqlens_q,
                                            cu_seqlens_k=cu_seqlens_k,
                                            dropout_rng=rng_state), q.device.index))
    return dq, dk, dv


def _kvcache_key(q, k_cache, v_cache, cache_seqlens, options, cfg, block_table, key_mask,
                 cache_leftpad, rest=None) -> tuple:
    """A decode call's launch-plan key: the layouts of its tensors, its options, the settings.
    The optional tensors of the common calls (a plain or a paged cache, with a key mask or left
    padding or neither) are its last three entries; ``rest``: the others' layouts, when one is
    given. (:func:`_length_free_key` reads its entries by position: keep the two in step.)"""
    return ("kvcache", layout(q), layout(k_cache), layout(v_cache),
            None if cache_seqlens is None else layout(cache_seqlens), tuple(options), cfg,
            layout(block_table), layout(key_mask), layout(cache_leftpad), rest)


def _kvcache_impl(q, k_cache, v_cache, k, v, cache_seqlens, options, block_table=None,
                  rotary_cos=None, rotary_sin=None, alibi_slopes=None, cache_leftpad=None,
                  key_mask=None, k_descale=None, v_descale=None, heads_first=None, made=None):
    """The decode ops' implementation. ``heads_first``: None for the append op (its eight
    options), a bool for the read op (whose options may hold it as a ninth entry, kept in the
    plan's key with the rest). ``made``: a list (kvcache_read's direct call; never the op's) to
    which the plan the call launched or recorded under its key is appended, with the settings
    it was keyed under (what _bind binds: no key made twice)."""
    import torch
    key = free = None
    cfg = config.get()
    # (debug mode validates every call; a call that appends is never recorded: its decode
    # reads the lengths that the append computes on the device, so no key is made for it)
    if q.is_cuda and k is None and not cfg.debug:
        rest = None if (rotary_cos is None and rotary_sin is None and alibi_slopes is None
                        and k_descale is None and v_descale is None) else \
            tuple(map(layout, (rotary_cos, rotary_sin, alibi_slopes, k_descale, v_descale)))
        key = _kvcache_key(q, k_cache, v_cache, cache_seqlens, options, cfg, block_table,
                           key_mask, cache_leftpad, rest)
        plan = PLANS.get(key)
        if plan is None or plan.generation != _GENERATION[0]:   # (plans.lookup inline)
            free = _length_free_key(key, k_cache, v_cache, heads_first, key_mask, block_table,
                                    rest)
            plan = None if free is None else _other_length(key, free, k_cache, v_cache,
                                                           heads_first, key_mask)
        if plan is not None:
            done = _launch_read(torch, plan, q, k_cache, v_cache, cache_seqlens,
                                (_ptr(block_table), _ptr(alibi_slopes), _ptr(cache_leftpad),
                                 _ptr(k_descale), _ptr(v_descale), _ptr(key_mask)), heads_first)
            if done is not None:
                if made is not None:
                    made += (plan, cfg)
                return done
    if heads_first:     # (b, s, h, d) views, as every other call gives them
        _check_heads_first(q, k_cache, v_cache)
        q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    cache_seqlens_int, rotary_interleaved, causal, softmax_scale, window_left, window_right, \
        softcap, num_splits = options if heads_first is None else options[:8]
    cache_seqlens_int, window_left, window_right, num_splits = (
        int(cache_seqlens_int), int(window_left), int(window_right), int(num_splits))
    rotary_interleaved, causal = bool(rotary_interleaved), bool(causal)
    from ..spec import exact_descale, kvcache_spec
    lens = cache_seqlens_int if cache_seqlens is None else cache_seqlens
    spec = kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=block_table,
                        rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                        rotary_interleaved=rotary_interleaved, causal=causal,
                        softmax_scale=softmax_scale, window_size=(window_left, window_right),
                        softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                        cache_leftpad=cache_leftpad, k_descale=k_descale, v_descale=v_descale,
                        key_mask=key_mask)
    choose_kvcache(spec, None)
    # (the descales as the backends take them: the op's own when they are so already, as
    # kvcache_attention makes them; a copy is no role of a plan, so such a call is not recorded)
    kd, vd = (exact_descale(d, spec.attn.batch, spec.attn.nheads_k)
              for d in (k_descale, v_descale))
    with plans.record() as rec:
        out, lse = _BACKEND.forward_kvcache(spec, q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                            block_table=block_table, rotary_cos=rotary_cos,
                                            rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                                            cache_leftpad=cache_leftpad, k_descale=kd,
                                            v_descale=vd, key_mask=key_mask)
    if key is not None and cache_seqlens is not None:
        plan = rec.plan(_roles(q=q, k=k_cache, v=v_cache, o=out, lse=lse,
                               cache_seqlens=cache_seqlens, block_table=block_table,
                               alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad,
                               k_descale=k_descale, v_descale=v_descale, key_mask=key_mask),
                        q.device.index)
        plans.remember(key, plan)
        if free is not None and plan is not None and plan.relength is not None:
            plans.remember(free, plan)
        if made is not None and plan is not None and plans.enabled():
            made += (plan, cfg)
    return out, lse


def _length_free_key(key, k_cache, v_cache, heads_first, key_mask, block_table, rest):
    """A decode call's key (_kvcache_key) without its cache's length, under which the launch
    cache keeps the newest plan of such calls for whatever length (_other_length); None for a
    call whose tensors are not those of a growing cache: k_cache and v_cache contiguous (a
    transformers DynamicCache's, which grows by a key every step), the key mask (if any)
    contiguous and of their length, no block table and none of the rarer tensors."""
    if block_table is not None or rest is not None or heads_first is None:
        return None
    dim = 2 if heads_first else 1
    n = k_cache.shape[dim]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape[dim] == n
            and (key_mask is None or (key_mask.is_contiguous() and key_mask.shape[1] == n))):
        return None
    lengthless = tuple((x[0][:dim] + x[0][dim + 1:], x[2], x[3], x[4])
                       for x in (key[2], key[3]))
    mask = None if key_mask is None else (key[8][0][0], *key[8][2:])
    return ("kvcache-any-length", key[1], *lengthless, key[4], key[5], key[6], mask, key[9])


def _other_length(key, free, k_cache, v_cache, heads_first, key_mask):
    """The plan of a decode call (``key``; ``free``, its _length_free_key) that meets its cache
    at a new length (a DynamicCache's, every step of a fresh generate), made from the newest
    plan of the same call at another length
    (Plan.for_length: the same launches, the struct's length fields written anew) and kept
    under its own key; None when there is none, or that length launches otherwise: the call is
    then run in full (validated, launched, recorded). No check is skipped that the length
    could fail: the length-free key holds the rest of the call, and k_cache, v_cache and the
    mask share the length (what validation asks of it)."""
    other = PLANS.get(free)
    if other is None or other.generation != _GENERATION[0]:
        return None
    ks, vs = k_cache.stride(), v_cache.stride()
    if heads_first:     # (the launcher's (batch, seq, heads, headdim) order)
        ks, vs = (ks[0], ks[2], ks[1], ks[3]), (vs[0], vs[2], vs[1], vs[3])
    plan = other.for_length(k_cache.shape[2 if heads_first else 1], ks, vs,
                            0 if key_mask is None else key_mask.stride(0))
    if plan is not None:
        plans.remember(key, plan)
        plans.remember(free, plan)
    return plan


def _validated(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               causal, softmax_scale, window_left, window_right, softcap, deterministic,
               backward=None, block_table=None, dropout_p=0.0, rng_state=None):
    """The full validation of an op call whose layout is new (named errors; every backend's
    reasons), as the public function would do it: its spec."""
    varlen = cu_seqlens_q is not None
    kw = dict(varlen=varlen, causal=causal, softmax_scale=softmax_scale,
              window_size=(window_left, window_right), softcap=softcap,
              alibi_slopes=alibi_slopes, deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
              max_seqlen_k=max_seqlen_k if varlen else None, dropout_p=dropout_p,
              rng_state=rng_state)
    if backward is None:
        spec = forward_spec(q, k, v, block_table=block_table, **kw)
    else:
        dout, out, lse = backward
        spec = backward_spec(dout, q, k, v, out, lse, **kw)
    choose(spec, None, backward=True)
    return spec


def _check_heads_first(q, k_cache, v_cache):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"flashcore: argument '{name}': expected a 4D (batch, heads, seq, "
                             f"headdim) tensor (heads_first), got shape {tuple(t.shape)}")


def _kvcache_read_impl(q, k_cache, v_cache, cache_seqlens, options, block_table=None,
                       key_mask=None, cache_leftpad=None, alibi_slopes=None, k_descale=None,
                       v_descale=None):
    return _kvcache_impl(q, k_cache, v_cache, None, None, cache_seqlens, options, block_table,
                         None, None, alibi_slopes, cache_leftpad, key_mask, k_descale,
                         v_descale, _read_heads_first(options))


def _read_heads_first(options) -> bool:
    """The read op's heads_first option (its options' ninth entry, if any)."""
    if len(options) == 9:
        return bool(options[8])
    if len(options) != 8:
        raise ValueError("flashcore::kvcache_read: argument 'options': expected 8 or 9 "
                         f"entries, got {len(options)}")
    return False


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _roles(**tensors) -> tuple:
    """(struct field, address) of a call's tensors, in the order replays give them."""
    return tuple((name, _ptr(t)) for name, t in tensors.items())


_LIBRARY: list = []     # the torch.library.Library that owns the ops (kept alive)
_OVERLOADS: dict = {}   # name -> the op's OpOverload (looked up once)
_IMPLS: dict = {}       # name -> the op's implementation, for _run's direct calls


def _define_ops():
    """The ops, defined with torch.library's low-level API: a Python kernel reached
    through the dispatcher costs ~5 us a call on the H200 host, against ~20 us for a
    ``torch.library.custom_op`` (whose wrapper adds checks and a dynamo guard per call)."""
    import torch
    lib = torch.library.Library("flashcore", "DEF")
    for name, schema, impl in (("fwd", _FWD_SCHEMA, _fwd_impl), ("bwd", _BWD_SCHEMA, _bwd_impl),
                               ("kvcache", _KV_SCHEMA, _kvcache_impl),
                               ("kvcache_read", _KV_READ_SCHEMA, _kvcache_read_impl)):
        lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key)

    def fwd_fake(q, k, v, options, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 block_table=None, out_fp32=False, dropout_p=0.0, rng_state=None):
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        fp32 = out_fp32 and q.dtype in (torch.float16, torch.bfloat16)
        return (q.new_empty(q.shape, dtype=torch.float32) if fp32 else q.new_empty(q.shape),
                q.new_empty(lse_shape(q.shape, cu_seqlens_q is not None), dtype=lse_dtype))

    def bwd_fake(dout, q, k, v, *_):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def kvcache_fake(q, *_, **__):      # (k_descale, v_descale, key_mask too)
        return q.new_empty(q.shape), q.new_empty(lse_shape(q.shape), dtype=torch.float32)

    def kvcache_read_fake(q, k_cache, v_cache, cache_seqlens, options, *_, **__):
        if _read_heads_first(options):
            _check_heads_first(q, k_cache, v_cache)
            b, h, s, d = q.shape
            return q.new_empty((b, s, h, d)), q.new_empty((b, h, s), dtype=torch.float32)
        return kvcache_fake(q)
    torch.library.register_fake("flashcore::fwd", fwd_fake, lib=lib)
    torch.library.register_fake("flashcore::bwd", bwd_fake, lib=lib)
    torch.library.register_fake("flashcore::kvcache", kvcache_fake, lib=lib)
    torch.library.register_fake("flashcore::kvcache_read", kvcache_read_fake, lib=lib)
    _LIBRARY.append(lib)
    ops = torch.ops.flashcore
    _OVERLOADS.update(fwd=ops.fwd.default, bwd=ops.bwd.default, kvcache=ops.kvcache.default,
                      kvcache_read=ops.kvcache_read.default)
    _IMPLS.update(fwd=_fwd_impl, bwd=_bwd_impl, kvcache=_kvcache_impl,
                  kvcache_read=_kvcache_read_impl)
    _FUNCTION.extend(_attention_function(torch, ops))
    return ops


# -- Layer 3: autograd ------------------------------------------------------------------------

_FUNCTION: list = []     # [FlashAttention, ForwardOnly]
PAGED_BACKWARD_MESSAGE = (
    "flashcore: argument 'block_table': attention over a paged KV cache is forward only (as in "
    "flash-attn); its backward cannot run: expected the gradient of a call without block_table")


def _attention_function(torch, ops):
    """The autograd Function over the ops (flash-attn's layering: ops, Function, public
    function): the forward saves ``(q, k, v, out, lse)``; lse is not differentiable; the
    backward is not differentiable either (double backward is refused with a message)."""

    fwd_op, bwd_op = ops.fwd.default, ops.bwd.default

    class FlashAttention(torch.autograd.Function):
        # Inputs arrive deduplicated (dynamo cannot trace a Function given one tensor twice,
        # and q is k is v, or cu_seqlens_q is cu_seqlens_k, are common). ``call`` is
        # ``(where, options, dropout_p)``, one argument (each non-tensor argument of a Function
        # costs the step about 0.5 us): ``where`` gives, for q, k, v, alibi_slopes,
        # cu_seqlens_q, cu_seqlens_k, rng_state, the index of each in ``tensors`` (-1: None).
        @staticmethod
        def forward(ctx, call, *tensors):
            where, options, dropout_p = call
            # (the ops' implementations called directly in a plain eager step: _run)
            if where is _DISTINCT_QKV:    # (the common case: _roles_of's answer, without it;
                q, k, v = tensors         # no optional tensor, no dropout)
                out, lse = _run(torch, "fwd", (q, k, v, options))
            else:
                q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng = _roles_of(where, tensors)
                if dropout_p:
                    out, lse = fwd_op(q, k, v, options, alibi_slopes, cu_seqlens_q,
                                      cu_seqlens_k, None, False, dropout_p, rng)
                else:
                    out, lse = _run(torch, "fwd", _trimmed((q, k, v, options, alibi_slopes,
                                                            cu_seqlens_q, cu_seqlens_k)))
            ctx.save_for_backward(out, lse, *tensors)
            ctx.call = call
            ctx.mark_non_differentiable(lse)
            # lse has no gradient: not materialised as zeros (a fill kernel and an allocation
            # per step); dout is None when out took no part in the loss
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            out, lse, *tensors = ctx.saved_tensors
            if dout is None:
                return (None,) * (1 + len(tensors))
            where, options, dropout_p = ctx.call
            q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng = _roles_of(where, tensors)
            # The kernels need a contiguous last dimension; the incoming gradient can be
            # anything (an expanded scalar from .sum() has stride 0 everywhere).
            if dout.stride(-1) != 1 and dout.shape[-1] > 1:
                dout = dout.contiguous()
            if dropout_p:
                dq, dk, dv = bwd_op(dout, q, k, v, out, lse, options, alibi_slopes,
                                    cu_seqlens_q, cu_seqlens_k, dropout_p, rng)
            else:       # (the defaults left out)
                dq, dk, dv = _run(torch, "bwd", _trimmed((dout, q, k, v, out, lse, options,
                                                          alibi_slopes, cu_seqlens_q,
                                                          cu_seqlens_k)))
            if torch.is_grad_enabled():      # create_graph=True: refuse when differentiated
                dq, dk, dv = NoSecondDerivative.apply(dout, q, k, v, dq, dk, dv)
            if where is _DISTINCT_QKV:
                return None, dq, dk, dv
            grads = [None] * len(tensors)
            for i, g in zip(where[:3], (dq, dk, dv)):
                grads[i] = g if grads[i] is None else grads[i] + g
            return (None, *grads)

    class NoSecondDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dout, q, k, v, *grads):
            # dout, q, k, v tie the gradients to the graph being built: they require grad
            # whenever the gradients could be differentiated (a constant dout included)
            return tuple(g.clone() for g in grads)

        @staticmethod
        def backward(ctx, *_):
            raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)

    class ForwardOnly(torch.autograd.Function):
        """A forward with no backward (varlen over a paged cache, as in flash-attn): the output
        joins the graph of q, k, v, so the call works wherever inputs require grad, and a
        backward through it raises, naming the argument, instead of giving no gradient."""
        @staticmethod
        def forward(ctx, out, q, k, v):
            return out.view_as(out)

        @staticmethod
        def backward(ctx, *_):
            raise NotImplementedError(PAGED_BACKWARD_MESSAGE)

    return FlashAttention, ForwardOnly


# --------------------------------------------------------------------------------------------
# The entry point used by flashcore.attention / flashcore.varlen_attention on torch tensors
# --------------------------------------------------------------------------------------------

def autograd_attention(q, k, v, *, backend=None, varlen=False, causal=False, softmax_scale=None,
                       window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                       deterministic=False, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, block_table=None, dropout_p=0.0,
                       rng_state=None):
    """Differentiable attention on torch tensors. Returns ``(out, lse)``; lse has no gradient.

    Eagerly, plain option values (bools, floats, an int pair, ``max_seqlen`` ints) become the
    ops' arguments directly: the op's kernel keys its launch plan on them and on the tensors'
    layouts, and validates the call in full (named errors, backend choice) whenever that key is
    new. Anything else, a named ``backend``, and tracing under ``torch.compile`` validate here
    first (flashcore.spec). Then the autograd Function runs the forward op (the op alone when
    nothing requires grad).
    """
    import torch
    opts = None
    dropout = not (type(dropout_p) is float and dropout_p == 0.0)
    compiling = torch.compiler.is_compiling()
    if backend is None and not dropout and not compiling:
        if varlen is False and alibi_slopes is None and cu_seqlens_q is None \
                and cu_seqlens_k is None and block_table is None \
                and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            # (the common case, what _tensors_or_none and _plain_options answer, without
            # their calls)
            if type(deterministic) is bool and max_seqlen_q is None and max_seqlen_k is None:
                sw = _plain_scale_window(q, causal, softmax_scale, window_size, softcap)
                if sw is not None:
                    opts = (0, 0, causal, *sw, deterministic)
        elif _tensors_or_none(torch, (k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                      block_table), varlen, cu_seqlens_q, cu_seqlens_k):
            opts = _plain_options(q, varlen, causal, softmax_scale, window_size, softcap,
                                  deterministic, max_seqlen_q, max_seqlen_k)
    if opts is None:
        spec = forward_spec(q, k, v, varlen=varlen, causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k, block_table=block_table,
                            **({"dropout_p": dropout_p, "rng_state": rng_state} if dropout else {}))
        dropout_p = spec.dropout_p
        if not compiling:
            # (the capability probe, CuPy import checks and device queries, is not traceable;
            # the shapes, dtypes and options were validated above either way)
            choose(spec, backend, backward=_needs_grad(q, k, v))
        opts = _options(spec)
    torch_ops()
    cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (None, None)
    if block_table is not None:      # forward only: a backward through it raises
        out, lse = _OVERLOADS["fwd"](q, k, v, opts, alibi_slopes, cu_q, cu_k, block_table)
        if _needs_grad(q, k, v):
            out = _FUNCTION[1].apply(out, q, k, v)
        return out, lse
    rng = rng_state if dropout_p else None
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # nothing to differentiate: the op alone (what autograd would run), its
        # implementation called directly in a plain eager call (_run: a prefill's layers pay
        # the dispatcher's round trip as a decoding step's do)
        if dropout_p:
            return _OVERLOADS["fwd"](q, k, v, opts, alibi_slopes, cu_q, cu_k, None, False,
                                     dropout_p, rng)
        return _run(torch, "fwd", _trimmed((q, k, v, opts, alibi_slopes, cu_q, cu_k)))
    if alibi_slopes is None and cu_q is None and rng is None and k is not q and v is not q \
            and v is not k:
        return _FUNCTION[0].apply((_DISTINCT_QKV, opts, 0.0), q, k, v)   # (the common case)
    tensors, where = [], []
    for t in (q, k, v, alibi_slopes, cu_q, cu_k, rng):
        if t is None:
            where.append(-1)
            continue
        for i, u in enumerate(tensors):
            if u is t:
                where.append(i)
                break
        else:
            where.append(len(tensors))
            tensors.append(t)
    return _FUNCTION[0].apply((tuple(where), opts, dropout_p), *tensors)


_DISTINCT_QKV = (0, 1, 2, -1, -1, -1, -1)  # q, k, v distinct; no alibi, cu_seqlens, rng_state


def _roles_of(where, tensors) -> tuple:
    """(q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state) from the Function's
    deduplicated ``tensors`` and ``where`` (the index of each in ``tensors``, -1: None)."""
    if where is _DISTINCT_QKV:
        return (*tensors, None, None, None, None)
    return tuple(None if i < 0 else tensors[i] for i in where)


def _options(spec) -> tuple:
    """The scalar arguments of the ops for ``spec`` (the window folded with causal)."""
    return (spec.seqlen_q if spec.varlen else 0, spec.seqlen_k if spec.varlen else 0,
            spec.causal, spec.softmax_scale, spec.window_left, spec.window_right, spec.softcap,
            spec.deterministic)


def _plain_scale_window(q, causal, softmax_scale, window_size, softcap):
    """(softmax_scale, left, right, softcap) as flashcore.spec makes them, from plain Python
    values only (else None: the caller validates in full, which names what is wrong)."""
    if type(causal) is not bool:
        return None
    if softmax_scale is None:
        d = q.shape[-1]
        if d < 1:
            return None
        softmax_scale = 1.0 / math.sqrt(d)
    elif type(softmax_scale) is not float or not 0.0 < softmax_scale < math.inf:
        return None
    if type(softcap) is int:
        softcap = float(softcap)
    if type(softcap) is not float or not 0.0 <= softcap < math.inf:
        return None
    if type(window_size) not in (tuple, list) or len(window_size) != 2:
        return None
    left, right = window_size
    if type(left) is not int or type(right) is not int or left < -1 or right < -1:
        return None
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return softmax_scale, left, right, softcap


def _tensors_or_none(torch, arrays, varlen, cu_seqlens_q, cu_seqlens_k) -> bool:
    """Whether the call's arrays are all torch tensors or None, and the cu_seqlens are given
    exactly when the call is varlen (else the call is validated in full, which names what is
    wrong)."""
    if varlen != (cu_seqlens_q is not None) or varlen != (cu_seqlens_k is not None):
        return False
    for a in arrays:      # (a loop: a generator costs more than the checks, per call)
        if a is not None and not isinstance(a, torch.Tensor):
            return False
    return True


def _plain_options(q, varlen, causal, softmax_scale, window_size, softcap, deterministic,
                   max_seqlen_q, max_seqlen_k):
    """The fwd/bwd ops' scalar arguments from plain values, or None (see above)."""
    if type(deterministic) is not bool:
        return None
    if varlen:
        if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int \
                or max_seqlen_q < 0 or max_seqlen_k < 0:
            return None
    elif max_seqlen_q is not None or max_seqlen_k is not None:
        return None
    sw = _plain_scale_window(q, causal, softmax_scale, window_size, softcap)
    if sw is None:
        return None
    scale, left, right, cap = sw
    return (max_seqlen_q if varlen else 0, max_seqlen_k if varlen else 0, causal, scale, left,
            right, cap, deterministic)


def kvcache_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos,
                      rotary_sin, rotary_interleaved, causal, softmax_scale, window_size,
                      softcap, alibi_slopes, num_splits, backend, cache_leftpad, k_descale,
                      v_descale, key_mask):
    """flashcore.attention_with_kvcache on torch tensors, through the ``flashcore::kvcache`` op,
    eagerly and under torch.compile alike. Plain option values and a tensor ``cache_seqlens``
    go to the op as they are (validated by the op's kernel when its layout is new, see
    :func:`autograd_attention`); otherwise the call is validated here first. FP8 caches'
    descales go to ``flashcore::kvcache_read`` (nothing is appended to an FP8 cache) as
    contiguous float32 (batch, nheads_k) tensors. The arguments are attention_with_kvcache's,
    in its order, all positional (twenty keywords passed on cost a decoding step ~0.6 us)."""
    import torch
    args = None
    descaled = k_descale is not None or v_descale is not None
    if descaled and isinstance(k_cache, torch.Tensor) and q.ndim == 4 and k_cache.ndim == 4:
        from ..spec import exact_descale
        k_descale, v_descale = (exact_descale(d, q.shape[0], k_cache.shape[2])
                                for d in (k_descale, v_descale))
    if backend is None and not _compiling() and isinstance(cache_seqlens, torch.Tensor) \
            and type(rotary_interleaved) is bool and type(num_splits) is int and num_splits >= 0 \
            and (k is not None or (rotary_cos is None and rotary_sin is None)) \
            and (k is None or not descaled) \
            and _tensors_or_none(torch, (k_cache, v_cache, k, v, block_table, rotary_cos,
                                         rotary_sin, alibi_slopes, cache_leftpad, k_descale,
                                         v_descale, key_mask),
                                 False, None, None):
        sw = _plain_scale_window(q, causal, softmax_scale, window_size, softcap)
        if sw is not None:
            args = (cache_seqlens, 0, rotary_interleaved, causal, sw[0], sw[1], sw[2], sw[3],
                    num_splits)     # (the tensor, then the op's options, see _KV_SCHEMA)
    if args is None:
        from ..spec import kvcache_spec
        spec = kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                            block_table=block_table, rotary_cos=rotary_cos,
                            rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes, num_splits=num_splits,
                            cache_leftpad=cache_leftpad, k_descale=k_descale,
                            v_descale=v_descale, key_mask=key_mask)
        if not _compiling():
            choose_kvcache(spec, backend)
        a = spec.attn
        as_int = spec.cache_seqlens_int is not None
        # the causal window is folded in: the op takes the window flashcore.spec made
        args = (None if as_int else cache_seqlens, spec.cache_seqlens_int if as_int else 0,
                spec.rotary_interleaved, a.causal, a.softmax_scale, a.window_left,
                a.window_right, a.softcap, spec.num_splits)
    lens, options = args[0], args[1:]
    torch_ops()
    if k is None and v is None:
        op = "kvcache_read"
        tail = _trimmed((block_table, key_mask, cache_leftpad, alibi_slopes, k_descale,
                         v_descale))
        call = (q, k_cache, v_cache, lens, options) + tail
    else:
        op = "kvcache"
        tail = _trimmed((block_table, rotary_cos, rotary_sin, alibi_slopes, cache_leftpad,
                         key_mask))
        call = (q, k_cache, v_cache, k, v, lens, options) + tail
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or
                                    v_cache.requires_grad or
                                    (k is not None and k.requires_grad) or
                                    (v is not None and v.requires_grad)):
        with torch.no_grad():       # (inference only: the results never require grad)
            return _run(torch, op, call)
    return _run(torch, op, call)


def kvcache_read(q, k_cache, v_cache, cache_seqlens, cache_leftpad, key_mask, causal,
                 softmax_scale, window_size, softcap, heads_first=False, shared=None):
    """``attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=..., cache_leftpad=...,
    key_mask=..., causal=..., softmax_scale=..., window_size=..., softcap=...)``'s output, for
    a caller that holds torch tensors only (``cache_seqlens`` a tensor; ``cache_leftpad`` and
    ``key_mask`` tensors or None) and appends nothing: the transformers route's decoding steps,
    eight or more a forward, whose host time is the step's. The same read op as
    :func:`kvcache_attention`'s call, without its checks of the arguments such a caller never
    passes; options that are not plain values, and calls traced by torch.compile, go through
    :func:`kvcache_attention` whole. ``heads_first``: q, k_cache and v_cache come as (batch,
    heads, seq, headdim), as transformers gives them (the output is (batch, seq_q, heads,
    headdim) either way).

    ``shared``: a list that the caller keeps for calls that come alike (a forward's decoding
    layers: the same length, mask and left-padding tensors, the same options of the same
    types), on one stream and never during CUDA-graph capture, empty at first. The first plain
    eager call on CUDA tensors (no gradient wanted, debug mode off) that replays or records a
    launch plan leaves it there, bound to what it was made for (:func:`_bind`); a later call
    that matches it (the same tensors, options and settings, q, k_cache and v_cache of the same
    layouts, plans enabled, nothing that must see the op) launches it with no key made, its
    log-sum-exp (which this function does not return) written to one buffer kept in the list.
    Anything else goes the usual way."""
    import torch
    if shared:
        out = _bound_read(torch, shared, q, k_cache, v_cache, cache_seqlens, cache_leftpad,
                          key_mask, (causal, softmax_scale, window_size, softcap, heads_first))
        if out is not None:
            return out
    sw = None if torch.compiler.is_compiling() else \
        _plain_scale_window(q, causal, softmax_scale, window_size, softcap)
    if sw is None:
        if heads_first:
            q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), \
                v_cache.transpose(1, 2)
        return kvcache_attention(q, k_cache, v_cache, None, None, cache_seqlens, None, None,
                                 None, False, causal, softmax_scale, window_size, softcap, None,
                                 0, None, cache_leftpad, None, None, key_mask)[0]
    # (see _KV_SCHEMA and _KV_READ_SCHEMA)
    options = (0, False, causal, sw[0], sw[1], sw[2], sw[3], 0, True) if heads_first else \
        (0, False, causal, sw[0], sw[1], sw[2], sw[3], 0)
    grad = torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad
                                        or v_cache.requires_grad)
    if not grad and _direct(torch, q, k_cache, v_cache, cache_seqlens, key_mask, cache_leftpad):
        # (a plain eager call: the read op's implementation, with nothing between; see _run)
        made = [] if shared is not None and not shared else None
        out = _kvcache_impl(q, k_cache, v_cache, None, None, cache_seqlens, options, None, None,
                            None, None, cache_leftpad, key_mask, None, None, heads_first, made)[0]
        if made:
            _bind(torch, shared, made, q, k_cache, v_cache, cache_seqlens, cache_leftpad,
                  key_mask, (causal, softmax_scale, window_size, softcap, heads_first))
        return out
    if not _OVERLOADS:
        torch_ops()
    call = (q, k_cache, v_cache, cache_seqlens, options) + \
        _trimmed((None, key_mask, cache_leftpad))       # (block_table, key_mask, cache_leftpad)
    if grad:
        with torch.no_grad():       # (inference only, as kvcache_attention)
            return _run(torch, "kvcache_read", call)[0]
    return _run(torch, "kvcache_read", call)[0]


def _bind(torch, shared, made, q, k_cache, v_cache, cache_seqlens, cache_leftpad, key_mask,
          args):
    """Fill ``shared`` (see kvcache_read) after a plain eager call that launched or recorded a
    plan under its key (``made``: that plan and the settings it was keyed under, as
    _kvcache_impl leaves them): [plan, settings, the call's tensors, its other arguments,
    :func:`_bound_layout` of q/k_cache/v_cache, the log-sum-exp buffer, heads_first]. What a
    later call must match is what the plan's key holds of it."""
    plan, cfg = made
    heads_first = args[-1]
    b, h, s, _ = q.shape if heads_first else q.transpose(1, 2).shape
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    shared[:] = [plan, cfg, (cache_seqlens, cache_leftpad, key_mask), args,
                 _bound_layout(q, k_cache, v_cache), lse, heads_first]


def _bound_layout(q, k_cache, v_cache) -> tuple:
    """What a launch plan may depend on of q, k_cache and v_cache (what layout() gives of each:
    shapes, strides, dtypes, devices, addresses modulo 16), as one flat tuple: compared whole
    by the bound calls of a forward (see _bound_read), one per decoding layer. (The devices
    whole: get_device() gives only the index, the same for cuda:0 and another kind's 0.)"""
    return (q.shape, k_cache.shape, v_cache.shape, q.stride(), k_cache.stride(),
            v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, q.device, k_cache.device,
            v_cache.device, q.data_ptr() & 15, k_cache.data_ptr() & 15, v_cache.data_ptr() & 15)


def _bound_read(torch, shared, q, k_cache, v_cache, cache_seqlens, cache_leftpad, key_mask,
                args):
    """The output of a call that matches what ``shared`` is bound to (see _bind), launched
    from its plan; else None (the caller goes the usual way)."""
    plan, cfg, tensors, bound_args, bound_layout, lse, heads_first = shared
    if not _direct(torch, q, k_cache, v_cache) or (
            torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad
                                         or v_cache.requires_grad)):
        return None
    if not (cache_seqlens is tensors[0] and cache_leftpad is tensors[1]
            and key_mask is tensors[2] and args == bound_args
            and plan.generation == _GENERATION[0] and config.get() is cfg and plans.enabled()
            and _bound_layout(q, k_cache, v_cache) == bound_layout):
        return None
    done = _launch_read(torch, plan, q, k_cache, v_cache, cache_seqlens,
                        (0, 0, _ptr(cache_leftpad), 0, 0, _ptr(key_mask)), heads_first, lse)
    return None if done is None else done[0]


def _launch_read(torch, plan, q, k_cache, v_cache, cache_seqlens, tail, heads_first, lse=None):
    """A decode call launched from its plan: the output, (b, s, h, d), allocated (and the
    log-sum-exp, (b, h, s) float32, unless given), the addresses in the plan's role order
    (q, k_cache, v_cache, out, lse, cache_seqlens, then ``tail``: block_table, alibi_slopes,
    cache_leftpad, k_descale, v_descale, key_mask; 0 for None). ``(out, lse)``, or None when
    the plan cannot run here (see replay): nothing was launched."""
    if heads_first:
        b, h, s, d = q.shape
    else:
        b, s, h, d = q.shape
    dev = q.device
    out = torch.empty((b, s, h, d), dtype=q.dtype, device=dev)
    if lse is None:
        lse = torch.empty((b, h, s), dtype=torch.float32, device=dev)
    if replay(torch, plan, (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                            lse.data_ptr(), cache_seqlens.data_ptr()) + tail, dev):
        return out, lse
    return None


def _direct(torch, *tensors) -> bool:
    """Whether an op's call on ``tensors`` (its arguments: torch tensors, None, the
    options' tuple) may run its implementation directly: see _run."""
    q = tensors[0]
    if not (q.is_cuda or q.device.type == "cpu") or _dispatcher_needed(torch):
        return False
    plain = torch.Tensor
    for t in tensors:
        if t is not None and type(t) is not plain and type(t) is not tuple:
            return False
    return True


def _run(torch, name, call):
    """The op ``name`` (a decode op, or the forward with nothing to differentiate) on
    ``call``: its implementation called directly in a plain eager call, else through the
    dispatcher. In a transformers generate, the dispatcher's round trip
    into a Python kernel (the arguments boxed, the tensors wrapped again, the results unboxed)
    cost the decoding step ~4% (run 231, H100, one process: 0.92x / 0.91x "sdpa"'s tokens/s
    through the op, 0.96x / 0.95x calling the implementation). The op is the call whenever
    anything must
    see it: torch.compile or torch.jit tracing, a tensor subclass (fake, functional, DTensor),
    a torch function or dispatch mode (FakeTensorMode, make_fx, FlopCounterMode, a
    ``torch.device`` context), functorch transforms, the profiler (its trace names the op).
    The implementation is the same either way. (Meta tensors go to the dispatcher too: their
    kernel is the fake implementation.)"""
    if _direct(torch, *call):
        return _IMPLS[name](*call)
    return _OVERLOADS[name](*call)


def _dispatcher_needed(torch) -> bool:
    """Whether anything is on that must see an op call (see _run)."""
    c = torch._C
    if not _IN_DISPATCH_MODE:
        # (any torch dispatch mode entered, the infrastructure's too: FakeTensorMode, make_fx)
        from torch.utils._python_dispatch import is_in_torch_dispatch_mode
        _IN_DISPATCH_MODE.append(is_in_torch_dispatch_mode)
    return (torch.compiler.is_compiling() or c._get_tracing_state() is not None
            or c._is_torch_function_mode_enabled() or c._len_torch_dispatch_stack() > 0
            or _IN_DISPATCH_MODE[0]() or c._are_functorch_transforms_active()
            or c._autograd._profiler_enabled())


_IN_DISPATCH_MODE: list = []


def _trimmed(tensors: tuple) -> tuple:
    """The optional tensors of an op's call up to the last one given (each argument passed
    costs the dispatcher, None too)."""
    n = len(tensors)
    while n and tensors[n - 1] is None:
        n -= 1
    return tensors[:n]


def forward(q, k, v, *, backend=None, varlen=False, **kw):
    """flashcore.attention_forward / varlen_attention_forward on torch tensors: the forward op
    (no autograd: the results do not require grad)."""
    return _explicit("fwd", (q, k, v), backend, varlen, kw)


def backward(dout, q, k, v, out, lse, *, backend=None, varlen=False, **kw):
    """flashcore.attention_backward / varlen_attention_backward on torch tensors: the
    backward op."""
    return _explicit("bwd", (dout, q, k, v, out, lse), backend, varlen, kw)


def _explicit(kind, tensors, backend, varlen, kw):
    import torch
    q = tensors[0] if kind == "fwd" else tensors[1]
    opts = None
    if backend is None and "dropout_p" not in kw and not _compiling() and _tensors_or_none(
            torch, tensors + tuple(kw.get(n) for n in ("alibi_slopes", "cu_seqlens_q",
                                                       "cu_seqlens_k", "block_table")),
            varlen, kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")):
        opts = _plain_options(q, varlen, kw.get("causal", False), kw.get("softmax_scale"),
                              kw.get("window_size", (-1, -1)), kw.get("softcap", 0.0),
                              kw.get("deterministic", False), kw.get("max_seqlen_q"),
                              kw.get("max_seqlen_k"))
    args = {n: kw.get(n) for n in ("alibi_slopes", "cu_seqlens_q", "cu_seqlens_k")}
    fp32 = False
    if kind == "fwd":
        kw = dict(kw)
        fp32 = out_fp32(kw.pop("out_dtype", None), dtype_name(q))
    dropout_p = 0.0
    if opts is None:
        spec_kw = dict(kw, varlen=varlen)
        spec = forward_spec(*tensors, **spec_kw) if kind == "fwd" else \
            backward_spec(*tensors, **spec_kw)
        if not _compiling():
            choose(spec, backend, backward=kind == "bwd")
        opts = _options(spec)
        dropout_p = spec.dropout_p
    drop = (dropout_p, kw.get("rng_state")) if dropout_p else ()
    # the ops' defaulted tails, given only as far as needed: fwd (block_table, out_fp32,
    # dropout_p, rng_state), bwd (dropout_p, rng_state)
    tail = ((kw.get("block_table"), fp32) + drop) if kind == "fwd" else drop
    call = (*tensors, opts, args["alibi_slopes"], args["cu_seqlens_q"], args["cu_seqlens_k"])
    torch_ops()
    with torch.no_grad():
        if drop or fp32 or kw.get("block_table") is not None:
            return _OVERLOADS[kind](*call, *tail)
        return _run(torch, kind, _trimmed(call))    # (the implementation, in a plain call)


def _compiling() -> bool:
    """Whether torch.compile is tracing (the callers hold torch tensors: torch is loaded)."""
    import torch
    return torch.compiler.is_compiling()


def _needs_grad(q, k, v) -> bool:
    import torch
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


class _DefineOpsAfterTorchImport:
    """A one-shot import hook: when torch is imported after flashcore, define the custom ops
    right after torch finishes loading, so that a first flashcore call made inside a
    torch.compile trace finds them (defining an op cannot be traced)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_define(module):
            exec_module(module)
            try:
                torch_ops()
            except Exception:   # never break `import torch`; the eager path defines them later
                pass
        loader.exec_module = exec_then_define
        return spec


if "torch" in sys.modules:   # torch already loaded: define the ops now, outside any trace
    torch_ops()
elif importlib.util.find_spec("torch") is not None:
    sys.meta_path.insert(0, _DefineOpsAfterTorchImport())
