"""The maintained diagnostics (tests/diagnostics/) are scripts that run on a GPU machine only,
where a syntax error costs a device call: each of them must at least compile here."""
from __future__ import annotations

import pathlib
import py_compile

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parent / "diagnostics").glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_diagnostic_script_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)
