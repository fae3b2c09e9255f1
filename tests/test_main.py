"""``python -m flashcore`` (the README's main command) on this machine: every available
backend self-checks and benchmarks, whatever is installed (torch's CPU build included, whose
CPU tensors run on the NumPy backend), and a type a backend cannot take here is skipped with a
one-line reason, never a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from flashcore import __main__ as cli
from flashcore import available_backends


def test_main_runs_every_available_backend(capsys):
    rc = cli.main(["--seqlen", "128", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out
    check, _, bench = out.partition("\nbenchmark:")
    for name, why in available_backends().items():
        if why is None:
            assert f"  {name:6s} " in check and "PASS" in check, f"no self-check of {name}"
            assert any(line.split()[:1] == [name] for line in bench.splitlines()[2:]), \
                f"no benchmark row for {name}\n{out}"


def test_cpu_backends_default_to_float32():
    for name, why in available_backends().items():
        if why is None and not cli._on_gpu(name):
            assert cli._dtypes(name, None, True) == ["float32"]
            assert cli._dtypes(name, None, False) == ["float32"]
    if available_backends().get("torch") is None and not cli._on_gpu("torch"):
        assert cli._dtypes("torch", "float16", True) == ["float16"]     # runs what was asked
        assert cli._why_not("torch", "float16") is None
        assert "bfloat16" in cli._why_not("torch", "bfloat16")        # or says why not


def _run(*args, prelude=""):
    """``python -m flashcore ARGS`` in a subprocess (``prelude``: Python run before main)."""
    code = f"import sys\n{prelude}\nfrom flashcore.__main__ import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "--seqlen", "64", "--repeats", "1", *args],
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def _rows(out, dtype):
    """The backends of the benchmark rows of ``dtype`` (skipped ones excluded)."""
    bench = out.partition("\nbenchmark:")[2].splitlines()[2:]
    return [line.split()[0] for line in bench if line.split()[1:2] == [dtype]
            and "skipped" not in line]


def test_bfloat16_on_the_cpu_runs_the_numpy_backend_without_a_traceback():
    """NumPy has no bfloat16 of its own: the arrays are ml_dtypes' (imported, not assumed to
    be loaded by another library), the NumPy backend runs them, torch's CPU tensors are
    skipped with the reason."""
    avail = available_backends()
    if avail.get("cupy") is None or (avail.get("torch") is None and cli._on_gpu("torch")):
        pytest.skip("a GPU is present: bfloat16 runs there")
    pytest.importorskip("ml_dtypes")
    # cupy's import loads ml_dtypes when both are installed, which hid the bug: keep it out
    rc, out, err = _run("--dtype", "bfloat16", prelude="sys.modules['cupy'] = None")
    assert rc == 0, out + err
    assert "Traceback" not in err, err
    assert "numpy  bfloat16 causal=False PASS" in out, out
    assert "numpy" in _rows(out, "bfloat16"), out
    if available_backends().get("torch") is None:
        assert "torch    bfloat16  skipped: " in out, out


def test_bfloat16_without_ml_dtypes_is_one_clear_line():
    rc, out, err = _run("--dtype", "bfloat16", "--backend", "numpy",
                        prelude="sys.modules['ml_dtypes'] = None; sys.modules['cupy'] = None")
    assert rc == 2, out + err
    assert "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: nothing can run bfloat16 here (numpy: bfloat16 NumPy/CuPy arrays need "
        "ml_dtypes (pip install ml_dtypes))"], err


def test_torch_cpu_runs_float16_when_asked():
    if available_backends().get("torch") is not None:
        pytest.skip(f"torch backend unavailable: {available_backends()['torch']}")
    if cli._on_gpu("torch"):
        pytest.skip("torch sees a GPU")
    rc, out, err = _run("--dtype", "float16", "--backend", "torch")
    assert rc == 0, out + err
    assert "torch  float16  causal=True  PASS" in out, out
    assert _rows(out, "float16") == ["torch"], out
    assert _rows(out, "float32") == [], out


def test_torch_cpu_refuses_bfloat16_clearly():
    if available_backends().get("torch") is not None or cli._on_gpu("torch"):
        pytest.skip("needs torch without a GPU")
    rc, out, err = _run("--dtype", "bfloat16", "--backend", "torch")
    assert rc == 2, out + err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "cannot view torch's bfloat16 CPU storage" in err, err


def test_module_entry_point_exits_zero():
    r = subprocess.run([sys.executable, "-m", "flashcore", "--seqlen", "64", "--repeats", "1",
                        "--no-check"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
