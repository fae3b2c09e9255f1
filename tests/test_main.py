"""``python -m flashcore`` (the README's main command) on this machine: every available
backend self-checks and benchmarks, whatever is installed (torch's CPU build included, whose
CPU tensors run on the NumPy backend in float32)."""
from __future__ import annotations

import subprocess
import sys

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
        assert cli._dtypes("torch", "bfloat16", True) == ["float32"]


def test_module_entry_point_exits_zero():
    r = subprocess.run([sys.executable, "-m", "flashcore", "--seqlen", "64", "--repeats", "1",
                        "--no-check"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
