"""The CuPy backend: the CUDA kernels in ``cuda/``, JIT-compiled by NVRTC.

Kernels run on the device that holds the inputs, on CuPy's current stream. The torch backend
hands its CUDA tensors to the same methods as :class:`flashcore.kernels.device.TorchArray`
(allocations then come from torch, kernels run on torch's current stream, no CuPy array is
made: :mod:`flashcore.kernels.device`). Availability is probed lazily: importing flashcore
never imports CuPy.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import numpy as np

from ..spec import AttentionSpec
from ..kernels import plans
from ..kernels.device import lib_of, scope
from .base import Backend, raise_oom, register

MIN_COMPUTE_CAPABILITY = 80


@contextlib.contextmanager
def _translate_oom(what):
    try:
        yield
    except Exception as e:
        raise_oom(e, what)
        raise


@functools.lru_cache(maxsize=None)
def _probe() -> str | None:
    """Why the kernels cannot run here, or None (asked of the CUDA driver: no ``import cupy``)."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'flashcore[cuda12]' or 'flashcore[cuda13]')"
    try:
        from ..jit import device_facts
        from ..kernels.device import driver
        n = driver().device_count()
    except Exception as e:  # no driver, no device
        return f"no CUDA device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if n == 0:
        return "no CUDA device"
    ccs = [device_facts(i)[0] for i in range(n)]
    if max(ccs) < MIN_COMPUTE_CAPABILITY:
        return (f"compute capability {max(ccs) / 10:.1f} is below the "
                f"{MIN_COMPUTE_CAPABILITY / 10:.1f} the kernels need (mma.sync bf16, cp.async)")
    return None


@functools.lru_cache(maxsize=None)
def _decode_kernels_reason() -> str | None:
    """None when the decoding kernels' launcher imports, else why not (checked once)."""
    try:
        from ..kernels.decode import decode_launches, launch_rotary_append  # noqa: F401
    except Exception as e:   # the module is missing, or it failed to import
        msg = str(e).splitlines()[0] if str(e) else ""
        return f"decode kernels not available: {type(e).__name__}: {msg}"
    return None


def _decode_fp8_reason() -> str | None:
    """None when the current device's decode kernels take FP8 caches (compute capability 8.9
    and newer convert e4m3 in hardware), else why not."""
    from ..jit import device_facts
    from ..kernels.device import current_device
    cc = device_facts(current_device())[0]
    if cc < 89:
        return ("argument 'k_cache': float8_e4m3fn (FP8) caches are decoded on compute "
                f"capability 8.9 or newer; this device has {cc / 10:.1f}")
    return None


def _fp8_headdim_reason(spec) -> str | None:
    from ..kernels.decode import FP8_HEADDIMS
    if spec.fp8 and spec.attn.headdim not in FP8_HEADDIMS:
        return (f"argument 'k_cache': float8_e4m3fn caches take headdim 128 or 256 on the "
                f"CUDA kernels, got headdim {spec.attn.headdim}")
    return None


def _fp8_reasons(spec, backward) -> list[str]:
    """Why the FP8 forward kernel cannot take this float8_e4m3fn call (named), or []."""
    from ..jit import device_facts
    from ..kernels.forward import fp8_reasons
    cc = device_facts(int(spec.device.split(":")[1]))[0]
    r = fp8_reasons(cc, spec.headdim, alibi=spec.alibi is not None, paged=spec.paged,
                    dropout=bool(spec.dropout_p))
    if backward:
        r.append("argument 'q': float8_e4m3fn attention is forward only (no backward)")
    return r


class CupyBackend(Backend):
    name = "cupy"
    libraries = ("cupy",)
    # float8_e4m3fn: the FP8 forward (uint8 CuPy arrays of the bits; see _fp8_reasons)
    dtypes = ("float16", "bfloat16", "float8_e4m3fn")
    max_headdim = 256        # any head dim up to 256: others than multiples of 8 are padded
    is_deterministic = False   # dQ is accumulated with atomics unless deterministic=True
    supports_kvcache = True    # when flashcore.kernels.decode imports (see the reasons)
    # FP8 caches: uint8 arrays holding float8_e4m3fn bits (CuPy has no float8 dtype), head dims
    # flashcore.kernels.decode.FP8_HEADDIMS
    supports_fp8_kvcache = True

    def unavailable_reason(self):
        return _probe()

    def info(self):
        if _probe() is not None:
            return {}
        import cupy
        from cupy_backends.cuda.libs import nvrtc
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return {"cupy": cupy.__version__, "nvrtc": ".".join(map(str, nvrtc.getVersion())),
                "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
                "gpu": name, "compute_capability": dev.compute_capability,
                "multiprocessors": props["multiProcessorCount"]}

    def not_supported_reasons(self, spec: AttentionSpec, backward: bool = False):
        r = super().not_supported_reasons(spec, backward)
        if r and r[0].startswith("not available"):
            return r
        if spec.nheads > 65535 or spec.batch > 65535:
            r.append(f"at most 65535 heads and 65535 sequences per call (the CUDA grid), got "
                     f"nheads={spec.nheads}, batch={spec.batch}")
        if spec.library == "cupy":
            from ..jit import device_facts
            cc = device_facts(int(spec.device.split(":")[1]))[0]
            if cc < MIN_COMPUTE_CAPABILITY:
                r.append(f"device {spec.device} has compute capability {cc / 10:.1f} < 8.0")
        if spec.dtype == "float8_e4m3fn":
            r.extend(_fp8_reasons(spec, backward))
        return r

    @staticmethod
    def _kernel_kwargs(spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state=None):
        kw = dict(softmax_scale=spec.softmax_scale, window_left=spec.window_left,
                  window_right=spec.window_right, softcap=spec.softcap,
                  alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                  cu_seqlens_k=cu_seqlens_k,
                  max_seqlen_q=spec.seqlen_q if spec.varlen else None,
                  max_seqlen_k=spec.seqlen_k if spec.varlen else None)
        if spec.dropout_p:
            kw.update(dropout_p=spec.dropout_p, rng_state=rng_state)
        return kw

    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                out=None, lse=None, block_table=None, out_fp32=False, rng_state=None,
                descales=None, fp8_out="bfloat16"):
        """FP8 (``spec.dtype`` float8_e4m3fn): q, k, v uint8 arrays of the bits, ``descales``
        (q, k, v; None or float32 broadcastable to (batch, nheads_k)), out in ``fp8_out``."""
        from ..kernels.forward import launch_forward
        if spec.dtype == "float8_e4m3fn":
            return self._forward_fp8(spec, q, k, v, out, lse, descales, fp8_out,
                                     cu_seqlens_q, cu_seqlens_k)
        xp = lib_of(q)
        with scope(q.device.id), _translate_oom("forward"):
            if out is None:
                out = xp.empty(q.shape, dtype=np.float32 if out_fp32 else q.dtype)
            if lse is None:
                shape = (spec.nheads, spec.total_q) if spec.varlen else \
                    (spec.batch, spec.nheads, spec.seqlen_q)
                lse = xp.empty(shape, dtype=np.float32)
            if q.size and k.shape[0]:
                kw = self._kernel_kwargs(spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                         rng_state)
                if block_table is not None:
                    kw["block_table"] = block_table
                if spec.headdim % 8:
                    # flash-attn's way: zero columns up to a multiple of 8 add nothing to the
                    # scores (the scale is the true head dim's), and come out as zeros
                    o8 = xp.empty(_padded_shape(q), out.dtype)
                    launch_forward(_pad8(q), _pad8(k), _pad8(v), o8, lse, **kw)
                    out[...] = o8[..., :spec.headdim]
                    plans.spoil()      # copies around the launch: never replayed
                else:
                    plans.offer(launch_forward(q, k, v, out, lse, **kw))
            else:   # no queries, or no keys at all: nothing is visible
                out[...] = 0
                lse[...] = -np.inf
        return out, lse

    def _forward_fp8(self, spec, q, k, v, out, lse, descales, fp8_out, cu_seqlens_q=None,
                     cu_seqlens_k=None):
        from ..jit import device_facts
        from ..kernels.forward import fp8_reasons, launch_forward_fp8
        from ..spec import exact_descale
        why = fp8_reasons(device_facts(q.device.id)[0], spec.headdim,
                          alibi=spec.alibi is not None, paged=spec.paged)
        if why:
            raise ValueError("; ".join(why))
        qd, kd, vd = (exact_descale(d, spec.batch, spec.nheads_k)
                      for d in (descales or (None, None, None)))
        xp = lib_of(q)
        with scope(q.device.id), _translate_oom("forward"):
            if out is None:
                out = xp.empty(q.shape, dtype=_np_dtype(fp8_out))
            if lse is None:
                shape = (spec.nheads, spec.total_q) if spec.varlen else \
                    (spec.batch, spec.nheads, spec.seqlen_q)
                lse = xp.empty(shape, dtype=np.float32)
            if q.size and k.shape[0 if spec.varlen else 1]:
                plans.offer(launch_forward_fp8(
                    q.view(np.uint8), k.view(np.uint8), v.view(np.uint8), out, lse,
                    softmax_scale=spec.softmax_scale, window_left=spec.window_left,
                    window_right=spec.window_right, q_descale=qd, k_descale=kd, v_descale=vd,
                    softcap=spec.softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=spec.seqlen_q if spec.varlen else None,
                    max_seqlen_k=spec.seqlen_k if spec.varlen else None))
            else:   # no queries, or no keys at all: nothing is visible
                out[...] = 0
                lse[...] = -np.inf
        return out, lse

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, dq=None, dk=None, dv=None,
                 rng_state=None):
        from ..kernels.backward import launch_backward
        xp = lib_of(q)
        with scope(q.device.id), _translate_oom("backward"):
            dq = xp.empty(q.shape, q.dtype) if dq is None else dq
            dk = xp.empty(k.shape, k.dtype) if dk is None else dk
            dv = xp.empty(v.shape, v.dtype) if dv is None else dv
            if q.size and k.shape[0]:
                kw = self._kernel_kwargs(spec, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                         rng_state)
                if spec.headdim % 8:       # padded as in the forward (the padding's gradient
                    d = spec.headdim       # is computed and dropped)
                    g8 = [xp.empty(_padded_shape(x), x.dtype) for x in (q, k, v)]
                    launch_backward(_pad8(dout), _pad8(q), _pad8(k), _pad8(v), _pad8(out), lse,
                                    *g8, deterministic=spec.deterministic, **kw)
                    for dst, g in zip((dq, dk, dv), g8):
                        dst[...] = g[..., :d]
                    plans.spoil()
                else:
                    plans.offer(launch_backward(dout, q, k, v, out, lse, dq, dk, dv,
                                                deterministic=spec.deterministic, **kw))
            else:
                dq[...] = 0
                dk[...] = 0
                dv[...] = 0
        return dq, dk, dv

    # -- decoding with a KV cache -----------------------------------------------------------

    def kvcache_not_supported_reasons(self, spec):
        r = super().kvcache_not_supported_reasons(spec)
        if r and r[0].startswith("not available"):
            return r
        why = _decode_kernels_reason()
        if why:
            r.append(why)
        elif spec.fp8:
            why = _decode_fp8_reason()
            if why:
                r.append(why)
        why = _fp8_headdim_reason(spec)
        if why:
            r.append(why)
        return r

    def forward_kvcache(self, spec, q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                        block_table=None, rotary_cos=None, rotary_sin=None, alibi_slopes=None,
                        out=None, lse=None, cache_leftpad=None, k_descale=None, v_descale=None,
                        key_mask=None):
        """Append (rotary) with ``launch_rotary_append``, then ``launch_decode`` over
        ``cache_seqlens + seqlen_new`` keys (computed on the device, no host round trip).

        A head dim that is no multiple of 8 is padded with zero columns, the caches included,
        and appended rows are copied back: flash-attn's way (it copies the whole cache every
        call too), since the kernels read and write 16 bytes at a time.

        FP8 caches (``spec.fp8``): uint8 arrays of float8_e4m3fn bits, read only, passed to
        the kernels as they are with ``k_descale``/``v_descale`` (None, or contiguous float32
        (batch, nheads_k)); head dims 128 and 256 only (never padded)."""
        a = spec.attn
        why = _fp8_headdim_reason(spec)
        if why:
            raise ValueError(why)
        xp = lib_of(q)
        with scope(q.device.id), _translate_oom("decode"):
            if out is None:
                out = xp.empty(q.shape, dtype=q.dtype)
            if lse is None:
                lse = xp.empty((a.batch, a.nheads, a.seqlen_q), dtype=np.float32)
            if a.batch == 0:
                return out, lse
            if a.headdim % 8:
                pad = [None if x is None else _pad8(x) for x in (q, k_cache, v_cache, k, v)]
                out8 = xp.empty(pad[0].shape, dtype=q.dtype)
                self._forward_kvcache(spec, *pad, cache_seqlens=cache_seqlens,
                                      block_table=block_table, rotary_cos=rotary_cos,
                                      rotary_sin=rotary_sin, alibi_slopes=alibi_slopes,
                                      out=out8, lse=lse, cache_leftpad=cache_leftpad,
                                      k_descale=None, v_descale=None, key_mask=key_mask)
                out[...] = out8[..., :a.headdim]
                if spec.appends:
                    k_cache[...] = pad[1][..., :a.headdim]
                    v_cache[...] = pad[2][..., :a.headdim]
                plans.spoil()
                return out, lse
            return self._forward_kvcache(spec, q, k_cache, v_cache, k, v,
                                         cache_seqlens=cache_seqlens, block_table=block_table,
                                         rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                         alibi_slopes=alibi_slopes, out=out, lse=lse,
                                         cache_leftpad=cache_leftpad, k_descale=k_descale,
                                         v_descale=v_descale, key_mask=key_mask)

    def _forward_kvcache(self, spec, q, k_cache, v_cache, k, v, *, cache_seqlens, block_table,
                         rotary_cos, rotary_sin, alibi_slopes, out, lse, cache_leftpad,
                         k_descale, v_descale, key_mask=None):
        from ..kernels.decode import decode_launches, launch_rotary_append
        from ..reference import apply_rotary
        a = spec.attn
        xp = lib_of(q)
        # (the caller holds the device and the OOM translation)
        if spec.cache_seqlens_int is not None:
            before = xp.full((a.batch,), spec.cache_seqlens_int, dtype=np.int32)
        else:
            before = xp.ascontiguousarray(cache_seqlens)
        q_att, after = q, before
        if spec.appends:
            rotary = rotary_cos is not None
            # q rotated by the append kernel where its positions are cache_seqlens + i;
            # flash-attn's other case (all rows at cache_seqlens) with array operations
            fused_q = rotary and spec.rotary_per_row and q.size > 0
            q_out = xp.empty(q.shape, dtype=q.dtype) if fused_q else None
            launch_rotary_append(k_cache, v_cache, k, v, before, block_table, rotary_cos,
                                 rotary_sin, spec.rotary_interleaved,
                                 q=q if fused_q else None, q_out=q_out)
            if fused_q:
                q_att = q_out
            elif rotary and q.size:
                pos = xp.broadcast_to(before[:, None].astype(np.int64),
                                      (a.batch, a.seqlen_q))
                q_att = apply_rotary(q, rotary_cos, rotary_sin, pos, spec.rotary_interleaved,
                                     xp=xp)
            after = before + np.int32(spec.seqlen_new)
        if q.size:
            _, piece = decode_launches(
                q_att, k_cache, v_cache, out, lse, cache_seqlens=after,
                block_table=block_table, softmax_scale=a.softmax_scale,
                window_left=a.window_left, window_right=a.window_right, softcap=a.softcap,
                alibi_slopes=alibi_slopes, num_splits=spec.num_splits,
                cache_leftpad=cache_leftpad, key_mask=key_mask,
                # (FP8 caches only: 16-bit calls stay as they were)
                **({"k_descale": k_descale, "v_descale": v_descale} if spec.fp8 else {}))
            if after is cache_seqlens:      # the decode kernel was all of the call
                plans.offer(piece)
        return out, lse


def _np_dtype(name):
    """The NumPy dtype of an output dtype name (bfloat16 through ml_dtypes)."""
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _padded_shape(x):
    return (*x.shape[:-1], -(-x.shape[-1] // 8) * 8)


def _pad8(x):
    """``x`` with zero columns appended up to a multiple of 8 (a new array)."""
    d = x.shape[-1]
    p = lib_of(x).empty(_padded_shape(x), x.dtype)
    p[..., :d] = x
    p[..., d:] = 0
    return p


register(CupyBackend())
