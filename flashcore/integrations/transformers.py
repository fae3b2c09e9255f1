"""flashcore as a Hugging Face transformers attention implementation (transformers >= 4.48).

::

    import flashcore.integrations.transformers as fct
    name = fct.register()             # once, before loading the model; "flashcore" or "fcore"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

The name: "flashcore" where transformers accepts it. transformers 5 treats every
``attn_implementation`` containing "flash" as a flash-attention kernel to load from the Hub
(``is_flash_attention_requested``), so there "flashcore" cannot name a registered function and
:func:`register` picks "fcore" instead. Pass ``name=`` to choose; the name in use is returned.

What the attention function does with what transformers passes it:

* query/key/value arrive as (batch, heads, seq, headdim); they are handed to flashcore as
  (batch, seq, heads, headdim) views (no copy). GQA/MQA key/value heads are used as they are:
  flashcore does the grouping itself, nothing is repeated.
* ``is_causal`` (keyword, else ``module.is_causal``) selects the bottom-right aligned causal
  mask, which is also right for decoding with a cache (the queries are the last tokens).
* ``scaling`` is the softmax scale, ``softcap`` the score cap, ``sliding_window`` w keeps the
  w most recent keys (window ``(w - 1, w - 1)``, the right side folded away when causal) like
  transformers' flash-attention path.
* Padding: :func:`register` also registers :func:`padding_mask` as the name's mask function
  (transformers >= 4.53), so the attention function receives None when no mask was given and
  the 2D ``(batch, kv_len)`` padding mask otherwise (not tested for being all ones: that would
  read it back to the host), padded with False to the cache's length when a static cache holds
  more slots than the mask covers (so its shape stays static from step to step, and a compiled
  decoding step is not recompiled each token). Its last column before any such padding is the
  last query's position, as transformers builds it. So the decoding route takes the end of
  the slots written on the host where the mask's shape says it: the cache's length where the
  mask is as wide and an eager step does not depend on it (one query, no window or one over
  every key: the keys past the end are masked anyway; the kernel then walks the cache's whole
  length), the mask's width where a caller's own mask is narrower than the cache. Otherwise
  (and in compiled steps, whose device ops cost no host time) it is found from the mask on
  the device. Routes, none with a host sync or graph break:

  - *Over the cache* (the default for fewer queries than keys, at most 64 of them, no gradient,
    no dropout: decoding steps and speculative drafts): the decode kernel with the mask as its
    ``key_mask`` (any pattern, holes included; one byte a key), the queries at the last
    ``sq`` slots written (see :func:`_mask_end`). A sliding window counts positions,
    as sdpa's mask does.
  - *Varlen* (everything else: prefill, training): varlen attention over the tokens the mask
    keeps, packed by a stable sort to static shapes (once a forward: the layers share the
    packing, as the decoding steps share their lengths). A query at a padded position gets output
    0 (it is not attended from; transformers warns against generating from right-padded
    prompts). A sliding window counts kept keys, as in transformers' flash-attention path (the
    same as positions wherever a row has no holes).
  - With ``register(left_padding=True)``, decoding steps instead read each row of the mask as
    left padding, then the sequence, then slots not written yet, and the decode kernel runs
    over keys ``[first kept, last kept]`` of each row (``cache_leftpad`` and
    ``cache_seqlens``, computed on the device). A row with holes inside its kept run (right
    padding followed by new tokens) is outside this reading: debug mode
    (``FLASHCORE_DEBUG=1``) refuses it with a named error.

  Older transformers pass a 4D mask: it is
  accepted when it is exactly the causal/window mask flashcore applies anyway (checked on
  the values, so not under torch.compile), anything else is refused with an explanation.
* ``dropout`` > 0 (a model in training mode with ``attention_dropout``) drops attention
  probabilities (:mod:`flashcore.dropout`; its state from torch's generator, so
  ``torch.manual_seed`` reproduces a run); the cache routes above are taken only without it.
  No attention weights are returned (None), as with every fused implementation.

transformers is imported only by :func:`register`.
"""
from __future__ import annotations

import threading

from .. import config
from ..api import attention, varlen_attention
from ..backends import torch_ops
from ..kernels.device import torch_stream_getter

__all__ = ["register", "flashcore_attention_forward", "flashcore_attention_forward_left_padded",
           "padding_mask", "DEFAULT_NAME"]


DEFAULT_NAME = "flashcore"
FALLBACK_NAME = "fcore"


def _taken_for_flash_attn(name: str) -> bool:
    """Whether this transformers routes ``attn_implementation=name`` to its flash-attn loader."""
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:   # transformers < 5: only the flash_attention_N names are special
        return name.startswith("flash_attention")
    return bool(is_flash_attention_requested(requested_attention_implementation=name))


def register(name: str | None = None, *, left_padding: bool = False) -> str:
    """Register flashcore in transformers' ``AttentionInterface`` (and mask interface).

    ``name`` defaults to "flashcore", or "fcore" on transformers versions that take any name
    containing "flash" for a flash-attention kernel (see the module docstring). Afterwards
    ``attn_implementation=<name>`` selects flashcore. Returns the name.

    ``left_padding=True`` declares that every padding mask is left padding (each row keeps one
    run of positions up to its end: prompts padded on the left, as generation wants them, or
    not padded at all); decoding steps with a mask then run the decode kernel over each row's
    kept run instead of under the mask (see the module docstring). Debug mode
    (``FLASHCORE_DEBUG=1``) checks it. The declaration belongs to the name: it registers
    :func:`flashcore_attention_forward_left_padded` instead of
    :func:`flashcore_attention_forward`, so two names registered with and without it can serve
    two models in one process.
    """
    if type(left_padding) is not bool:
        raise TypeError(f"argument 'left_padding': expected a bool, got {left_padding!r}")
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("flashcore.integrations.transformers.register needs transformers >= "
                          f"4.48 (AttentionInterface): {e}") from e
    if name is None:
        name = FALLBACK_NAME if _taken_for_flash_attn(DEFAULT_NAME) else DEFAULT_NAME
    elif _taken_for_flash_attn(name):
        raise ValueError(f"argument 'name': this transformers version treats {name!r} as a "
                         "flash-attention kernel to load (names containing 'flash'); expected "
                         f"another name, e.g. {FALLBACK_NAME!r}")
    AttentionInterface.register(name, flashcore_attention_forward_left_padded if left_padding
                                else flashcore_attention_forward)
    try:   # transformers >= 4.53: masks are built per implementation
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass
    else:
        AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(*args, attention_mask=None, kv_length=None, **kwargs):
    """The mask function registered with the attention function: the 2D padding mask as
    given (its last ``kv_length`` columns, as bool), or None when there is none. A mask
    shorter than ``kv_length`` (a static cache, whose slots past the mask are not written yet)
    is padded with False to that length, so that its shape does not change from one decoding
    step to the next: transformers builds a static cache's mask outside its compiled decoding
    step and passes it in, so a mask of the written length would be a new input shape each
    token (run 242 of the performance log measured that: 0.16x "sdpa", the step's CUDA graph
    recorded anew). The attention function therefore takes the end of the slots written
    from the shape only where it can (:func:`_mask_end`). (transformers passes the result
    through this function a second time, as a bool mask: that changes nothing.)
    Unlike transformers' flash-attention mask function, it does not test whether the mask is all
    ones (a read back to the host, and a graph break under torch.compile): a mask that is given
    is applied, whatever its values. (Its signature takes what every transformers version
    passes: ``kv_length`` is the third argument, or a keyword.)"""
    if attention_mask is None:
        return None
    if kv_length is None and len(args) >= 3:
        kv_length = args[2]
    if kv_length is None:
        return attention_mask
    mask = _key_mask(attention_mask, int(kv_length))
    # (a new tensor object for every forward, as the layers' shared values are kept per mask
    # object and version (_per_forward): a caller's own mask, already bool and as wide, is
    # aliased, not taken itself, so that one forward never finds another's values, even where
    # the mask was written without its version moving, through .data or a DLPack alias)
    return attention_mask.detach() if mask is attention_mask else mask


def _key_mask(attention_mask, sk):
    """The 2D mask as a bool (batch, sk) mask of the keys: its last sk columns, padded with
    False on the right when it is shorter (a static cache's slots not written yet)."""
    import torch
    if attention_mask.dtype == torch.bool and attention_mask.shape[1] == sk:
        return attention_mask       # (already one: the routes', within one forward)
    mask = attention_mask[:, -sk:].to(torch.bool)
    if mask.shape[1] < sk:
        mask = torch.nn.functional.pad(mask, (0, sk - mask.shape[1]))
    return mask


def _mask_end(attention_mask, sk, sq, free=False):
    """L, the end of the cache slots written (the queries are slots L - sq .. L - 1), as a
    host int where the mask's shape says it; None where it must be found from the mask's
    values on the device (:func:`_written_end`). A mask narrower than the cache is not padded
    (a caller's own: :func:`padding_mask` pads), so its last column is the last query's: L is
    its width. A mask as wide as the cache may be a static cache's, padded, so L is taken as
    the cache's length only where the result does not depend on it (``free``: one query over
    a key mask, no window or one over every key, whose keys past L are masked anyway). At
    least ``sq``."""
    n = attention_mask.shape[1]
    if n < sk:
        return max(n, sq)
    return max(sk, sq) if free else None


def _written_end(keep, sq):
    """L as a 0-d int32 tensor, found on the device from a mask as wide as the cache (where
    :func:`_mask_end` cannot say it), the same for every row: the last kept key + 1 over
    the batch, at least sq -- exact whenever a row's last query is kept (decoding: the new
    token is) or the cache held nothing before the queries (a prefill, right padding
    included)."""
    import torch
    sk = keep.shape[1]
    end = (keep * torch.arange(1, sk + 1, device=keep.device, dtype=torch.int32)).amax()
    return torch.clamp(end, min=sq).to(torch.int32)


def _query_positions(keep, sq, end):
    """The bool (batch, sq) mask of the queries kept: ``keep``'s (batch, sk) columns at the
    query slots, L - sq .. L - 1 (``end``: L from :func:`_mask_end`, or None for
    :func:`_written_end`'s); a query at a masked position is not kept (its output is 0)."""
    import torch
    b, sk = keep.shape
    if sq == sk:
        return keep
    if end is not None:
        return keep[:, end - sq:end]
    pos = _written_end(keep, sq) - sq + torch.arange(sq, device=keep.device, dtype=torch.int32)
    return keep.gather(1, pos.expand(b, sq).to(torch.int64))


# Query lengths up to this take the decode kernel over a masked cache (decoding steps,
# speculative drafts); longer ones (prefill) the varlen route.
CACHE_ROUTE_MAX_QUERIES = 64


def _window(sliding_window):
    if sliding_window is None:
        return (-1, -1)
    return (int(sliding_window) - 1, int(sliding_window) - 1)


def flashcore_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, sliding_window=None, softcap=None, is_causal=None,
                                **kwargs):
    """transformers attention function: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out.

    Returns ``(attn_output, None)``: attn_output (batch, seq_q, heads, headdim) contiguous.
    What :func:`register` installs (without ``left_padding``).
    """
    return _attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                              sliding_window, softcap, is_causal, False, kwargs)


def flashcore_attention_forward_left_padded(module, query, key, value, attention_mask,
                                            scaling=None, dropout=0.0, sliding_window=None,
                                            softcap=None, is_causal=None, **kwargs):
    """:func:`flashcore_attention_forward` reading every 2D mask as left padding: what
    ``register(left_padding=True)`` installs."""
    return _attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                              sliding_window, softcap, is_causal, True, kwargs)


def _attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                       sliding_window, softcap, is_causal, left_padding, kwargs):
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal, window = bool(is_causal), _window(sliding_window)
    cap = 0.0 if softcap is None else softcap
    import torch
    batch, _, sq, _ = query.shape       # ((b, h, s, d) tensors)
    sk = key.shape[2]
    if attention_mask is not None and attention_mask.ndim == 4:
        _check_4d_mask(attention_mask, sq, sk, causal, window)
        attention_mask = None
    # the decoding steps (over the cache: fewer queries than keys, no gradient, no dropout):
    # the decode kernel, its lengths computed once a forward (see _per_forward), on
    # transformers' (b, h, s, d) tensors as they come (heads_first); every other call on
    # (b, s, h, d) views
    over_cache = sk > sq and not dropout and not (torch.is_grad_enabled() and query.requires_grad)
    if attention_mask is None:
        position_ids = kwargs.get("position_ids")
        if over_cache and position_ids is not None:
            lens, shared = _per_forward(position_ids, ("lens", sk, batch), _lens_from_positions,
                                        position_ids, batch, sk, binding=True)
            out = torch_ops.kvcache_read(query, key, value, lens, None, None, causal, scaling,
                                         window, cap, True, shared)
        else:
            out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                            causal=causal, softmax_scale=scaling, window_size=window,
                            softcap=cap, **_dropout(dropout))
    elif attention_mask.ndim == 2:
        if over_cache and sq <= CACHE_ROUTE_MAX_QUERIES:
            # (the window's left side: whether the step depends on where the slots written end)
            left = -1 if left_padding else window[0]
            keep, first, end, shared = _per_forward(
                attention_mask, ("cache", sk, sq, left_padding, left), _cache_route_of,
                attention_mask, sk, sq, left_padding, left, binding=True)
            out = torch_ops.kvcache_read(query, key, value, end, first, keep, causal, scaling,
                                         window, cap, True, shared)
        else:
            # (prefill and training: the packing computed once a forward)
            packing = _per_forward(attention_mask, ("varlen", sk, sq), _varlen_packing,
                                   attention_mask, sk, sq)
            out = _padded_via_varlen(query.transpose(1, 2), key.transpose(1, 2),
                                     value.transpose(1, 2), packing, causal=causal,
                                     softmax_scale=scaling, window_size=window, softcap=cap,
                                     **_dropout(dropout))
    else:
        raise ValueError("flashcore attention: argument 'attention_mask': expected None, a 2D "
                         f"(batch, kv_len) padding mask or a 4D mask, got shape "
                         f"{tuple(attention_mask.shape)}")
    return out.contiguous(), None


def _dropout(p) -> dict:
    return {"dropout_p": float(p)} if p else {}


class _Shared(threading.local):
    def __init__(self):
        self.entries = []       # [(source, its version, key, stream, value)], newest last


_SHARED = _Shared()
_SHARED_ENTRIES = 4     # (models whose layers take different masks, e.g. sliding and full)


def _per_forward(source, key, compute, *args, binding=False):
    """What the layers of one forward compute alike, computed by the first and taken by the
    others: transformers hands every layer the same ``position_ids`` and mask tensors, and what
    the routes derive from them (the cache's lengths: a few small torch ops, 27-45 us of host
    time a layer on the H200's host; a padded batch's packing) is the same for all of them.
    ``compute(*args)`` is kept for ``source`` itself (the same object, not changed in place
    since: its version), ``key`` (the shapes it was computed for) and the current stream; a few
    entries a thread, the oldest dropped.
    Nothing is kept or taken under torch.compile (the ops are traced), during CUDA-graph
    capture (each layer's ops must be captured: a replay runs them again) or for tensors made
    under ``torch.inference_mode`` (they have no version counter, so a change in place could
    not be told).
    ``binding`` (the decoding routes): the value is what ``compute`` returns, as a tuple, then
    the list in which the forward's first read binds its launch plan for the other layers
    (``shared``: see torch_ops.kvcache_read; one stream's, never used under capture), or None
    where nothing is kept or the source is not a CUDA tensor."""
    import torch
    if torch.compiler.is_compiling() or source.is_inference():
        return _unshared(compute, args, binding)   # (an inference tensor has no version)
    stream = None
    if source.is_cuda:
        if _capturing():
            return _unshared(compute, args, binding)
        stream = torch_stream_getter()(source.get_device())
    entries = _SHARED.entries
    version = source._version
    for e in entries:
        if e[0] is source and e[1] == version and e[2] == key and e[3] == stream:
            return e[4]
    value = compute(*args)
    if binding:     # (a list only where the entry is the stream's: a CUDA source's)
        value = _with_list(value, [] if stream is not None else None)
    entries.append((source, version, key, stream, value))
    if len(entries) > _SHARED_ENTRIES:
        del entries[0]
    return value


def _unshared(compute, args, binding):
    value = compute(*args)
    return _with_list(value, None) if binding else value


def _with_list(value, shared) -> tuple:
    """A decoding route's value as _per_forward gives it with ``binding``: the value's
    entries, then ``shared`` (the binding list, or None)."""
    return (value if type(value) is tuple else (value,)) + (shared,)


_CAPTURING: list = []


def _capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph (torch's own accessor, where
    this torch has it: the Python wrapper costs a call more)."""
    if not _CAPTURING:
        import torch
        _CAPTURING.append(getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
                          or torch.cuda.is_current_stream_capturing)
    return _CAPTURING[0]()


def _lens_from_positions(position_ids, batch, sk):
    """The cache lengths of a call with no mask over a KV cache that may hold slots not written
    yet (a static cache: keys past the last position are garbage, and no mask says so when
    nothing is padded): the keys of sequence b are its first ``position_ids[b, -1] + 1`` (at
    most the cache's length), computed on the device (no sync, traceable), int32 (batch,)."""
    import torch
    lens = (position_ids[:, -1] + 1).clamp(max=sk).to(torch.int32)
    return lens.expand(batch).contiguous() if lens.shape[0] != batch else lens


def _kept_run(mask):
    """Per row of a bool (batch, sk) mask: (first kept position, last kept position + 1), int32,
    on the device; (0, 0) for a row that keeps nothing."""
    import torch
    sk = mask.shape[1]
    end = (mask * torch.arange(1, sk + 1, device=mask.device, dtype=torch.int32)).amax(1)
    first = torch.argmax(mask.to(torch.uint8), dim=1)
    return first.to(torch.int32), end.to(torch.int32)


def _cache_route_of(attention_mask, sk, sq, left_padding, window_left):
    """``(key mask, cache_leftpad, cache_seqlens)`` of the decode kernel's call for queries over
    a cache under a 2D mask (see the module docstring's routes):

    * any mask: the decode kernel over the cache's first L slots with the mask as its
      ``key_mask`` (one byte a key, padded to the cache's length), the queries at slots
      L - sq .. L - 1 (bottom-right causal); ``cache_leftpad`` None. L, the end of the slots
      written: :func:`_mask_end`'s host int where the mask's shape says it, else
      :func:`_written_end`'s, on the device. A mask as wide as the cache gives the cache's
      length where the step does not depend on L (one query, no window or one over every
      key), except while compiling: a compiled step's device ops cost no host time, and the
      kernel then walks no slot past L of a padded static cache's mask. (A CUDA-graph capture
      takes the eager choice, so that its replays equal eager calls bit for bit: the split
      ranges follow L.)
    * ``left_padding``: each row is left padding, the sequence, then slots not written yet
      (``register(left_padding=True)`` declares it): the kernel over keys [first kept, last
      kept] (``cache_leftpad``, ``cache_seqlens``, computed on the device), the queries at the
      last positions of that run (bottom-right causal); no key mask."""
    import torch
    keep = _key_mask(attention_mask, sk)
    if not left_padding:
        free = sq == 1 and (window_left < 0 or window_left >= sk - 1) and \
            not torch.compiler.is_compiling()
        end = _mask_end(attention_mask, sk, sq, free)
        batch = keep.shape[0]
        if end is None:
            return keep, None, _written_end(keep, sq).expand(batch).contiguous()
        return keep, None, torch.full((batch,), end, dtype=torch.int32, device=keep.device)
    first, end = _kept_run(keep)
    if config.debug() and not torch.compiler.is_compiling():
        holes = keep.sum(1, dtype=torch.int32) != end - first
        if bool(holes.any()):
            rows = holes.nonzero().flatten().tolist()
            raise ValueError(
                "flashcore attention: argument 'attention_mask': with left_padding=True each row "
                "must keep one run of positions (left padding, the sequence, unwritten slots); "
                f"rows {rows} have holes inside their run (debug-mode check; register without "
                "left_padding to attend with any mask)")
    return None, first, end


def _varlen_packing(attention_mask, sk, sq):
    """How :func:`_padded_via_varlen` packs a batch under the 2D mask (its keys: the bool
    (batch, sk) mask :func:`_key_mask` makes of it), the same for every layer of a forward
    (computed once a forward, see :func:`_per_forward`): ``(rows_q, pad_q, order_q, rows_k,
    pad_k, cu_seqlens_q, cu_seqlens_k)``. A stable sort of each row's kept tokens to the front,
    in order, gives the orders (packed row p holds token ``order[p]`` of the flattened (batch,
    seq) positions); ``rows_*``, the (batch, position) index pair of each packed row, gather
    the packed rows in one pass from any layout (transformers' (b, h, s, d) tensors arrive
    contiguous, so a flattening reshape would copy them first: a second pass over q, k and v
    each layer, run 246 of the performance log); ``pad_*`` says which packed rows hold no
    token."""
    import torch
    keep_k = _key_mask(attention_mask, sk)
    keep_q = _query_positions(keep_k, sq, _mask_end(attention_mask, sk, sq))

    def order_of(keep, n):
        flat = keep.reshape(-1)
        order = torch.argsort((~flat).to(torch.int8), stable=True)
        b = torch.div(order, n, rounding_mode="floor")
        return order, (b, order - b * n), ~flat[order][:, None, None]

    def cu_seqlens(keep):
        zero = torch.zeros(1, dtype=torch.int32, device=keep.device)
        return torch.cat([zero, keep.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)])

    order_q, rows_q, pad_q = order_of(keep_q, sq)
    cu_q = cu_seqlens(keep_q)
    if keep_q is keep_k:    # (a prefill or a training batch: the queries are the keys)
        return rows_q, pad_q, order_q, rows_q, pad_q, cu_q, cu_q
    _, rows_k, pad_k = order_of(keep_k, sk)
    return rows_q, pad_q, order_q, rows_k, pad_k, cu_q, cu_seqlens(keep_k)


def _padded_via_varlen(q, k, v, packing, **kw):
    """Varlen attention over the tokens the mask keeps (``packing``: :func:`_varlen_packing`),
    with no host sync and static shapes (so no graph break under torch.compile): each row's
    kept tokens are moved to the front, in order, and the padding behind them (one order for
    the keys and values, which share the mask), each tensor gathered in one pass from its
    (batch, seq, heads, dim) view; the packed tensors keep their full length, and the padding
    rows, past ``cu_seqlens[-1]``, belong to no sequence. When a gradient may flow they are
    zeroed on the way in (``masked_fill``, whose gradient is exactly 0 there); the result's
    padding rows are zeroed on the way out, and it goes back to the padded positions (zeros
    at pads). Where nothing is differentiated (and nothing is traced), the gathers and the
    scatter move 16-byte elements (:func:`_wide`)."""
    import torch
    b, sq, h, d = q.shape
    rows_q, pad_q, order_q, rows_k, pad_k, cu_q, cu_k = packing
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    wide = not grad and not torch.compiler.is_compiling()

    def pack(x, rows, pad):
        if grad:    # (rows past the sequences are never read: only their gradient matters)
            return x[rows].masked_fill(pad, 0)
        w = _wide(x) if wide else None
        # ((N, heads, dim): one gather from the strided view)
        return x[rows] if w is None else w[rows].view(x.dtype)

    qp = pack(q, rows_q, pad_q)
    kp = pack(k, rows_k, pad_k)
    vp = pack(v, rows_k, pad_k)
    # the padded lengths bound the longest sequences: no read of the lengths back to the host
    out = varlen_attention(qp, kp, vp, cu_q, cu_k, sq, k.shape[1], **kw)
    # (in place where nothing is differentiated: the out-of-place ops copy the whole tensor
    # first, a pass over the output each, run 247; the Function keeps its output for the
    # backward, so with a gradient the fill makes a new tensor)
    full = out.new_empty(b * sq, h, d)
    src, dst = (_wide(out), _wide(full)) if wide else (None, None)
    if src is None or dst is None:
        src, dst = out, full
    src = src.masked_fill(pad_q, 0) if grad else src.masked_fill_(pad_q, 0)
    dst.index_copy_(0, order_q, src)
    return full.view(b, sq, h, d)


def _wide(x):
    """``x``'s bytes as 16-byte elements (a complex128 view: each head's row in d / 8 elements
    at 16 bits) where its layout allows, else None. torch's gather and scatter kernels move one
    element a thread: at 2 bytes an element the packing's gathers ran at a quarter of a copy's
    speed (run 247: 2.4 ms of a batch-8 / 2k prefill). Not differentiable (a view between
    element sizes), so only where nothing is. The address too must be a whole number of 16-byte
    elements: torch's kernels load them as aligned 16-byte words. (Plain tensors of the GPU or
    the CPU only: a fake, meta or functional tensor has no address to ask.)"""
    import torch
    if type(x) is not torch.Tensor or not (x.is_cuda or x.device.type == "cpu"):
        return None
    r = 16 // x.element_size()
    if r <= 1 or x.shape[-1] % r or x.stride(-1) != 1 or x.storage_offset() % r \
            or x.data_ptr() % 16 or any(st % r for st in x.stride()[:-1]):
        return None
    return x.view(torch.complex128)


def _check_4d_mask(mask, sq, sk, causal, window_size):
    """Accept a 4D mask only if it is the mask flashcore applies anyway (older transformers)."""
    import torch
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[..., -sq:, -sk:]
    i = torch.arange(sq, device=mask.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=mask.device)[None, :]
    left, right = window_size
    right = 0 if causal and right < 0 else (min(right, 0) if causal else right)
    want = torch.ones(sq, sk, dtype=torch.bool, device=mask.device)
    if left >= 0:
        want &= j >= i - left
    if right >= 0:
        want &= j <= i + right
    if not bool((allowed == want).all()):
        raise NotImplementedError(
            "flashcore attention: argument 'attention_mask': this 4D mask is not the plain "
            "causal/sliding-window mask (padding or a custom pattern); flashcore takes padding "
            "as a 2D mask, which transformers >= 4.53 passes once flashcore.integrations."
            "transformers.register() has registered the mask function")
