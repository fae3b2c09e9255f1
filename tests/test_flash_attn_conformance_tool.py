"""The flash-attn conformance runner (tests/diagnostics/flash_attn_conformance.py) on the CPU: its
shim package imports as flash-attn's test file imports it, its helpers compute what they claim,
and its summary counts what pytest ran. (The real run needs flash-attn's test file and a GPU.)"""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'flashcore[torch]')")

TOOL = Path(__file__).resolve().parent / "diagnostics" / "flash_attn_conformance.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("flash_attn_conformance", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def shim(tool, tmp_path_factory):
    folder = tool.write_shim(tmp_path_factory.mktemp("shim"))
    sys.path.insert(0, str(folder))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    yield folder
    sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def test_the_shim_provides_what_flash_attn_tests_import(shim):
    import flash_attn
    from flash_attn.bert_padding import pad_input, unpad_input  # noqa: F401
    from flash_attn.flash_attn_interface import USE_TRITON_ROCM, _get_block_size_n  # noqa: F401
    from flash_attn.layers.rotary import apply_rotary_emb  # noqa: F401
    import flashcore.flash_attn as ours
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
                 "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
        assert getattr(flash_attn, name) is getattr(ours, name)
    assert USE_TRITON_ROCM is False


def test_unpad_and_pad_are_inverse_and_differentiable(shim):
    from flash_attn.bert_padding import pad_input, unpad_input
    x = torch.randn(3, 5, 2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    rows, idx, cu, longest, used = unpad_input(x, mask)
    assert rows.shape == (8, 2, 4) and cu.tolist() == [0, 3, 8, 8] and longest == 5
    assert used.tolist() == [3, 5, 0] and cu.dtype == torch.int32
    back = pad_input(rows, idx, 3, 5)
    assert torch.equal(back, x * mask[..., None, None])
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].expand_as(x).float())


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_the_reference(shim, interleaved):
    from flash_attn.layers.rotary import apply_rotary_emb

    from flashcore.reference import apply_rotary
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 3, 32, generator=g, dtype=torch.float64)
    ang = torch.rand(20, 8, generator=g, dtype=torch.float64) * 6.28
    cos, sin = ang.cos(), ang.sin()
    offsets = torch.tensor([3, 9])
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    pos = (np.arange(6)[None, :] + offsets.numpy()[:, None])
    want = apply_rotary(x.numpy(), cos.numpy(), sin.numpy(), pos, interleaved)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    # varlen: the same rows packed, positions restarting per sequence
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    packed = apply_rotary_emb(x.reshape(12, 3, 32), cos, sin, interleaved=interleaved,
                              seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=6)
    np.testing.assert_allclose(packed.reshape(2, 6, 3, 32).numpy(), want, rtol=1e-6, atol=1e-6)


_FAKE_SUITE = '''
import pytest, torch
from flash_attn import flash_attn_func
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM
from flash_attn.layers.rotary import apply_rotary_emb

@pytest.mark.parametrize("causal", [False, True])
def test_runs(causal):
    q = torch.randn(1, 7, 2, 8)
    out = flash_attn_func(q, q, q, causal=causal)
    assert out.shape == q.shape

def test_fails_with_a_number():
    assert 17 == 18, "mismatch of 17 elements"

@pytest.mark.skip(reason="not on this machine (3 GPUs missing)")
def test_skipped():
    pass
'''


def test_the_runner_counts_and_groups_what_pytest_ran(tmp_path):
    suite = tmp_path / "test_fake_flash_attn.py"
    suite.write_text(_FAKE_SUITE)
    r = subprocess.run([sys.executable, str(TOOL), str(suite), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SUMMARY 2 passed, 1 failed, 1 skipped (4 of 4 cases)" in r.stdout, r.stdout[-3000:]
    assert "mismatch of N elements" in r.stdout
    assert "not on this machine (N GPUs missing)" in r.stdout
    assert (tmp_path / "out" / "summary.json").is_file()
    r = subprocess.run([sys.executable, str(TOOL), str(suite), "--sample", "2", "--seed", "3"],
                       capture_output=True, text=True, timeout=600)
    assert "(2 of 4 cases)" in r.stdout, r.stdout[-3000:]


_NEEDS_A_GPU_AT_IMPORT = '''
import pytest, torch
CAP = torch.cuda.get_device_capability("cuda")

@pytest.mark.parametrize("n", range(6))
def test_case(n):
    assert CAP == (9, 0) and n != 4, "case four fails"
'''


def test_a_sample_written_on_a_machine_without_a_gpu_runs_as_written(tmp_path):
    suite = tmp_path / "test_fake_flash_attn.py"
    suite.write_text(_NEEDS_A_GPU_AT_IMPORT)
    cases = tmp_path / "cases.txt"
    base = [sys.executable, str(TOOL), str(suite)]
    # collection imports the file: without a GPU it needs the capability answered
    r = subprocess.run(base + ["--sample", "4", "--seed", "1", "--write-cases", str(cases),
                               "--assume-capability", "9.0"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = cases.read_text().splitlines()
    assert lines[0].startswith("# 4 of 6 cases (seed 1)") and len(lines) == 5
    assert all(line.startswith("test_case[") for line in lines[1:])
    # the run answers nothing for the device: here (no GPU) every chosen case errors at import
    r = subprocess.run(base + ["--cases", str(cases)], capture_output=True, text=True, timeout=600)
    assert "(4 of 6 cases)" in r.stdout, r.stdout[-3000:]
    if not torch.cuda.is_available():
        assert "SUMMARY 0 passed" in r.stdout, r.stdout[-3000:]
    for bad, named in ((["--cases", str(cases), "--sample", "2"], "'--cases'"),
                       (["--write-cases", str(cases), "--assume-capability", "nine"],
                        "'--assume-capability'"),
                       (["--assume-capability", "9.0"], "'--assume-capability'")):
        r = subprocess.run(base + bad, capture_output=True, text=True, timeout=600)
        assert r.returncode != 0 and named in r.stderr, r.stderr[-2000:]


# Four parametrize decorators of 12 values: 20,736 cases, of which a handful are chosen. An id
# with a "-" of its own ("y-z") and a value that is a prefix of another ("1", "11") are the
# cases a prefix match could get wrong.
_WIDE_SUITE = '''
import pytest

V = [str(i) for i in range(11)] + ["y-z"]

@pytest.mark.parametrize("d", V)
@pytest.mark.parametrize("c", V)
@pytest.mark.parametrize("b", V)
@pytest.mark.parametrize("a", V)
def test_wide(a, b, c, d):
    assert (a, d) != ("3", "y-z"), "chosen to fail"

@pytest.mark.parametrize("n", range(1000))
def test_none_chosen(n):
    pass
'''

_WIDE_CHOSEN = ["test_wide[1-1-10-y-z]", "test_wide[10-1-1-1]", "test_wide[y-z-0-y-z-5]",
                "test_wide[3-2-1-y-z]", "test_wide[1-1-1-1]"]


def test_only_the_chosen_cases_are_ever_generated(tool, tmp_path):
    suite = tmp_path / "test_fake_flash_attn.py"
    suite.write_text(_WIDE_SUITE)
    cases = tmp_path / "cases.txt"
    cases.write_text("# 6 of 21736 cases (seed 0) from test_fake_flash_attn.py\n" +
                     "\n".join(_WIDE_CHOSEN + ["test_wide[1-1-1-11]"]) + "\n")
    base = [sys.executable, str(TOOL), str(suite), "--cases", str(cases)]
    r = subprocess.run(base + ["--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "SUMMARY 4 passed, 1 failed, 0 skipped, 1 not run (6 of 21736 cases)" in r.stdout, \
        r.stdout[-3000:]
    assert "chosen to fail" in r.stdout and "not collected" in r.stdout
    log = (tmp_path / "out" / "pytest.log").read_text()
    # Nothing left over to deselect: the other 20,731 cases and test_none_chosen were never
    # made into items ...
    assert "deselected" not in log and "4 passed" in log, log[-2000:]
    # ... nor built as cases: after each decorator only partial cases that begin a chosen id
    # survive (at most 5 of them) to be multiplied by the next decorator's 12 values.
    events = tool.read_events(tmp_path / "out" / "events.jsonl")
    generated = {e["function"]: e for e in events if e["event"] == "generated"}
    assert set(generated) == {"test_wide"}
    assert generated["test_wide"]["kept"] == 5
    assert generated["test_wide"]["built"] <= 12 + 3 * 5 * 12, generated
    # --check-cases collects the same way and names what the file lacks
    r = subprocess.run(base + ["--check-cases"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "collected 5 of the 6 cases" in r.stdout, r.stdout[-2000:]
    assert "not in the test file: test_wide[1-1-1-11]" in r.stdout


_BAD_SUITE = '''
import os, time, pytest

@pytest.mark.parametrize("n", range(6))
def test_ok(n):
    assert n != 2, "two fails"

def test_hangs():
    time.sleep(600)

def test_crashes():
    os._exit(7)
'''


@pytest.mark.parametrize("xdist", [False, True], ids=["one process", "xdist"])
def test_a_hang_or_a_crash_still_leaves_a_summary(tmp_path, xdist):
    if xdist:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    suite = tmp_path / "test_fake_flash_attn.py"
    suite.write_text(_BAD_SUITE)
    cases = tmp_path / "cases.txt"
    cases.write_text("\n".join(["test_hangs", "test_crashes"] +
                               [f"test_ok[{n}]" for n in range(6)]) + "\n")
    r = subprocess.run([sys.executable, str(TOOL), str(suite), "--cases", str(cases),
                        "--case-timeout", "3", "--timeout", "300", "--out", str(tmp_path / "out"),
                        "--pytest-args", *(["-n", "2"] if xdist else [])],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "ran past the case timeout (N s): its process was ended" in r.stdout, r.stdout[-3000:]
    if xdist:
        # each ended worker is replaced: every other case still runs
        assert "SUMMARY 5 passed, 3 failed, 0 skipped (8 of 8 cases)" in r.stdout, r.stdout
        assert "worker 'gwN' crashed while running 'CASE'" in r.stdout
    else:
        # the run (in the file's order) ends with the hung case; what finished before it is
        # still summarised, and the case after it is not run
        assert "SUMMARY 5 passed, 2 failed, 0 skipped, 1 not run (8 of 8 cases)" in r.stdout, \
            r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["counts"]["failed"] == (3 if xdist else 2)
    assert (tmp_path / "out" / "events.jsonl.stacks.txt").read_text().count("ran past 3 s") == 1


_GREEDY_SUITE = '''
import pytest

class OutOfMemoryError(RuntimeError):
    pass

@pytest.mark.parametrize("n", range(4))
def test_big(n, request):
    # out of memory only in an xdist worker (beside other workers), as flash-attn's 128k-key
    # references are; a worker's config has workerinput (the environment would not do: an
    # outer xdist run's variables reach this process too)
    if n % 2 and hasattr(request.config, "workerinput"):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
'''


def test_cases_out_of_memory_beside_other_workers_are_run_again_alone(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed")
    suite = tmp_path / "test_fake_flash_attn.py"
    suite.write_text(_GREEDY_SUITE)
    base = [sys.executable, str(TOOL), str(suite), "--timeout", "300"]
    r = subprocess.run(base + ["--pytest-args", "-n", "2"], capture_output=True, text=True,
                       timeout=600)
    assert "SUMMARY 2 passed, 2 failed, 0 skipped (4 of 4 cases)" in r.stdout, r.stdout[-3000:]
    assert "CUDA out of memory" in r.stdout
    r = subprocess.run(base + ["--rerun-oom", "--out", str(tmp_path / "out"), "--pytest-args",
                               "-n", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "SUMMARY 4 passed, 0 failed, 0 skipped (4 of 4 cases)" in r.stdout, r.stdout[-3000:]
    assert "2 cases that ran out of GPU memory beside other workers were run again" in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["rerun_out_of_memory"] == 2
    listed = (tmp_path / "out" / "rerun_cases.txt").read_text().split("\n")
    assert listed[1:3] == ["test_big[1]", "test_big[3]"], listed


def test_the_rerun_drops_only_the_worker_count():
    from importlib import util
    spec = util.spec_from_file_location("conformance", TOOL)
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._without_workers(["-n", "8", "-x", "-n4", "--numprocesses=3", "--tb=long",
                                 "--numprocesses", "2", "-k", "n"]) == ["-x", "--tb=long", "-k", "n"]
