"""Every kernel source compiles under NVRTC for sm_80 and sm_90a, with the loader and options
the runtime uses, on a machine with no GPU.

Needs CuPy and an NVRTC library (``pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12``). Where
they are missing the tests skip with that reason, unless FLASHCORE_REQUIRE_NVRTC=1 (as in CI),
which turns the skip into a failure.

Each template path is covered: every head-dim tile with both dtypes and every flag, sampled
across combinations (a deterministic, stratified sample) so that CI stays within minutes.
"""
from __future__ import annotations

import os
import re

import pytest

from flashcore import jit

ARCHS = ["sm_80", "sm_90a"]


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # ImportError, or the NVRTC shared library missing
        msg = f"NVRTC unavailable ({type(e).__name__}: {e})"
        if os.environ.get("FLASHCORE_REQUIRE_NVRTC") == "1":
            pytest.fail(msg + " but FLASHCORE_REQUIRE_NVRTC=1")
        pytest.skip(msg)


def _portable(source):
    """The instantiations of a portable source (every architecture), from the one table."""
    from flashcore.kernels import catalog
    return [n for src, targets, fn in catalog.TABLE if src == source and targets == catalog.ANY
            for n in fn()]


def _sm90_sources():
    """Hopper-only sources (wgmma): compiled for sm_90a alone. (source, instantiations)."""
    from flashcore.kernels import catalog
    return [(src, fn) for src, targets, fn in catalog.TABLE
            if targets == catalog.HOPPER and src.endswith("_sm90.cu")]


def _sample(names, budget):
    """Stratified sample: every distinct template argument value appears at least once."""
    if len(names) <= budget:
        return list(names)
    args = [tuple(a.strip() for a in re.search(r"<(.*)>", n).group(1).split(",")) for n in names]
    chosen, seen = [], set()
    for n, a in zip(names, args):
        new = {(i, x) for i, x in enumerate(a)} - seen
        kern = n.split("<")[0]
        if new or (kern, "kernel") not in seen:
            chosen.append(n)
            seen |= new | {(kern, "kernel")}
    step = max(1, len(names) // max(1, budget - len(chosen)))
    for n in names[::step]:
        if n not in chosen and len(chosen) < budget:
            chosen.append(n)
    return chosen


BUDGET = int(os.environ.get("FLASHCORE_COMPILE_BUDGET", "48"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", ["flash_fwd.cu", "flash_bwd.cu", "flash_decode.cu"])
def test_kernels_compile(source, arch):
    _nvrtc_or_skip()
    names = _portable(source)
    assert names, f"{source}: no instantiations listed"
    sample = _sample(names, BUDGET)
    # one NVRTC program per chunk of names: shared parsing, bounded memory
    for i in range(0, len(sample), 8):
        chunk = sample[i:i + 8]
        cubin, log = jit.compile_check(source, chunk, arch, want_log=True)
        assert len(cubin) > 0
        # no kernel may use a local-memory stack frame beyond a small bound
        for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log):
            assert int(m.group(2)) <= 2048, f"{source} {arch}: heavy spills\n{log}"


@pytest.mark.parametrize("source", ["flash_fwd_sm90.cu", "flash_bwd_sm90.cu"])
def test_hopper_kernels_compile(source):
    _nvrtc_or_skip()
    names = dict(_sm90_sources())[source]()
    assert names, f"{source}: no instantiations listed"
    cubin, log = jit.compile_check(source, names, "sm_90a", want_log=True)
    assert len(cubin) > 0
    # No spills, but a few words for the dropout variants (a Philox call's registers on top of
    # a full kernel): 8 bytes seen in the forward; the warp-specialised dK/dV kernel, whose
    # consumer threads have 240 registers where the cp.async one takes 244, 36-44 bytes under
    # NVRTC 12 (none under 13); and its head-dim-64 instantiations with dropout (128-query
    # steps: S^T and dP^T of 128 queries beside dK and dV, and a Philox call), 44-88 bytes
    # under NVRTC 12, kept as measured faster than the spill-free cp.async kernel (run 47 of
    # the performance log: 1.16-1.30x; without dropout none since the steps without a mask
    # run a copy of their elementwise code without it, session 33); the FP8 forward with
    # softcap at head dim 256, a word a tile; the windowed varlen forward's producer (paged
    # calls' copy loop), a word or two a key block (_spill_allowance).
    spills = _spills_by_kernel(log)
    assert len(spills) == len(names), log
    for mangled, stores in spills.items():
        assert stores <= _spill_allowance(mangled), f"{source}: spills in {mangled}\n{log}"
    # ptxas serialises wgmma (a large slowdown) when it cannot prove the pipeline safe: say so
    assert "serializ" not in log.lower(), f"{source}: wgmma serialised\n{log}"
    # the fault locator's alternative descriptor convention compiles too
    cubin, _ = jit.compile_check(source, names[:1], "sm_90a", ("-DFC_WGMMA_MN_SWAP",))
    assert len(cubin) > 0


def test_forward_timeline_compiles():
    """The forward's timeline (cuda/diag_timeline.cuh, -DFC_DIAG_TIMELINE) compiles into the
    16-bit and FP8 Hopper forwards and puts the array the diagnostic reads into the module
    (tests/diagnostics/probe_timeline.py); without the define there is no such array. The
    warp-specialised dK/dV kernel likewise."""
    _nvrtc_or_skip()
    from flashcore.kernels import forward
    from flashcore.kernels import backward
    bwd = [n for n in backward.sm90_instantiations()
           if n.startswith("flash_bwd_dkdv_sm90_ws_kernel<fc_bf16, 128")][:1]
    assert bwd
    sources = [("flash_fwd_sm90.cu", forward.sm90_ws_kernel_name("bfloat16", 128, False)),
               ("flash_fwd_sm90.cu", forward.fp8_kernel_name("bfloat16", 128, False)),
               ("flash_bwd_sm90.cu", bwd[0])]
    for source, name in sources:
        cubin, _ = jit.compile_check(source, [name], "sm_90a", ("-DFC_DIAG_TIMELINE",))
        assert b"fc_diag_tl" in cubin, name
        cubin, _ = jit.compile_check(source, [name], "sm_90a")
        assert b"fc_diag_tl" not in cubin, name


def _spill_allowance(mangled: str) -> int:
    """Spill bytes allowed for a Hopper kernel, from its mangled template arguments."""
    bools = re.findall(r"Lb([01])E", mangled)
    if mangled.startswith("_Z25flash_fwd_sm90_fp8_kernel"):
        # (the FP8 forward has no dropout; with softcap, its fifth flag, at head dim 256 one
        # word of the tile's state is kept on the stack from the tile's start to its epilogue:
        # 4 bytes under NVRTC 12)
        return 8 if len(bools) == 5 and bools[4] == "1" and "Li256E" in mangled else 0
    if not bools:
        return 0                             # (no flags)
    if mangled.startswith("_Z29flash_bwd_dkdv_sm90_ws_kernel") and "Li64ELi128E" in mangled:
        return 96 if bools[1] == "1" else 0  # (head dim 64, 128-query steps, dropout)
    if mangled.startswith(("_Z24flash_fwd_sm90_ws_kernel", "_Z29flash_bwd_dkdv_sm90_ws_kernel",
                           "_Z31flash_bwd_dkdv_sm90_d256_kernel", "_Z26flash_bwd_dkdv_sm90_kernel")):
        dropout = bools[1] == "1"            # <.., local, dropout, ..>: stages and ping-pong,
    else:                                    # or the tile-ordered dQ, follow
        dropout = bools[-1] == "1"           # the last template argument
    if mangled.startswith("_Z24flash_fwd_sm90_ws_kernel") and bools[0] == "1" \
            and bools[4] == "1" and not dropout:
        # (the windowed varlen forward, which paged calls take: its producer's unrolled copy
        # loop for pages that do not hold whole key blocks keeps one or two address words on
        # the stack (nvcc 13: 4-8 bytes), reloaded once a key block; the consumers do not
        # spill)
        return 8
    if not dropout:
        return 0
    return 64 if mangled.startswith("_Z29flash_bwd_dkdv_sm90_ws_kernel") else 16


def _spills_by_kernel(log: str) -> dict:
    """ptxas' spill stores per compiled entry (mangled name) of a verbose log."""
    out, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(_Z\w+)", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and cur is not None:
            out[cur] = int(m.group(2))
    return out


def test_fp8_forward_kernels_are_listed_for_the_hopper_compile():
    """The FP8 forward (flash_fwd_sm90_fp8_kernel) is compiled for sm_90a with the rest of the
    Hopper forward, every instantiation, with no spills (test_hopper_kernels_compile)."""
    from flashcore.kernels import forward
    names = forward.fp8_instantiations()
    assert len(names) == 96 and set(names) <= set(forward.sm90_instantiations())
    assert {n.split("<")[1].split(",")[1].strip() for n in names} == {"128", "256"}


def test_decode_cluster_kernels_compile():
    """The split kernels that merge inside a thread-block cluster (sm_90a only): a stratified
    sample over every flag and every cluster size, with no local-memory frame at all."""
    _nvrtc_or_skip()
    from flashcore.kernels import decode
    from flashcore.kernels import catalog
    names = [n for src, targets, fn in catalog.TABLE
             if src == "flash_decode.cu" and targets == catalog.HOPPER for n in fn()]
    assert names and names == decode.sm90_instantiations()
    sample = _sample(names, 24)
    for i in range(0, len(sample), 8):
        cubin, log = jit.compile_check("flash_decode.cu", sample[i:i + 8], "sm_90a",
                                       want_log=True)
        assert len(cubin) > 0
        frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
        assert len(frames) == len(sample[i:i + 8])
        assert all(f == ("0", "0") for f in frames), f"stack frame or spills\n{log}"


def test_every_source_file_is_covered():
    """Every kernel source is a row of the one table (flashcore.kernels.catalog) and compiled
    by a test above; every header is included by one."""
    from flashcore.kernels import catalog
    covered = {s for s, _, _ in catalog.TABLE}
    assert covered == {"flash_fwd.cu", "flash_bwd.cu", "flash_decode.cu"} | {
        s for s, _ in _sm90_sources()}
    includes = set()
    for s in covered:
        includes |= set(re.findall(r'#include "([^"]+)"', (jit.cuda_dir() / s).read_text()))
    for p in jit.cuda_dir().glob("*.cu*"):
        assert p.name in covered or p.name in includes or any(
            p.name in (jit.cuda_dir() / i).read_text() for i in includes), \
            f"{p.name} is compiled by no test"


def test_fingerprint_changes_with_sources(tmp_path, monkeypatch):
    fp = jit.source_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert fp in jit._code_for("flash_fwd.cu")
    assert any(fp in o for o in jit.compile_options("sm_90a"))


def test_params_dtype_matches_header():
    from flashcore.kernels.params import params_dtype
    dt = params_dtype()
    text = (jit.cuda_dir() / "flash_params.cuh").read_text()
    assert dt.itemsize % 8 == 0
    for f in ("q", "lse", "cu_seqlens_q", "q_batch_stride", "window_left", "softcap"):
        assert f in dt.names and f in text
