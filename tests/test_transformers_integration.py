"""flashcore as a transformers attention implementation: a tiny random Llama, no downloads."""
import copy
import inspect

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
if not hasattr(transformers, "AttentionInterface"):
    pytest.skip("transformers < 4.48 has no AttentionInterface", allow_module_level=True)

from flashcore.backends import get_backend  # noqa: E402
from flashcore.integrations import transformers as fct  # noqa: E402


class _Layer(torch.nn.Module):
    """The module an attention function is handed: a causal attention layer."""
    is_causal = True


@pytest.fixture(scope="module")
def name():
    return fct.register()


def _models(name, dtype=torch.float32, device="cpu", seed=0):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=128)
    torch.manual_seed(seed)
    ours = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).to(device=device, dtype=dtype)
    ref = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).to(device=device, dtype=dtype)
    ref.load_state_dict(ours.state_dict())
    ours.set_attn_implementation(name)
    ref.set_attn_implementation("sdpa")
    return ours, ref


@pytest.fixture
def calls(monkeypatch):
    """Shapes of (q, k) every time the torch backend runs a forward."""
    tb = get_backend("torch")
    seen = []
    orig = tb.forward

    def spy(spec, q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape)))
        return orig(spec, q, k, v, **kw)
    monkeypatch.setattr(tb, "forward", spy)
    return seen


def test_register_returns_a_name_transformers_accepts(name):
    assert name in transformers.AttentionInterface()
    if fct._taken_for_flash_attn("flashcore"):
        assert name == fct.FALLBACK_NAME
        with pytest.raises(ValueError, match="argument 'name'"):
            fct.register("flashcore")
    else:
        assert name == fct.DEFAULT_NAME


def test_logits_and_gradients_match_sdpa(name, calls):
    ours, ref = _models(name)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    lo, lr = ours(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(lo.logits, lr.logits, atol=1e-5, rtol=1e-5)
    lo.loss.backward()
    lr.loss.backward()
    for (n, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, atol=1e-5, rtol=1e-4, msg=n)
    # flashcore ran once per layer, on the un-repeated GQA key/value heads
    assert calls == [((2, 16, 4, 16), (2, 16, 2, 16))] * 2


def test_left_padding_goes_through_varlen_and_matches_sdpa(name):
    ours, ref = _models(name)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0
    lo = ours(ids, attention_mask=mask).logits
    lr = ref(ids, attention_mask=mask).logits
    torch.testing.assert_close(lo[1], lr[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lo[0, 5:], lr[0, 5:], atol=1e-5, rtol=1e-5)


def test_generate_with_a_cache_matches_sdpa(name):
    ours, ref = _models(name)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert ours.generate(ids, **kw).tolist() == ref.generate(ids, **kw).tolist()


def test_compiled_fullgraph_runs_and_matches(name):
    torch._dynamo.reset()
    ours, ref = _models(name)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(ours, fullgraph=True)
    out = compiled(ids, labels=ids)
    out.loss.backward()
    expected = ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert all(p.grad is not None for p in ours.parameters() if p.requires_grad)


def test_padded_batch_compiles_fullgraph_with_no_sync_and_matches_sdpa(name):
    """A padded training batch: the varlen route has static shapes and no host read (a
    fullgraph compile would fail on either), and gives sdpa's loss and gradients."""
    torch._dynamo.reset()
    ours, ref = _models(name)
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, :6] = 0            # left padding
    mask[2, 11:] = 0           # right padding
    labels = ids.masked_fill(mask == 0, -100)
    out = torch.compile(ours, fullgraph=True)(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    expected = ref(ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, atol=1e-5, rtol=1e-5)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], expected.logits[keep], atol=1e-5, rtol=1e-5)
    for (n, p), (_, pr) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_padding_mask_shorter_than_a_static_cache():
    """A static cache holds more slots than the mask covers (the slots past it are not written
    yet): the queries are the mask's last positions, the keys its kept ones."""
    import flashcore
    from flashcore.integrations.transformers import _padded_via_varlen, _varlen_packing
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 2, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 10, 2, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, 10, 2, 16, dtype=torch.float64, generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    keep = fct.padding_mask(attention_mask=mask, kv_length=10)
    out = _padded_via_varlen(q, k, v, _varlen_packing(keep, 10, 3), causal=True, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0)
    for b, first in ((0, 2), (1, 0)):
        want = flashcore.attention(q[b:b + 1], k[b:b + 1, first:7], v[b:b + 1, first:7],
                                   causal=True)
        torch.testing.assert_close(out[b:b + 1], want, atol=1e-12, rtol=0)


def test_padding_mask_is_padded_to_a_static_cache():
    """Shorter than kv_length (a static cache): padded with False (slots not written yet), so
    the shape that a compiled decoding step sees does not change from token to token (eagerly
    too: transformers makes a static cache's mask outside the compiled step and passes it in);
    passing the result through again (transformers does) changes nothing. Only a caller's own
    mask narrower than the cache tells the end of the slots written by its width."""
    m = torch.ones(2, 5, dtype=torch.bool)
    m[0, :2] = False
    got = fct.padding_mask(batch_size=2, q_length=1, kv_length=9, attention_mask=m.long())
    assert got.shape == (2, 9) and got.dtype == torch.bool
    assert got[:, :5].equal(m) and not got[:, 5:].any()
    assert fct.padding_mask(batch_size=2, q_length=1, kv_length=9, attention_mask=got).equal(got)
    # (a bool mask of the cache's width is aliased, not converted: a new object each call, so
    # that no forward finds another's values kept for the mask object; the routes take it as
    # it is)
    again = [fct.padding_mask(batch_size=2, q_length=1, kv_length=9, attention_mask=got)
             for _ in range(2)]
    assert again[0] is not got and again[1] is not again[0]
    assert again[0].data_ptr() == got.data_ptr() and again[0].equal(got)
    assert fct._key_mask(got, 9) is got
    wider = torch.cat([torch.zeros(2, 3, dtype=torch.bool), got], 1)
    assert fct.padding_mask(attention_mask=wider, kv_length=9).equal(got)
    assert fct._mask_end(got, 9, 1) is None and fct._mask_end(got, 9, 1, free=True) == 9
    assert fct._mask_end(m, 9, 1) == 5 and fct._mask_end(m, 9, 7) == 7


def _row_reference(q, k, v, mask_row, sq, window, route):
    """One row: the queries at the mask's last sq positions, each over the kept keys up to its
    position. On the varlen route a query at a masked position gives 0 and a sliding window
    counts kept keys (flash-attn's varlen, as in transformers' flash-attention path); on the
    decode kernel's routes every query attends and the window counts positions (as sdpa's
    mask does). Either way the same wherever a row has no holes and its queries are kept."""
    import flashcore
    kept = mask_row.nonzero().flatten()
    n = mask_row.shape[0]
    out = torch.zeros_like(q)
    qpos = torch.arange(n - sq, n)
    for i, p in enumerate(qpos.tolist()):
        if p < 0 or (route == "varlen" and not mask_row[p]):
            continue
        ks = kept[kept <= p]          # causal: the kept keys up to the query's position
        if window is not None:
            ks = ks[-window:] if route == "varlen" else ks[ks > p - window]
        if len(ks):
            out[:, i:i + 1] = flashcore.attention(q[:, i:i + 1], k[:, ks], v[:, ks], causal=True)
    return out


@pytest.mark.parametrize("mask_as", ["padded", "narrower", "compiling"])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("route", ["varlen", "key_mask", "left_padding"])
def test_masks_over_a_cache_match_each_row(sq, window, route, mask_as, monkeypatch):
    """Queries over a static cache (the mask shorter than the cache): left-padded rows through
    the three routes (varlen, taken when a gradient may flow; the decode kernel with the mask
    as its key_mask, the default without; the decode kernel over each row's kept run with
    left_padding=True), and, except on the last, right-padded rows and rows with holes, each
    equal to attention over its kept keys as _row_reference says: with the mask padded to the
    cache by padding_mask (eagerly, and as a compiled step sees it: ``compiling``,
    torch.compiler.is_compiling patched, the ops run eagerly) and given narrower than the
    cache (the end of the slots written read from its width)."""
    if mask_as == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    g = torch.Generator().manual_seed(7)
    b, L, sk, h, hk, d = 5, 10, 14, 4, 2, 16
    q = torch.randn(b, h, sq, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g)
    v = torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g)
    given = torch.ones(b, L, dtype=torch.long)
    given[1, :3] = 0                  # left padding
    given[2, :9] = 0                  # left padding: one kept key
    if route != "left_padding":
        given[3, 4:6] = 0             # holes (a right-padded prompt, then new tokens)
        given[4, 7:] = 0              # right padding: the queries sit on pad positions
    mask = given.bool() if mask_as == "narrower" else \
        fct.padding_mask(attention_mask=given, kv_length=sk)
    assert mask.shape[1] == (L if mask_as == "narrower" else sk)

    forward = (fct.flashcore_attention_forward_left_padded if route == "left_padding"
               else fct.flashcore_attention_forward)
    if route == "varlen":
        q.requires_grad_(True)
    out, _ = forward(_Layer(), q, k, v, mask, sliding_window=window)
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
    for r in range(b):
        hkv = torch.repeat_interleave(torch.arange(hk), h // hk)
        want = _row_reference(qt[r:r + 1], kt[r:r + 1, :L][:, :, hkv], vt[r:r + 1, :L][:, :, hkv],
                              given[r].bool(), sq, window, route)
        torch.testing.assert_close(out[r:r + 1].detach(), want, atol=1e-12, rtol=0,
                                   msg=f"row {r}")


def test_masked_cache_route_refuses_holes_in_debug_mode():
    from flashcore import config
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 6, 8)
    mask = fct.padding_mask(attention_mask=torch.tensor([[1, 1, 0, 1]]), kv_length=6)

    with torch.no_grad(), config.override(debug=True):
        with pytest.raises(ValueError, match="argument 'attention_mask'.*holes"):
            fct.flashcore_attention_forward_left_padded(_Layer(), q, k, k, mask)


_AS_WIDE = [(9, sq, window, compiling, on_device, unwritten) for unwritten in (0, 1)
            for sq, window, compiling, on_device in (
                (1, None, False, False),  # a dynamic cache's step: the end is the cache's length
                (1, 9, False, False),     # a window over every key is none (left side sk - 1)
                (1, 8, False, True),      # one that is not (left side sk - 2)
                (3, None, False, True),   # maybe a padded static cache's mask
                (1, 4, False, True),
                (1, None, True, True))]   # compiled: the kernel walks no slot past the end


@pytest.mark.parametrize("width, sq, window, compiling, on_device, unwritten", _AS_WIDE + [
    (6, 3, 4, False, False, 0),   # narrower than the cache: the end is the mask's width
])
def test_decoding_steps_find_the_end_on_the_device_only_where_the_mask_cannot_say_it(
        width, sq, window, compiling, on_device, unwritten, monkeypatch):
    """Where the masked decoding route finds the end of the slots written: from the mask's
    shape (no device ops), or from its values with _written_end; the output is the one with
    the end found from the values, also where a mask as wide as the cache (9) has its last
    ``unwritten`` columns masked in every row (a padded static cache's: the end before the
    mask's). (A narrower mask whose last column no row keeps is where the two differ, by
    design: test_queries_sit_at_the_masks_last_columns_where_no_row_keeps_them.)"""
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    found = []
    orig = fct._written_end
    monkeypatch.setattr(fct, "_written_end", lambda *a: found.append(1) or orig(*a))
    g = torch.Generator().manual_seed(5)
    b, h, hk, sk, d = 2, 4, 2, 9, 8
    q = torch.randn(b, h, sq, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g) for _ in range(2))
    given = torch.ones(b, width, dtype=torch.bool)
    given[1, :2] = False
    given[:, width - unwritten:] = False

    with torch.no_grad():
        fct._SHARED.entries.clear()
        out = fct.flashcore_attention_forward(_Layer(), q, k, v, given, sliding_window=window)[0]
        assert bool(found) == on_device
        fct._SHARED.entries.clear()
        monkeypatch.setattr(fct, "_mask_end", lambda *a: None)     # (always from the values)
        want = fct.flashcore_attention_forward(_Layer(), q, k, v, given, sliding_window=window)[0]
        assert found
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_a_mask_shared_by_layers_with_and_without_a_window_gives_each_its_own_end():
    """One mask object (a padded static cache's: its last slots unwritten) read by a layer
    with no window (whose end is the cache's length) and then by one with a window (whose end
    must be found from the mask): each layer's output is the one it gets alone."""
    g = torch.Generator().manual_seed(12)
    b, h, hk, sk, d = 2, 4, 2, 9, 8
    q = torch.randn(b, h, 1, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.ones(b, sk, dtype=torch.bool)
    mask[:, 6:] = False

    def layer(window):
        return fct.flashcore_attention_forward(_Layer(), q, k, v, mask, sliding_window=window)[0]
    with torch.no_grad():
        alone = {}
        for w in (None, 4):
            fct._SHARED.entries.clear()
            alone[w] = layer(w)
        fct._SHARED.entries.clear()
        for w in (None, 4, None, 4):
            assert layer(w).equal(alone[w]), w
    assert not alone[None].equal(alone[4])


@pytest.mark.parametrize("route", ["varlen", "key_mask"])
def test_queries_sit_at_the_masks_last_columns_where_no_row_keeps_them(route):
    """A mask narrower than the cache: its last sq columns are the queries even where every
    row masks them (a chunk that ends in padding): the end of the slots written is read from
    the mask's width, not found from the kept keys (which would place the queries earlier)."""
    g = torch.Generator().manual_seed(11)
    b, L, sk, sq, h, hk, d = 2, 10, 14, 3, 4, 2, 16
    q = torch.randn(b, h, sq, d, dtype=torch.float64, generator=g)
    k = torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g)
    v = torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g)
    given = torch.ones(b, L, dtype=torch.long)
    given[:, 8:] = 0
    given[1, :2] = 0

    if route == "varlen":
        q.requires_grad_(True)
    out, _ = fct.flashcore_attention_forward(_Layer(), q, k, v, given.bool())
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
    hkv = torch.repeat_interleave(torch.arange(hk), h // hk)
    for r in range(b):
        want = _row_reference(qt[r:r + 1], kt[r:r + 1, :L][:, :, hkv], vt[r:r + 1, :L][:, :, hkv],
                              given[r].bool(), sq, None, route)
        torch.testing.assert_close(out[r:r + 1].detach(), want, atol=1e-12, rtol=0,
                                   msg=f"row {r}")


def test_register_takes_left_padding_as_a_bool():
    with pytest.raises(TypeError, match="'left_padding'"):
        fct.register(left_padding="yes")


@pytest.fixture(scope="module")
def name_lp(name):
    """A second name, registered with left_padding=True (the first keeps its own reading)."""
    return fct.register(name + "_lp", left_padding=True)


def test_left_padding_belongs_to_the_name(name, name_lp):
    """Each name keeps the reading it was registered with, whichever was registered last."""
    interface = transformers.AttentionInterface()
    assert interface[name] is fct.flashcore_attention_forward
    assert interface[name_lp] is fct.flashcore_attention_forward_left_padded


def test_decoding_after_a_right_padded_prompt_matches_sdpa(name):
    """A right-padded prompt, then decoding steps (masks with holes: the new tokens come after
    pad keys): every kept position's logits, prefill and steps, equal sdpa's. (Positions
    that are padding are not compared: what a pad query computes differs between
    implementations, and transformers warns against generating from them.)"""
    ours, ref = _models(name)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    outs = {}
    for tag, model in (("ours", ours), ("ref", ref)):
        # the cache's argument and output: "cache" since transformers renamed
        # "past_key_values" (the old name warns that it goes away)
        kw = ("cache" if "cache" in inspect.signature(model.forward).parameters
              else "past_key_values")
        r = model(ids, attention_mask=mask, use_cache=True, **{kw: transformers.DynamicCache()})
        logits = [r.logits[mask.bool()]]
        m, tok = mask, torch.tensor([[5], [6]])
        for _ in range(3):
            m = torch.cat([m, torch.ones(2, 1, dtype=torch.long)], dim=1)
            r = model(tok, attention_mask=m, use_cache=True, **{kw: getattr(r, kw)})
            logits.append(r.logits[:, -1])
            tok = tok + 1
        outs[tag] = logits
    for a, b in zip(outs["ours"], outs["ref"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("left_padding", [False, True])
def test_left_padded_static_cache_generate_matches_sdpa(name, name_lp, left_padding):
    """Greedy generation with a static cache and a left-padded batch: the decoding steps take
    the decode kernel with the mask as its key_mask, or with left_padding=True over each
    row's kept run (cache_leftpad); the same tokens as sdpa either way."""
    ours, ref = _models(name_lp if left_padding else name)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    assert ours.generate(ids, **kw).tolist() == ref.generate(ids, **kw).tolist()


def test_static_cache_decoding_steps_see_one_mask_shape(name):
    """Greedy generation with a static cache and a padded batch: every decoding step's
    attention call sees the mask at one shape, the cache's (transformers makes a static
    cache's mask outside its compiled step and passes it in: a mask of the written length
    would be a new input shape each token, and the compiled step's CUDA graph recorded anew;
    session 64 measured 0.16x "sdpa" so)."""
    ours, _ = _models(name)
    seen = []

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        if query.shape[2] == 1 and attention_mask is not None:
            seen.append((tuple(attention_mask.shape), key.shape[2]))
        return fct.flashcore_attention_forward(module, query, key, value, attention_mask, *args,
                                               **kwargs)
    spy_name = name + "_shape_spy"
    transformers.AttentionInterface.register(spy_name, spy)
    transformers.masking_utils.AttentionMaskInterface.register(spy_name, fct.padding_mask)
    ours.set_attn_implementation(spy_name)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    assert len(seen) >= 4 * 2, seen          # (two layers a step)
    assert len(set(seen)) == 1 and seen[0][0] == (2, seen[0][1]), seen


def test_dropout_in_training_drops_reproducibly(name):
    """A model in training mode with attention_dropout: the attention function drops
    probabilities (loss differs from eval mode), reproducibly under torch.manual_seed, and the
    gradients flow; a padded batch takes the varlen route with dropout too."""
    cfg_kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  attention_dropout=0.3)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg_kw))
    model.set_attn_implementation(name)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    for am in (None, mask):
        model.train()
        torch.manual_seed(5)
        a = model(ids, attention_mask=am, labels=ids).loss
        torch.manual_seed(5)
        b = model(ids, attention_mask=am, labels=ids).loss
        model.eval()
        c = model(ids, attention_mask=am, labels=ids).loss
        assert torch.equal(a, b) and not torch.equal(a, c)
        a.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        model.zero_grad()


def test_attention_function_handles_window_softcap_and_4d_causal_mask():
    import flashcore
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)

    out, w = fct.flashcore_attention_forward(_Layer(), q, k, k, None, scaling=0.5, sliding_window=3,
                                             softcap=2.0)
    assert w is None and out.shape == (1, 6, 4, 8) and out.is_contiguous()
    ref = flashcore.attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                              causal=True, softmax_scale=0.5, window_size=(2, 2), softcap=2.0)
    torch.testing.assert_close(out, ref)
    causal4d = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out4d, _ = fct.flashcore_attention_forward(_Layer(), q, k, k, causal4d)
    torch.testing.assert_close(out4d, fct.flashcore_attention_forward(_Layer(), q, k, k, None)[0])
    custom = causal4d.clone()
    custom[..., 3, 0] = False
    with pytest.raises(NotImplementedError, match="attention_mask"):
        fct.flashcore_attention_forward(_Layer(), q, k, k, custom)


_WHOLE_MODEL_COMPILE = r"""
import sys, torch
import flashcore.integrations.transformers as fct
from transformers import LlamaConfig, LlamaForCausalLM
name = fct.register()
cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
res = {}
for impl in (name, "sdpa"):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg._attn_implementation = impl
    model = LlamaForCausalLM(cfg)
    breaks = torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count
    torch._dynamo.reset()
    loss = torch.compile(model)(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    model.eval()
    gen = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False,
                         cache_implementation="static")[0, 8:].tolist()
    res[impl] = (breaks, float(loss), grad, gen)
ours, ref = res[name], res["sdpa"]
assert ours[0] == 0, f"graph breaks: {ours[0]}"
assert abs(ours[1] - ref[1]) < 1e-4, (ours[1], ref[1])
assert torch.allclose(ours[2], ref[2], atol=1e-5, rtol=1e-3)
assert ours[3] == ref[3], (ours[3], ref[3])
print("ok")
"""


def test_whole_model_compile_from_a_fresh_process():
    """torch.compile of a whole Llama from a fresh process (flashcore's first call happens inside
    the trace): no graph break, loss and gradients as under "sdpa", and static-cache greedy
    generation (which transformers compiles) gives sdpa's tokens."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _WHOLE_MODEL_COMPILE], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_padding_mask_takes_every_transformers_signature():
    """transformers 4.53-5.4 pass (batch_size, cache_position, kv_length, kv_offset, ...),
    later ones (batch_size, q_length, kv_length, q_offset, kv_offset, ...), by keyword."""
    from flashcore.integrations.transformers import padding_mask
    m = torch.ones(2, 6, dtype=torch.bool)
    assert padding_mask(batch_size=2, cache_position=torch.arange(4), kv_length=4, kv_offset=0,
                        mask_function=None, attention_mask=m).shape == (2, 4)
    assert padding_mask(batch_size=2, q_length=4, kv_length=5, q_offset=0, kv_offset=0,
                        attention_mask=m).shape == (2, 5)
    assert padding_mask(2, 4, 3, attention_mask=m).shape == (2, 3)
    assert padding_mask(batch_size=2, q_length=4, kv_length=4) is None


@pytest.mark.parametrize("route", ["positions", "key_mask", "left_padding"])
def test_layers_of_a_forward_share_the_cache_lengths(route, monkeypatch):
    """The cache lengths a decoding step derives from position_ids or the mask are computed by
    the forward's first layer and taken by the others (the same tensor objects); a tensor
    changed in place, another shape or another tensor computes them again, and every call's
    output is the one computed from scratch."""
    computed = []
    for fn in ("_lens_from_positions", "_cache_route_of"):
        orig = getattr(fct, fn)
        monkeypatch.setattr(fct, fn, lambda *a, _o=orig: computed.append(1) or _o(*a))
    g = torch.Generator().manual_seed(3)
    b, h, hk, sk, d = 3, 4, 2, 9, 8
    q = torch.randn(b, h, 1, d, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, hk, sk, d, dtype=torch.float64, generator=g) for _ in range(2))
    pos = torch.tensor([[6], [8], [7]])
    given = torch.ones(b, sk, dtype=torch.long)
    given[1, :2] = 0
    mask = None if route == "positions" else fct.padding_mask(attention_mask=given, kv_length=sk)

    forward = (fct.flashcore_attention_forward_left_padded if route == "left_padding"
               else fct.flashcore_attention_forward)

    def layer(kk=k, vv=v, m=None):
        with torch.no_grad():
            return forward(_Layer(), q, kk, vv, mask if m is None else m, position_ids=pos)[0]

    def fresh(kk=k, vv=v, m=None):
        fct._SHARED.entries.clear()
        n = len(computed)
        out = layer(kk, vv, m)
        del computed[n:]
        fct._SHARED.entries.clear()
        return out

    fct._SHARED.entries.clear()
    first = layer()
    assert layer().equal(first) and layer().equal(first)
    assert len(computed) == 1, "the second and third layers computed the lengths again"
    # changed in place: computed again, and the output follows the new values
    if route == "positions":
        pos[0, 0] = 3
    else:
        mask[2, :4] = False
    after = layer()
    assert len(computed) == 2
    assert after.equal(fresh()) and not after.equal(first)
    # another cache length (a cache that grew): computed again
    k2, v2 = (torch.cat([x, x[:, :, :1]], 2) for x in (k, v))
    m2 = None if mask is None else torch.nn.functional.pad(mask, (0, 1), value=True)
    grown = layer(k2, v2, m2)
    assert len(computed) == 3 and grown.equal(fresh(k2, v2, m2))


def test_decoding_routes_bind_in_one_list_a_forward_where_it_is_the_streams(monkeypatch):
    """_per_forward(..., binding=True), as the decoding routes call it: the value, then the list
    in which the forward's first read binds its launch plan (torch_ops.kvcache_read's
    ``shared``). The layers of a forward get one list; a source changed in place, another
    stream or another source a new one; None where nothing is kept (inference-mode tensors,
    capture) or the source is not a CUDA tensor (its entry is no stream's)."""
    import types
    stream = [11]
    capturing = [False]
    monkeypatch.setattr(fct, "torch_stream_getter", lambda: lambda index: stream[0])
    monkeypatch.setattr(fct, "_capturing", lambda: capturing[0])

    def source(cuda=True, inference=False):
        return types.SimpleNamespace(is_cuda=cuda, _version=0, get_device=lambda: 0,
                                     is_inference=lambda: inference)

    def step(src, key=("lens", 9, 2)):
        return fct._per_forward(src, key, lambda x: x * 2, 7, binding=True)

    fct._SHARED.entries.clear()
    src = source()
    first = step(src)
    assert len(first) == 2 and first[0] == 14 and type(first[1]) is list and not first[1]
    assert fct._per_forward(source(), ("cache",), lambda: (1, 2, 3), binding=True)[:3] == \
        (1, 2, 3)       # (a tuple's entries, then the list)
    assert step(src)[1] is first[1] and step(src)[1] is first[1]      # the forward's layers
    src._version += 1
    changed = step(src)
    assert type(changed[1]) is list and changed[1] is not first[1]
    assert step(source())[1] is not changed[1]                         # another forward
    assert step(src, ("lens", 10, 2))[1] is not changed[1]             # another shape
    stream[0] = 12
    assert step(src)[1] is not changed[1]                              # another stream
    assert step(source(cuda=False))[1] is None
    assert step(source(inference=True))[1] is None
    capturing[0] = True
    assert step(src)[1] is None
    # (without binding, the value alone, as before)
    capturing[0] = False
    assert fct._per_forward(source(), ("lens", 9, 2), lambda x: x, 5) == 5
    fct._SHARED.entries.clear()


@pytest.mark.parametrize("grad", [False, True])
def test_layers_of_a_forward_share_the_varlen_packing(grad, monkeypatch):
    """Prefill and training under a padding mask: the packing (orders, cu_seqlens) is computed
    by the forward's first layer and taken by the others; a mask changed in place is packed
    again; outputs (and gradients) are those computed from scratch."""
    computed = []
    orig = fct._varlen_packing
    monkeypatch.setattr(fct, "_varlen_packing",
                        lambda *a: computed.append(1) or orig(*a))
    g = torch.Generator().manual_seed(4)
    b, h, hk, s, d = 3, 4, 2, 7, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, generator=g) for n in (h, hk, hk))
    given = torch.ones(b, s, dtype=torch.long)
    given[0, :3] = 0
    given[2, 5:] = 0
    mask = fct.padding_mask(attention_mask=given, kv_length=s)

    def layer():
        x = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = fct.flashcore_attention_forward(_Layer(), *x, mask)[0]
            if grad:
                out.sum().backward()
        return [out.detach()] + ([t.grad for t in x] if grad else [])

    def fresh():
        fct._SHARED.entries.clear()
        n = len(computed)
        got = layer()
        del computed[n:]
        fct._SHARED.entries.clear()
        return got

    fct._SHARED.entries.clear()
    first = layer()
    for _ in range(2):
        assert all(a.equal(c) for a, c in zip(layer(), first))
    assert len(computed) == 1, "the second and third layers packed the batch again"
    assert first[0][0, :3].abs().sum() == 0 and first[0][0, 3:].abs().sum() > 0
    mask[1, 2:4] = False
    after = layer()
    assert len(computed) == 2
    assert all(a.equal(c) for a, c in zip(after, fresh())) and not after[0].equal(first[0])


def test_varlen_route_moves_wide_elements_where_nothing_is_differentiated(monkeypatch):
    """A prefill under a padding mask (no gradient) gathers and scatters the packed rows as
    16-byte elements (fct._wide): the same bytes as the 16-bit gathers a training step makes,
    so the same output bit for bit; a layout whose rows or strides are not whole 16-byte
    elements keeps the 16-bit gathers."""
    made = []
    orig = fct._wide
    monkeypatch.setattr(fct, "_wide", lambda x: made.append(orig(x)) or made[-1])
    varlen = fct.varlen_attention

    def poisoned(q, k, v, cu_q, *args, **kw):    # (rows past the sequences: NaN)
        out = varlen(q, k, v, cu_q, *args, **kw)
        with torch.no_grad():
            out[int(cu_q[-1]):] = float("nan")
        return out
    monkeypatch.setattr(fct, "varlen_attention", poisoned)
    g = torch.Generator().manual_seed(9)
    b, h, hk, s, d = 3, 4, 2, 9, 16
    q, k, v = (torch.randn(b, n, s, d, generator=g).half() for n in (h, hk, hk))
    given = torch.ones(b, s, dtype=torch.long)
    given[0, :3] = 0          # left padding
    given[1, 6:] = 0          # right padding
    given[2, 2:4] = 0         # a hole
    mask = fct.padding_mask(attention_mask=given, kv_length=s)

    def run(grad):
        fct._SHARED.entries.clear()
        x = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            return fct.flashcore_attention_forward(_Layer(), *x, mask)[0].detach()

    trained = run(True)
    assert not made, "a differentiated call took the 16-byte view"
    prefill = run(False)
    assert len(made) == 5 and all(m is not None and m.dtype == torch.complex128 for m in made)
    assert prefill.equal(trained)
    assert prefill[0, :3].abs().sum() == 0 and prefill[1, 6:].abs().sum() == 0
    x = torch.randn(2, 8, 4, 24).to(torch.bfloat16).transpose(1, 2)
    assert orig(x).view(torch.bfloat16).equal(x)
    assert orig(x[..., :12]) is None                         # rows of 24 bytes
    assert orig(x.reshape(-1)[4:4 + 8 * 24].view(8, 24)) is None   # 8-byte offset
    assert orig(torch.zeros(4, 10)) is None                  # 40-byte rows of float32
    assert orig(torch.zeros(4, 10)[:, :8]) is None           # a 40-byte row stride
    assert orig(torch.zeros(4, 8, device="meta")) is None     # no address


def test_per_forward_values_are_not_kept_while_compiling(monkeypatch):
    """Under torch.compile each layer's ops are traced: nothing is kept or taken."""
    calls = []
    src = torch.zeros(2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(3):
        fct._per_forward(src, ("k",), lambda: calls.append(1))
    assert len(calls) == 3
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    fct._SHARED.entries.clear()
    for _ in range(3):
        fct._per_forward(src, ("k",), lambda: calls.append(1))
    assert len(calls) == 4
    fct._SHARED.entries.clear()


def test_inference_mode_tensors_are_not_shared_and_stay_right():
    """Tensors made under torch.inference_mode have no version counter: their layers compute
    the lengths each time (a change in place could not be told), and no call fails."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=g) for _ in range(2))
    fct._SHARED.entries.clear()
    with torch.inference_mode():
        pos = torch.tensor([[6], [4]])
        mask = fct.padding_mask(attention_mask=torch.ones(2, 7, dtype=torch.long), kv_length=7)
        for m in (None, mask):
            a = fct.flashcore_attention_forward(_Layer(), q, k, v, m, position_ids=pos)[0]
            pos[1, 0] = 2
            if m is not None:
                m[1, 3:] = False
            b = fct.flashcore_attention_forward(_Layer(), q, k, v, m, position_ids=pos)[0]
            assert not b[1].equal(a[1]) and b[0].equal(a[0])
            pos[1, 0] = 4
    assert not fct._SHARED.entries
