"""Runs a representative matrix of every kernel once, small sizes, for compute-sanitizer.

Uses plain cudaMalloc per array (no memory pool), so an out-of-bounds access lands outside an
allocation where memcheck sees it. Run through tests/diagnostics/sanitize.sh.

``--persistent``: only the persistent warp-specialised Hopper forward (16-bit and FP8, one to
five tiles per CTA, causal and not, with and without ping-pong; then three FP8 varlen calls,
two FP8 softcap ones and three with dropout), in seconds:
``compute-sanitizer --tool racecheck python3 tests/diagnostics/sanitize_driver.py --persistent``.
"""

import sys

import numpy as np
import cupy as cp

import flashcore

cp.cuda.set_allocator(None)
rng = np.random.default_rng(0)


def mark(section):
    """A line before each section, so that a tool's reports can be told apart by the section
    that launched them (compute-sanitizer writes its reports into the same stream)."""
    print(f"== section {section}", flush=True)


def arr(shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    if dtype in ("bfloat16", "e4m3"):
        import ml_dtypes
        if dtype == "e4m3":     # FP8 inputs cross as the uint8 bits
            return cp.asarray(x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        return cp.asarray(x.astype(ml_dtypes.bfloat16))
    return cp.asarray(x.astype(dtype))


# The Hopper forward's cases (dtype, sq, sk, head dim, heads, options): full, causal with fully
# masked rows, a window, head dims 64 / 128 / 256; the 140-head ones have 2 x 140 tiles or more,
# so that persistent CTAs take two or three each.
HOPPER_FWD_CASES = (("bfloat16", 77, 93, 128, 4, {}),
                    ("float16", 300, 130, 128, 4, {"causal": True}),
                    ("bfloat16", 200, 700, 128, 4, {"window_size": (40, 7)}),
                    ("float16", 333, 401, 64, 4, {"causal": True}),
                    ("bfloat16", 150, 333, 256, 4, {"causal": True}),
                    ("bfloat16", 150, 333, 256, 4, {}),
                    ("bfloat16", 130, 300, 128, 140, {}),
                    ("float16", 130, 300, 64, 140, {"causal": True}),
                    ("bfloat16", 130, 200, 256, 140, {}),
                    # four or five tiles a CTA (d128, d64), tiles with no key among them (more
                    # queries than keys)
                    ("bfloat16", 700, 300, 128, 100, {"causal": True}),
                    ("float16", 500, 300, 64, 140, {}))
FP8_FWD_CASES = (("e4m3", 130, 300, 128, 140, {}),
                 ("e4m3", 300, 333, 128, 40, {"causal": True}))


def run_forward_cases(cases):
    """Each case's forward once (k and v with 2 heads); returns how many ran."""
    for dt, sq, sk, hd, h, kw in cases:
        q, k, v = arr((1, sq, h, hd), dt), arr((1, sk, 2, hd), dt), arr((1, sk, 2, hd), dt)
        flashcore.attention_forward(q, k, v, **kw)
        cp.cuda.Device().synchronize()
    return len(cases)


# The Hopper dK/dV kernels' cases (dtype, sq, sk, head dim, options; 6 query heads over 2 kv
# heads): full, causal with fully masked rows, windows, head dims 64 / 128 / 256.
HOPPER_BWD_CASES = (("bfloat16", 77, 93, 128, {}),
                    ("float16", 300, 130, 128, {"causal": True}),
                    ("bfloat16", 200, 330, 128, {"window_size": (40, 7)}),
                    ("float16", 203, 117, 64, {"causal": True}),
                    ("bfloat16", 77, 300, 64, {"window_size": (20, 50)}),
                    ("bfloat16", 77, 93, 256, {}),
                    ("float16", 300, 130, 256, {"causal": True}),
                    ("bfloat16", 200, 330, 256, {"window_size": (40, 7)}))


def run_backward_cases(cases, dropout_p=0.0):
    """Each case's forward and backward once; returns how many ran."""
    for dt, sq, sk, hd, kw in cases:
        q, k, v = arr((2, sq, 6, hd), dt), arr((2, sk, 2, hd), dt), arr((2, sk, 2, hd), dt)
        do = arr((2, sq, 6, hd), dt)
        if dropout_p:
            kw = dict(kw, dropout_p=dropout_p, rng_state=cp.asarray(np.array([3, 4], np.int64)))
        out, lse = flashcore.attention_forward(q, k, v, **kw)
        flashcore.attention_backward(do, q, k, v, out, lse, **kw)
        cp.cuda.Device().synchronize()
    return len(cases)


if "--hopper-bwd" in sys.argv:
    # only the Hopper dK/dV kernels (with and without dropout, varlen included), in seconds,
    # under memcheck, racecheck and synccheck alike:
    # compute-sanitizer --tool racecheck python3 tests/diagnostics/sanitize_driver.py --hopper-bwd
    n = run_backward_cases(HOPPER_BWD_CASES) + run_backward_cases(HOPPER_BWD_CASES[3:], 0.2)
    # varlen (the warp-specialised kernels; with sm90_bwd_ws off the cp.async
    # one): sequences that are no multiple of the tile, one empty; and cu_seqlens past the
    # rows, decreasing, negative (TMA coordinates from the clamped offsets)
    from flashcore import config as _cfg
    for ws in (False, True):
        with _cfg.override(sm90_bwd_ws=ws):
            for hd in ((64, 128) if not ws else (64, 128, 256)):
                lens = np.array([70, 0, 257, 33], np.int32)
                cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
                t = int(lens.sum())
                q, k, v, do = (arr((t, hh, hd), "bfloat16") for hh in (6, 2, 2, 6))
                out, lse = flashcore.varlen_attention_forward(q, k, v, cu, cu, causal=True)
                flashcore.varlen_attention_backward(do, q, k, v, out, lse, cu, cu, causal=True)
                cp.cuda.Device().synchronize()
                n += 1
                if ws:
                    for cuq in ([0, 5, 900, 141, -4], [100, 0, 141, 141, 141]):
                        cu_q = cp.asarray(np.array(cuq, np.int32))
                        cu_k = cp.asarray(np.array([0, 9, 13, 10**6, 100], np.int32))
                        q, k, v = (arr((tt, hh, hd), "bfloat16")
                                   for tt, hh in ((141, 4), (100, 2), (100, 2)))
                        out, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k,
                                                                      causal=True)
                        flashcore.varlen_attention_backward(arr((141, 4, hd), "bfloat16"), q,
                                                            k, v, out, lse, cu_q, cu_k,
                                                            causal=True)
                        cp.cuda.Device().synchronize()
                        n += 1
    print(f"sanitize driver --hopper-bwd: {n} cases ran")
    sys.exit(0)


if "--decode-key-mask" in sys.argv:
    # only the decode kernel with a key_mask: contiguous (with cache_leftpad) and paged, one
    # split, split partials merged in a cluster and through global memory, lengths past the
    # cache and negative (the mask's row is read only below the clamped length), in seconds:
    #   compute-sanitizer --tool memcheck python3 tests/diagnostics/sanitize_driver.py \
    #       --decode-key-mask
    n = 0
    for paged in (False, True):
        for splits in (1, 0, 40):
            for lens in ((700, 1, 0), (5000, -3, 9999)):
                b, cap = 3, 768
                shape = (b * 3 + 1, 256, 2, 128) if paged else (b, cap, 2, 128)
                kc, vc = arr(shape, "bfloat16"), arr(shape, "bfloat16")
                bt = (cp.asarray(rng.permutation(b * 3 + 1)[:b * 3].reshape(b, 3).astype(np.int32))
                      if paged else None)
                keep = cp.asarray(rng.random((b, cap)) < 0.6)
                lp = None if paged else cp.asarray(np.array([3, 0, 1], np.int32))
                flashcore.attention_with_kvcache(arr((b, 2, 8, 128), "bfloat16"), kc, vc,
                                                 cache_seqlens=cp.asarray(np.array(lens, np.int32)),
                                                 block_table=bt, cache_leftpad=lp, causal=True,
                                                 num_splits=splits, key_mask=keep)
                n += 1
    cp.cuda.Device().synchronize()
    print(f"sanitize driver --decode-key-mask: {n} cases ran")
    sys.exit(0)


if "--persistent" in sys.argv:
    from flashcore import config
    n = 0
    for pp in (True, False):
        with config.override(sm90_fwd_persistent=True, sm90_fwd_pingpong=pp,
                             sm90_fwd_d64_min_seqlen_k=0):
            n += run_forward_cases(HOPPER_FWD_CASES + FP8_FWD_CASES)
    # FP8 varlen (one tile a CTA): three packed sequences, one without queries, whose keys the
    # first sequence's last key block reads past its end
    cq = cp.asarray(np.array([0, 70, 70, 327], np.int32))
    ck = cp.asarray(np.array([0, 200, 205, 605], np.int32))
    for hd, kw in ((128, {}), (256, {"causal": True}), (128, {"window_size": (50, 10)})):
        q, k, v = arr((327, 4, hd), "e4m3"), arr((605, 2, hd), "e4m3"), arr((605, 2, hd), "e4m3")
        flashcore.varlen_attention_forward(q, k, v, cq, ck, 257, 400, **kw)
        cp.cuda.Device().synchronize()
        n += 1
    # FP8 softcap, persistent at head dim 128 and one tile a CTA at 256
    n += run_forward_cases((("e4m3", 130, 300, 128, 140, {"softcap": 20.0}),
                            ("e4m3", 300, 333, 256, 4, {"softcap": 5.0, "causal": True})))
    # dropout (persistent at head dim 64, and at 128 with ping-pong): several tiles a CTA
    rs = cp.asarray(np.array([11, 5], np.int64))
    for pp in (True, False):
        with config.override(sm90_fwd_persistent=True, sm90_fwd_pingpong=pp,
                             sm90_fwd_d64_min_seqlen_k=0):
            n += run_forward_cases(
                (("bfloat16", 130, 300, 128, 140, {"dropout_p": 0.15, "rng_state": rs}),
                 ("float16", 500, 300, 64, 140, {"causal": True, "dropout_p": 0.2,
                                                 "rng_state": rs}),
                 ("bfloat16", 700, 300, 128, 100, {"causal": True, "dropout_p": 0.1,
                                                   "rng_state": rs})))
    print(f"sanitize driver --persistent: {n} cases ran")
    sys.exit(0)


CASES = []
for d in (32, 40, 64, 96, 128, 192, 256):
    CASES.append(dict(d=d, sq=77, sk=93, causal=d % 64 == 0, dtype="bfloat16" if d % 3 else "float16"))
CASES += [
    dict(d=64, sq=130, sk=70, causal=True, dtype="float16"),             # fully masked rows
    dict(d=128, sq=1, sk=257, causal=False, dtype="bfloat16"),
    dict(d=64, sq=200, sk=200, window=(31, 5), dtype="bfloat16"),
    dict(d=64, sq=100, sk=150, softcap=5.0, alibi=True, dtype="float16"),
    dict(d=128, sq=190, sk=190, causal=True, deterministic=True, dtype="bfloat16"),
    dict(d=64, varlen=True, dtype="bfloat16"),
]
# The Ampere-class kernels first, everywhere (on compute capability 9.0 the Hopper family is the
# default for head dims 64/128/256 and is checked separately below).
from flashcore import config as _config
from flashcore.kernels import backward as _bwd, forward as _fwd
_was = _config.set(sm90_fwd=False, sm90_bwd=False)
n = 0
mark("ampere")
for c in CASES:
    d, dt = c["d"], c["dtype"]
    kw = dict(causal=c.get("causal", False), window_size=c.get("window", (-1, -1)),
              softcap=c.get("softcap", 0.0), deterministic=c.get("deterministic", False))
    if c.get("alibi"):
        kw["alibi_slopes"] = cp.asarray(rng.uniform(0.1, 0.5, 4).astype(np.float32))
    if c.get("varlen"):
        cu_q = cp.asarray(np.array([0, 5, 5, 140, 141], np.int32))
        cu_k = cp.asarray(np.array([0, 9, 13, 100, 100], np.int32))
        q, k, v, do = arr((141, 4, d), dt), arr((100, 2, d), dt), arr((100, 2, d), dt), arr((141, 4, d), dt)
        out, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, **kw)
        g = flashcore.varlen_attention_backward(do, q, k, v, out, lse, cu_q, cu_k, **kw)
    else:
        q, do = arr((2, c["sq"], 4, d), dt), arr((2, c["sq"], 4, d), dt)
        k, v = arr((2, c["sk"], 2, d), dt), arr((2, c["sk"], 2, d), dt)
        out, lse = flashcore.attention_forward(q, k, v, **kw)
        g = flashcore.attention_backward(do, q, k, v, out, lse, **kw)
    cp.cuda.Device().synchronize()
    n += 1

# The Hopper forward (wgmma), where the device has it: full, causal with fully masked rows,
# a window, varlen -- forward only (its backward is the one above).
if int(cp.cuda.Device().compute_capability) == 90:
    # v0, v1, ws one tile per CTA, ws persistent (where such a kernel exists)
    mark("hopper forward")
    for pipelined, ws, pers in ((False, False, True), (True, False, True), (True, True, False),
                                (True, True, True)):
        _fwd.set_sm90(True, pipelined=pipelined, ws=ws)
        _config.set(sm90_fwd_persistent=pers)
        n += run_forward_cases(HOPPER_FWD_CASES)
        cu_q = cp.asarray(np.array([0, 5, 5, 140, 141], np.int32))
        cu_k = cp.asarray(np.array([0, 9, 13, 500, 500], np.int32))
        q, k, v = arr((141, 4, 128), "bfloat16"), arr((500, 2, 128), "bfloat16"), arr((500, 2, 128), "bfloat16")
        flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=True)
        cp.cuda.Device().synchronize()
        n += 1
    # varlen on the warp-specialised forward (head dim 64 from any key count): sequences ending
    # inside a key block, one empty, cu_seqlens past the rows, decreasing, negative
    mark("hopper varlen forward, bad cu_seqlens")
    _fwd.set_sm90(True, pipelined=True, ws=True)
    with _config.override(sm90_fwd_d64_min_seqlen_k=0):
        for hd in (64, 128, 256):
            for cuq, cuk in (([0, 5, 5, 140, 141], [0, 9, 13, 100, 100]),
                             ([0, 5, 900, 141, -4], [0, 9, 13, 10**6, 100]),
                             ([100, 0, 141, 141, 141], [0, 9, 13, 10**6, 100])):
                cu_q = cp.asarray(np.array(cuq, np.int32))
                cu_k = cp.asarray(np.array(cuk, np.int32))
                q, k, v = (arr((tt, hh, hd), "bfloat16") for tt, hh in ((141, 4), (100, 2), (100, 2)))
                flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=True)
                cp.cuda.Device().synchronize()
                n += 1
    _fwd.set_sm90(False, pipelined=False, ws=False)
    _config.set(sm90_fwd_persistent=True)
    _bwd.set_sm90(True)                                # the Hopper dK/dV kernels
    mark("hopper backward")
    n += run_backward_cases(HOPPER_BWD_CASES)
    # varlen cu_seqlens past the rows, decreasing, negative, on the Hopper kernel (each
    # sequence's dQ tiles at its own clamped offset)
    for hd, cuq in ((64, [0, 5, 900, 141, -4]), (128, [0, 5, 900, 141, -4]),
                    (64, [100, 0, 141, 141, 141]), (128, [100, 0, 141, 141, 141])):
        cu_q = cp.asarray(np.array(cuq, np.int32))
        cu_k = cp.asarray(np.array([0, 9, 13, 10**6, 100], np.int32))
        q, k, v = (arr((t, hh, hd), "bfloat16") for t, hh in ((141, 4), (100, 2), (100, 2)))
        out, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=True)
        flashcore.varlen_attention_backward(arr((141, 4, hd), "bfloat16"), q, k, v, out,
                                            lse, cu_q, cu_k, causal=True)
        cp.cuda.Device().synchronize()
        n += 1
    _bwd.set_sm90(False)
_config.set(**_was._asdict())

# KV-cache decoding: contiguous and paged caches, append with rotary, split-KV and not, GQA.
# Split-KV merged inside a thread-block cluster (the default on sm_90 for 2 to 16 splits), with
# the fused global-memory combine (the last CTA of each group merges) and with the separate
# combine kernel; 40 splits of at most 300 keys leave most CTAs without a key.
from flashcore.kernels import decode as _dec
_fused_was, _cluster_was = _dec.fused_combine_enabled(), _dec.cluster_merge_enabled()
for d, page, splits, sq, mode in ((128, None, 1, 1, "cluster"), (64, 16, 3, 1, "cluster"),
                                  (128, 256, 0, 4, "cluster"), (72, 16, 2, 2, "cluster"),
                                  (128, None, 16, 1, "cluster"), (64, 16, 3, 1, "global"),
                                  (128, None, 40, 1, "global"), (64, 16, 3, 1, "two"),
                                  (128, 256, 40, 2, "two"), (128, 48, 3, 1, "cluster")):
    mark(f"decode d{d} page {page} splits {splits} sq {sq} {mode}")
    _dec.set_fused_combine(mode != "two")
    _dec.set_cluster_merge(mode == "cluster")
    b, h, hk, cap = 3, 8, 2, 512
    lens = np.array([0, 37, 300], np.int32)
    q = arr((b, sq, h, d), "bfloat16")
    k_new, v_new = arr((b, sq, hk, d), "bfloat16"), arr((b, sq, hk, d), "bfloat16")
    if page is None:
        kc, vc, table = arr((b, cap, hk, d), "bfloat16"), arr((b, cap, hk, d), "bfloat16"), None
    else:
        per = cap // page
        kc, vc = arr((b * per + 1, page, hk, d), "bfloat16"), arr((b * per + 1, page, hk, d), "bfloat16")
        table = cp.asarray(rng.permutation(b * per + 1)[: b * per].reshape(b, per).astype(np.int32))
    rot = d // 2 if d % 32 == 0 else 16
    ang = rng.uniform(0, 6.3, size=(cap, rot // 2)).astype(np.float32)
    import ml_dtypes
    cos = cp.asarray(np.cos(ang).astype(ml_dtypes.bfloat16))
    sin = cp.asarray(np.sin(ang).astype(ml_dtypes.bfloat16))
    flashcore.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=cp.asarray(lens),
                                     block_table=table, rotary_cos=cos, rotary_sin=sin,
                                     causal=True, num_splits=splits)
    cp.cuda.Device().synchronize()
    n += 1
_dec.set_fused_combine(_fused_was)
_dec.set_cluster_merge(_cluster_was)
print(f"sanitize driver: {n} cases ran")

# Odd head dims (padded to a multiple of 8 inside the CuPy backend), forward and backward.
mark("odd head dims")
for d in (59, 111):
    q, do = arr((2, 77, 4, d), "bfloat16"), arr((2, 77, 4, d), "bfloat16")
    k, v = arr((2, 93, 2, d), "bfloat16"), arr((2, 93, 2, d), "bfloat16")
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
    cp.cuda.Device().synchronize()
    n += 1

# Replays: the second call of a layout goes through its recorded launch plan (kernels/plans.py),
# with new arrays at new addresses; forward, backward, decode.
mark("replays")
for _ in range(3):
    q, do = arr((2, 77, 4, 64), "bfloat16"), arr((2, 77, 4, 64), "bfloat16")
    k, v = arr((2, 93, 2, 64), "bfloat16"), arr((2, 93, 2, 64), "bfloat16")
    out, lse = flashcore.attention_forward(q, k, v, causal=True)
    flashcore.attention_backward(do, q, k, v, out, lse, causal=True)
    kc, vc = arr((3, 512, 2, 128), "bfloat16"), arr((3, 512, 2, 128), "bfloat16")
    flashcore.attention_with_kvcache(arr((3, 1, 8, 128), "bfloat16"), kc, vc,
                                     cache_seqlens=cp.asarray(np.array([5, 300, 511], np.int32)),
                                     causal=True)
    cp.cuda.Device().synchronize()
    n += 3

# cache_leftpad: keys [leftpad, cache_seqlens + new) of each sequence, with append and rotary.
mark("cache_leftpad")
kc, vc = arr((3, 512, 2, 128), "bfloat16"), arr((3, 512, 2, 128), "bfloat16")
ang = rng.uniform(0, 6.3, size=(512, 32)).astype(np.float32)
import ml_dtypes
flashcore.attention_with_kvcache(arr((3, 2, 8, 128), "bfloat16"), kc, vc,
                                 arr((3, 2, 2, 128), "bfloat16"), arr((3, 2, 2, 128), "bfloat16"),
                                 cache_seqlens=cp.asarray(np.array([7, 300, 100], np.int32)),
                                 cache_leftpad=cp.asarray(np.array([0, 250, 100], np.int32)),
                                 rotary_cos=cp.asarray(np.cos(ang).astype(ml_dtypes.bfloat16)),
                                 rotary_sin=cp.asarray(np.sin(ang).astype(ml_dtypes.bfloat16)),
                                 causal=True)
cp.cuda.Device().synchronize()
n += 1

# Bad values in default mode (not read back on the host): lengths past the cache, negative
# lengths, block indices past the pool or negative, leftpad past the length, cu_seqlens past
# the arrays. The calls must touch nothing out of bounds; what they return is unspecified.
mark("bad lengths")
b, hk, d, cap, page = 3, 2, 128, 512, 16
for lens, lp in (([600, -5, 512], None), ([10, 20, 30], [40, -3, 5000])):
    kc, vc = arr((b, cap, hk, d), "bfloat16"), arr((b, cap, hk, d), "bfloat16")
    flashcore.attention_with_kvcache(arr((b, 1, 8, d), "bfloat16"), kc, vc,
                                     arr((b, 1, hk, d), "bfloat16"), arr((b, 1, hk, d), "bfloat16"),
                                     cache_seqlens=cp.asarray(np.array(lens, np.int32)),
                                     cache_leftpad=None if lp is None else cp.asarray(np.array(lp, np.int32)),
                                     causal=True)
    cp.cuda.Device().synchronize()
    n += 1
mark("bad block table")
for page, splits in ((16, 1), (16, 4), (48, 1), (48, 4), (256, 1), (256, 4)):
    per = cap // page
    kc, vc = arr((b * per, page, hk, d), "bfloat16"), arr((b * per, page, hk, d), "bfloat16")
    table = np.arange(b * per, dtype=np.int32).reshape(b, per)
    table[0, min(3, per - 1)], table[1, 0], table[2, -1] = 10**6, -7, b * per
    flashcore.attention_with_kvcache(arr((b, 1, 8, d), "bfloat16"), kc, vc,
                                     arr((b, 1, hk, d), "bfloat16"), arr((b, 1, hk, d), "bfloat16"),
                                     cache_seqlens=cp.asarray(np.array([100, 5, 600], np.int32)),
                                     block_table=cp.asarray(table), causal=True, num_splits=splits)
    cp.cuda.Device().synchronize()
    n += 1
mark("bad cu_seqlens")
cu_q = cp.asarray(np.array([0, 5, 900, 141, -4], np.int32))
cu_k = cp.asarray(np.array([0, 9, 13, 10**6, 100], np.int32))
q, k, v = arr((141, 4, 64), "bfloat16"), arr((100, 2, 64), "bfloat16"), arr((100, 2, 64), "bfloat16")
out, lse = flashcore.varlen_attention_forward(q, k, v, cu_q, cu_k, causal=True)
flashcore.varlen_attention_backward(arr((141, 4, 64), "bfloat16"), q, k, v, out, lse, cu_q, cu_k, causal=True)
cp.cuda.Device().synchronize()
n += 1
# Varlen over a paged cache, with good values and with table entries past the pool, negative
# ones and cu_seqlens_k past the table's capacity. On an H100/H200 head dims 64, 128 and 256
# take the warp-specialised forward (pages of whole key blocks by TMA: 128 and 256 at d128;
# others copied by its producer: 16, 48), head dim 96 the Ampere-class kernel (a lookup per
# chunk); elsewhere all Ampere-class (a thread's rows in one page at d128).
for bad, page, d, causal in ((False, 128, 128, True), (True, 128, 128, True),
                             (False, 16, 128, True), (True, 16, 128, True), (True, 48, 96, True),
                             (False, 256, 128, False), (True, 256, 128, False),
                             (True, 16, 256, False), (False, 48, 64, False),
                             (True, 32, 64, True)):
    mark(f"paged varlen, bad {bad}, page {page}, d{d}, causal {causal}")
    hk, per = 2, 3 * 256 // page     # (768 keys a sequence: head dim 64 takes the Hopper kernel)
    kc, vc = arr((3 * per, page, hk, d), "bfloat16"), arr((3 * per, page, hk, d), "bfloat16")
    table = np.random.default_rng(page).permutation(3 * per).astype(np.int32).reshape(3, per)
    cu_k = np.array([0, 300, 301, 650], np.int32)
    if bad:
        table[0, 1], table[2, per - 1] = 10**6, -3
        cu_k = np.array([0, 300, 10**6, 50], np.int32)
    q = arr((40, 8, d), "bfloat16")
    flashcore.varlen_attention_forward(q, kc, vc, cp.asarray(np.array([0, 20, 21, 40], np.int32)),
                                       cp.asarray(cu_k), causal=causal,
                                       block_table=cp.asarray(table))
    cp.cuda.Device().synchronize()
    n += 1
# Dropout forward and backward: on an H100/H200 the Hopper forward (d128, d256) and dK/dV (d64,
# d128, d256), and the Ampere-class forward (d64 at short keys) and dQ kernel (deterministic);
# elsewhere all Ampere-class.
for d, det in ((64, False), (256, False), (128, True), (128, False)):
    mark(f"dropout d{d} deterministic {det}")
    q, do = arr((2, 77, 4, d), "bfloat16"), arr((2, 77, 4, d), "bfloat16")
    k, v = arr((2, 93, 2, d), "bfloat16"), arr((2, 93, 2, d), "bfloat16")
    st = cp.asarray(np.array([3, 4], np.int64))
    out, lse = flashcore.attention_forward(q, k, v, causal=True, dropout_p=0.2, rng_state=st)
    flashcore.attention_backward(do, q, k, v, out, lse, causal=True, dropout_p=0.2,
                                 rng_state=st, deterministic=det)
    cp.cuda.Device().synchronize()
    n += 1
print(f"sanitize driver: {n} cases ran (with the bad-value cases)")
