"""flash-attn's own test suite, run unchanged against ``flashcore.flash_attn``.

    python tests/diagnostics/flash_attn_conformance.py PATH/TO/test_flash_attn.py
        [--sample N] [--seed S] [--out DIR] [--timeout SECONDS] [-k EXPR]
        [--write-cases FILE [--assume-capability 9.0] | --cases FILE] [--pytest-args ...]

PATH is flash-attn 2's ``tests/test_flash_attn.py`` (public; it is not copied into this
repository and nothing is fetched here: give the path of a copy you have). The script builds,
in a temporary folder, a ``flash_attn`` package that re-exports :mod:`flashcore.flash_attn`
plus the test helpers the file imports, written here against their documented behaviour:
``flash_attn.bert_padding`` (``unpad_input``, ``pad_input``), ``flash_attn.layers.rotary``
(``apply_rotary_emb``) and ``flash_attn.flash_attn_interface`` (``_get_block_size_n``,
``USE_TRITON_ROCM``). It collects the file's cases, runs all of them or a seeded random sample
of ``--sample`` of them with pytest (the file needs a CUDA GPU), and prints passed / failed /
skipped, with the failures and skips grouped by reason (the first line of each message, its
numbers replaced by N). ``--out`` keeps the junit XML and the summary as JSON.

Collecting the whole file (about half a million cases) takes minutes of CPU. To spend none of
a GPU machine's time on it, collect and sample elsewhere: ``--write-cases FILE`` writes the
chosen case names and stops; ``--assume-capability 9.0`` makes that collection work on a
machine without a GPU (the file asks for the device's compute capability when it is imported;
the shim answers instead); ``--cases FILE`` then runs exactly those cases, collecting nothing.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SHIM = {
    "flash_attn/__init__.py": '''
        """flash-attn's names, served by flashcore (the conformance run's shim)."""
        from flashcore.flash_attn import *  # noqa: F401,F403
        from flashcore.flash_attn import (  # noqa: F401
            flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
            flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
            flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
        ''',
    "flash_attn/flash_attn_interface.py": '''
        from flashcore.flash_attn import *  # noqa: F401,F403

        USE_TRITON_ROCM = False


        def _get_block_size_n(device, head_dim, is_dropout, is_causal):
            """The key-block width of flash-attn's returned attention probabilities (the
            tests undo its blocked layout with it); flashcore returns them unblocked."""
            return 128
        ''',
    "flash_attn/bert_padding.py": '''
        """Unpadding helpers of flash-attn's tests, on torch indexing (differentiable)."""
        import torch
        import torch.nn.functional as F


        def unpad_input(hidden_states, attention_mask, unused_mask=None):
            """(batch, seqlen, ...) and a (batch, seqlen) mask -> the kept rows (total, ...),
            their flat indices, int32 cu_seqlens, the longest length (an int), and the
            per-sequence count of ``attention_mask`` alone (``unused_mask`` rows are kept too,
            counted in cu_seqlens but not in that count)."""
            keep = attention_mask if unused_mask is None else attention_mask + unused_mask
            lens = keep.sum(dim=-1, dtype=torch.int32)
            used = attention_mask.sum(dim=-1, dtype=torch.int32)
            indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
            cu = F.pad(torch.cumsum(lens, dim=0, dtype=torch.int32), (1, 0))
            flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
            return flat[indices], indices, cu, int(lens.max().item()), used


        def pad_input(hidden_states, indices, batch, seqlen):
            """The inverse: rows (total, ...) back to (batch, seqlen, ...), zeros elsewhere."""
            out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
            out = out.index_copy(0, indices, hidden_states)
            return out.reshape(batch, seqlen, *hidden_states.shape[1:])
        ''',
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": '''
        """Rotary embedding as flash-attn's tests use it (fp32 arithmetic, torch ops)."""
        import torch


        def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                             cu_seqlens=None, max_seqlen=None):
            """x (batch, seqlen, heads, headdim), or (total, heads, headdim) with cu_seqlens;
            cos, sin (seqlen_ro, rotary_dim / 2). The first rotary_dim channels of row t of
            sequence b are rotated at position seqlen_offsets[b] + t (an int or (batch,)
            tensor): pairs (i, i + rotary_dim / 2), or (2i, 2i + 1) when interleaved."""
            half = cos.shape[-1]
            rd = 2 * half
            if cu_seqlens is None:
                b, s = x.shape[0], x.shape[1]
                pos = torch.arange(s, device=x.device)[None, :].expand(b, s)
                off = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1, 1)
                pos = pos + off
            else:
                cu = cu_seqlens.long()
                t = torch.arange(x.shape[0], device=x.device)
                seq = torch.searchsorted(cu[1:], t, right=True)
                off = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1)
                off = off.expand(len(cu) - 1) if off.numel() == 1 else off
                pos = t - cu[seq] + off[seq]
            c = cos.float()[pos].unsqueeze(-2)
            s_ = sin.float()[pos].unsqueeze(-2)
            xf = x[..., :rd].float()
            if interleaved:
                x1, x2 = xf[..., 0::2], xf[..., 1::2]
            else:
                x1, x2 = xf[..., :half], xf[..., half:]
            o1, o2 = x1 * c - x2 * s_, x2 * c + x1 * s_
            rot = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else \\
                torch.cat((o1, o2), dim=-1)
            out = x if inplace else x.clone()
            out[..., :rd] = rot.to(x.dtype)
            return out
        ''',
}


_ASSUME_CAPABILITY = '''
    """Answers torch.cuda.get_device_capability for collection on a machine without a GPU
    (written only with --assume-capability; collection imports the file, nothing runs)."""
    import torch

    torch.cuda.get_device_capability = lambda *args, **kwargs: ({major}, {minor})
    '''


def write_shim(folder: Path, capability: str | None = None) -> Path:
    texts = dict(_SHIM)
    if capability:
        major, minor = (int(x) for x in capability.split("."))
        texts["sitecustomize.py"] = _ASSUME_CAPABILITY.format(major=major, minor=minor)
    for rel, text in texts.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return folder


def _env(shim: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def read_cases(path: Path) -> tuple[list[str], int | None, int | None]:
    """The case names in a --write-cases file, and the collected count and seed of its header."""
    names, collected, seed = [], None, None
    for line in path.read_text().splitlines():
        head = re.match(r"#\s*(\d+) of (\d+) cases \(seed (-?\d+)\)", line)
        if head:
            collected, seed = int(head.group(2)), int(head.group(3))
        elif line.strip() and not line.startswith("#"):
            names.append(line.strip())
    if not names:
        raise SystemExit(f"argument '--cases': no case names in {path}")
    return names, collected, seed


def collect(test_file: Path, shim: Path, keyword: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           str(test_file)] + (["-k", keyword] if keyword else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(shim), cwd=test_file.parent)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no test collected from {test_file}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return ids


def _reason(text: str) -> str:
    first = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "(no message)")
    first = re.sub(r"0x[0-9a-fA-F]+", "0xN", first)
    first = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", first)
    return first[:160]


def summarise(junit: Path) -> dict:
    """Counts and reasons from a junit XML file."""
    counts = collections.Counter()
    reasons = {"failed": collections.Counter(), "skipped": collections.Counter()}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("name"):      # the placeholder an interrupted run leaves
            continue
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            el = kinds.get("failure", kinds.get("error"))
            counts["failed"] += 1
            reasons["failed"][_reason(el.get("message") or el.text)] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reasons["skipped"][_reason(kinds["skipped"].get("message"))] += 1
        else:
            counts["passed"] += 1
    return {"counts": dict(counts),
            "reasons": {k: v.most_common() for k, v in reasons.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test_file", type=Path, help="flash-attn's tests/test_flash_attn.py")
    p.add_argument("--sample", type=int, default=0, help="run a random sample of N cases (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="keep junit.xml and summary.json here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds for the pytest run")
    p.add_argument("-k", dest="keyword", help="pytest -k expression applied at collection")
    p.add_argument("--write-cases", type=Path, metavar="FILE",
                   help="collect and sample, write the chosen case names to FILE, run nothing")
    p.add_argument("--cases", type=Path, metavar="FILE",
                   help="run the cases named in FILE (from --write-cases), collecting nothing")
    p.add_argument("--assume-capability", metavar="MAJOR.MINOR",
                   help="collect on a machine without a GPU, as if its capability were this")
    p.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                   help="extra pytest arguments (e.g. -n 8 with pytest-xdist)")
    a = p.parse_args(argv)
    if not a.test_file.is_file():
        raise SystemExit(f"argument 'test_file': no such file {a.test_file}")
    if a.cases and (a.write_cases or a.sample or a.keyword):
        raise SystemExit("argument '--cases': runs a written sample; --write-cases, --sample "
                         "and -k belong to the run that wrote it")
    if a.assume_capability and not re.fullmatch(r"\d+\.\d+", a.assume_capability):
        raise SystemExit(f"argument '--assume-capability': expected MAJOR.MINOR such as 9.0, "
                         f"got {a.assume_capability!r}")
    if a.assume_capability and not a.write_cases:
        raise SystemExit("argument '--assume-capability': only for collection (--write-cases); "
                         "the cases themselves need the GPU")
    with tempfile.TemporaryDirectory(prefix="flash_attn_conformance_") as tmp:
        tmp = Path(tmp)
        work = tmp / "tests"
        work.mkdir()
        test_file = work / a.test_file.name
        shutil.copyfile(a.test_file, test_file)
        if a.cases:
            names, collected, seed = read_cases(a.cases)
            chosen = [f"{test_file.name}::{n}" for n in names]
            ids_count, a.seed = collected or len(chosen), seed if seed is not None else a.seed
        else:
            ids = collect(test_file, write_shim(tmp / "collect", a.assume_capability), a.keyword)
            chosen = ids if not a.sample or a.sample >= len(ids) else \
                sorted(random.Random(a.seed).sample(ids, a.sample), key=ids.index)
            ids_count = len(ids)
        if a.write_cases:
            a.write_cases.write_text(f"# {len(chosen)} of {ids_count} cases (seed {a.seed}) from "
                                     f"{a.test_file.name}\n" +
                                     "\n".join(c.split("::", 1)[1] for c in chosen) + "\n")
            print(f"# wrote {len(chosen)} of {ids_count} case names to {a.write_cases}")
            return 0
        shim = write_shim(tmp / "shim")
        junit = tmp / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-o", "junit_family=xunit1", *a.pytest_args, *chosen]
        print(f"# {len(chosen)} of {ids_count} cases (seed {a.seed}) from {a.test_file}", flush=True)
        proc = subprocess.Popen(cmd, env=_env(shim), cwd=work)
        try:
            proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            # An interrupted pytest still writes its junit report of the cases that finished.
            print(f"# the pytest run passed its {a.timeout} s limit: interrupted, summarising "
                  f"what finished", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not junit.is_file():
            raise SystemExit("pytest wrote no junit report")
        summary = summarise(junit)
        summary.update(collected=ids_count, run=len(chosen), seed=a.seed)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(junit, a.out / "junit.xml")
            (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    c = summary["counts"]
    print(f"SUMMARY {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
          f"{c.get('skipped', 0)} skipped ({summary['run']} of {summary['collected']} cases)")
    for kind in ("failed", "skipped"):
        for reason, n in summary["reasons"][kind][:25]:
            print(f"  {kind:7s} {n:6d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
