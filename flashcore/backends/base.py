"""The backend protocol, the registry and dispatch.

A backend states its capabilities as data (class attributes) and explains every refusal:
``not_supported_reasons(spec)`` returns readable strings, and when no backend can take a call
the user sees each backend's reasons at once.
"""
from __future__ import annotations

import re
from typing import ClassVar

from ..spec import AttentionSpec, KVCacheSpec

__all__ = ["Backend", "NotSupportedError", "DeviceMemoryError", "raise_oom", "register",
           "get_backend", "all_backends", "choose", "choose_kvcache"]


class NotSupportedError(ValueError):
    """No backend can run this call; the message lists every backend's reasons."""


class DeviceMemoryError(MemoryError):
    """The GPU ran out of memory; ``nbytes`` is the size of the allocation that failed."""

    def __init__(self, msg, nbytes=None):
        super().__init__(msg)
        self.nbytes = nbytes


def raise_oom(e: Exception, what: str) -> None:
    """Raise ``e`` as a :class:`DeviceMemoryError` if it is an out-of-memory error (CuPy's and
    torch's share the class name); return otherwise (the caller re-raises ``e``)."""
    if type(e).__name__ != "OutOfMemoryError":
        return
    m = re.search(r"allocating ([\d,]+) bytes", str(e))
    nbytes = int(m.group(1).replace(",", "")) if m else None
    raise DeviceMemoryError(
        f"flashcore {what}: out of GPU memory while allocating "
        f"{nbytes if nbytes is not None else 'an unknown number of'} bytes ({e})",
        nbytes) from None


class Backend:
    name: ClassVar[str]
    #: array libraries whose arrays this backend takes ('numpy', 'cupy', 'torch')
    libraries: ClassVar[tuple[str, ...]]
    dtypes: ClassVar[tuple[str, ...]]
    max_headdim: ClassVar[int | None] = None
    headdim_multiple: ClassVar[int] = 1
    supports_varlen: ClassVar[bool] = True
    supports_window: ClassVar[bool] = True
    supports_softcap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_backward: ClassVar[bool] = True
    is_deterministic: ClassVar[bool] = True   # deterministic without being asked
    supports_kvcache: ClassVar[bool] = False   # attention_with_kvcache (decoding)
    supports_fp8_kvcache: ClassVar[bool] = False   # ... over a float8_e4m3fn cache

    # -- availability --------------------------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """None when usable on this machine, else why not (no GPU, package missing, ...)."""
        return None

    def info(self) -> dict:
        """Versions and device facts for the environment report."""
        return {}

    # -- capabilities -------------------------------------------------------------------
    def not_supported_reasons(self, spec: AttentionSpec, backward: bool = False) -> list[str]:
        r = []
        why = self.unavailable_reason()
        if why:
            return [f"not available: {why}"]
        if spec.library not in self.libraries:
            r.append(f"takes {' or '.join(self.libraries)} arrays, got {spec.library} arrays")
        if spec.dtype not in self.dtypes:
            r.append(f"dtype {spec.dtype} not in {self.dtypes}")
        if self.max_headdim is not None and spec.headdim > self.max_headdim:
            r.append(f"headdim {spec.headdim} > {self.max_headdim}")
        if spec.headdim % self.headdim_multiple:
            r.append(f"headdim {spec.headdim} is not a multiple of {self.headdim_multiple}")
        if spec.varlen and not self.supports_varlen:
            r.append("variable-length batches are not supported")
        if spec.is_local and not spec.causal and not self.supports_window:
            r.append("sliding windows are not supported")
        if spec.softcap and not self.supports_softcap:
            r.append("softcap is not supported")
        if spec.alibi and not self.supports_alibi:
            r.append("ALiBi is not supported")
        if backward and not self.supports_backward:
            r.append("no backward pass")
        return r

    # -- the work -------------------------------------------------------------------------
    def forward(self, spec, q, k, v, *, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                block_table=None, out_fp32=False, rng_state=None):
        """Return ``(out, lse)``; out like q in q's dtype (float32 with ``out_fp32``), lse
        float32 (b, h, sq) / (h, total_q). ``block_table`` (varlen, ``spec.paged``): k, v are a
        paged cache (see flashcore.spec). ``rng_state``: dropout's (seed, offset) when
        ``spec.dropout_p`` > 0 (flashcore.dropout)."""
        raise NotImplementedError

    def backward(self, spec, dout, q, k, v, out, lse, *, alibi_slopes=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, rng_state=None):
        """Return ``(dq, dk, dv)`` in the input dtypes; dk/dv summed over GQA groups."""
        raise NotImplementedError

    # -- decoding with a KV cache ------------------------------------------------------------
    def kvcache_not_supported_reasons(self, spec: KVCacheSpec) -> list[str]:
        """Why this backend cannot run an :func:`flashcore.attention_with_kvcache` call."""
        r = self.not_supported_reasons(spec.attn)
        if r and r[0].startswith("not available"):
            return r
        if not self.supports_kvcache:
            r.append("KV-cache decoding is not supported")
        elif spec.fp8 and not self.supports_fp8_kvcache:
            r.append(f"{spec.cache_dtype} (FP8) caches are not supported")
        return r

    def forward_kvcache(self, spec: KVCacheSpec, q, k_cache, v_cache, k=None, v=None, *,
                        cache_seqlens, block_table=None, rotary_cos=None, rotary_sin=None,
                        alibi_slopes=None, cache_leftpad=None, k_descale=None, v_descale=None,
                        key_mask=None):
        """Append k, v (rotated) into the cache in place, attend. Return ``(out, lse)``.

        ``cache_seqlens`` is an int or an int32 array: the lengths before appending. An FP8
        cache (``spec.fp8``; nothing is appended then) stands for the values
        ``k_cache[..., hk, :] * k_descale[b, hk]`` (v likewise): ``k_descale``/``v_descale``
        None (1.0) or contiguous float32 arrays of shape exactly (batch, nheads_k) in the
        call's library (flashcore.api makes them so). ``key_mask``: None or bool
        (batch, capacity), key t of sequence b attended only where ``key_mask[b, t]``.
        """
        raise NotImplementedError(f"backend {self.name!r} has no KV-cache decoding")

    def __repr__(self):
        return f"<flashcore backend {self.name!r}>"


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def all_backends() -> dict[str, Backend]:
    return dict(_REGISTRY)


def get_backend(name: str) -> Backend:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"argument 'backend': expected one of {sorted(_REGISTRY)} or None, got {name!r}"
        ) from None


def choose(spec: AttentionSpec, backend: str | None, backward: bool = False) -> Backend:
    """The backend for this call: the named one, else the first that takes these arrays.

    Runs when a call is validated in full: for CuPy arrays and CUDA tensors, only the first
    call of a layout (later ones replay its launch plan, flashcore.kernels.plans).
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"argument 'backend': expected a backend name (str) or None, "
                        f"got {type(backend).__name__}")
    return _choose(spec, backend, backward)


def _choose(spec: AttentionSpec, backend: str | None, backward: bool) -> Backend:
    return _pick(backend, spec, "call", lambda b: b.not_supported_reasons(spec, backward))


def _pick(backend, attn, what, reasons_of) -> Backend:
    """The named backend if it has no reasons to refuse, else the first backend that takes
    ``attn.library`` arrays and has none; otherwise every backend's reasons in one error."""
    if backend is not None:
        b = get_backend(backend)
        reasons = reasons_of(b)
        if reasons:
            raise NotSupportedError(
                f"backend {b.name!r} cannot run this {what}:\n  - " + "\n  - ".join(reasons))
        return b
    tried = []
    for b in _REGISTRY.values():
        if attn.library not in b.libraries:
            continue
        reasons = reasons_of(b)
        if not reasons:
            return b
        tried.append((b.name, reasons))
    lines = [f"no flashcore backend can run this {what} ({attn.library} arrays, {attn.dtype}, "
             f"headdim {attn.headdim}, on {attn.device}):"]
    if not tried:
        lines.append(f"  no backend takes {attn.library} arrays")
    for name, reasons in tried:
        lines.append(f"  {name}: " + "; ".join(reasons))
    raise NotSupportedError("\n".join(lines))


def choose_kvcache(spec: KVCacheSpec, backend: str | None) -> Backend:
    """:func:`choose` for a KV-cache decoding call."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"argument 'backend': expected a backend name (str) or None, "
                        f"got {type(backend).__name__}")
    return _choose_kvcache(spec, backend)


def _choose_kvcache(spec: KVCacheSpec, backend: str | None) -> Backend:
    return _pick(backend, spec.attn, "KV-cache call", lambda b: b.kvcache_not_supported_reasons(spec))
