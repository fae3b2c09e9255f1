"""flash-attn's own test suite, run unchanged against ``flashcore.flash_attn``.

    python tests/diagnostics/flash_attn_conformance.py PATH/TO/test_flash_attn.py
        [--sample N] [--seed S] [--out DIR] [--timeout SECONDS] [--case-timeout SECONDS]
        [-k EXPR] [--write-cases FILE [--assume-capability 9.0]
        | --cases FILE [--check-cases [--assume-capability 9.0]]] [--pytest-args ...]

PATH is flash-attn 2's ``tests/test_flash_attn.py`` (public; it is not copied into this
repository and nothing is fetched here: give the path of a copy you have). The script builds,
in a temporary folder, a ``flash_attn`` package that re-exports :mod:`flashcore.flash_attn`
plus the test helpers the file imports, written here against their documented behaviour:
``flash_attn.bert_padding`` (``unpad_input``, ``pad_input``), ``flash_attn.layers.rotary``
(``apply_rotary_emb``) and ``flash_attn.flash_attn_interface`` (``_get_block_size_n``,
``USE_TRITON_ROCM``). It collects the file's cases, runs all of them or a seeded random sample
of ``--sample`` of them with pytest (the file needs a CUDA GPU), and prints passed / failed /
skipped / not run, with the failures and skips grouped by reason (the first line of each
message, its numbers replaced by N). ``--out`` keeps the junit XML, the summary as JSON, the
run's events (one JSON line each) and pytest's output.

Collecting the whole file (about half a million cases) takes minutes of CPU and gigabytes of
memory per process. To spend none of a GPU machine's time on it, collect and sample elsewhere:
``--write-cases FILE`` writes the chosen case names and stops; ``--assume-capability 9.0``
makes that collection work on a machine without a GPU (the file asks for the device's compute
capability when it is imported; the shim answers instead). ``--cases FILE`` then runs exactly
those cases: the pytest plugin beside this script (``flash_attn_conformance_plugin.py``)
generates only them, so each pytest process (each xdist worker too) collects a few thousand
cases in seconds. ``--check-cases`` collects them that way and runs nothing: how long it takes,
and whether the test file has every one.

The run is built to leave a summary whatever a case does. The plugin records each case's start
and outcome as it happens (``events.jsonl``), and the summary is read from that record, not
from pytest's own report. ``--case-timeout`` ends the process in which one case runs too long
(a hung kernel cannot be interrupted any other way); a process whose CUDA context a case left
unusable ends too. With pytest-xdist (``--pytest-args -n N``) the controller reports such a
case as failed and starts a fresh worker for the rest; without it the run stops there and the
cases not reached are counted as not run. ``--timeout`` bounds the whole run: pytest is then
interrupted, and what finished is summarised.

Several workers on one GPU can run it out of memory where one alone would not: flash-attn's
float32 references of its largest cases (128k keys) take tens of GB each. ``--rerun-oom`` runs
the cases that failed with ``torch.OutOfMemoryError`` again after the parallel run, one at a
time in a single process (the rest of ``--pytest-args`` kept, ``-n`` left out), within what is
left of ``--timeout``; a rerun case counts by its rerun, and the summary says how many there were.
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
import time
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


PLUGIN = Path(__file__).resolve().with_name("flash_attn_conformance_plugin.py")


def write_shim(folder: Path, capability: str | None = None) -> Path:
    """The shim package, and beside it the pytest plugin that selects, times and records the
    cases (its docstring says how), in ``folder``: the pytest runs put it on PYTHONPATH."""
    texts = dict(_SHIM)
    if capability:
        major, minor = (int(x) for x in capability.split("."))
        texts["sitecustomize.py"] = _ASSUME_CAPABILITY.format(major=major, minor=minor)
    for rel, text in texts.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    shutil.copyfile(PLUGIN, folder / PLUGIN.name)
    return folder


def _env(shim: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _plugin_args(cases: Path | None, events: Path | None = None,
                 case_timeout: float = 0) -> list[str]:
    # One "--option=value" word each: pytest takes a separate word that names an existing file
    # for a path to collect from, and moves its rootdir (and so the node ids) up to a common
    # ancestor of it and the test file.
    args = ["-p", PLUGIN.stem]
    if cases:
        args.append(f"--conformance-cases={cases}")
    if events:
        args.append(f"--conformance-events={events}")
    if case_timeout:
        args.append(f"--conformance-case-timeout={case_timeout:g}")
    return args


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


def collect(test_file: Path, shim: Path, keyword: str | None,
            cases: Path | None = None) -> list[str]:
    """The node ids pytest collects from ``test_file`` (only those named in ``cases``, if
    given, selected as the cases are generated)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           *_plugin_args(cases), str(test_file)] + (["-k", keyword] if keyword else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(shim), cwd=test_file.parent)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no test collected from {test_file}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return ids


def _reason(text: str) -> str:
    first = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "(no message)")
    first = re.sub(r"'[^']*::[^']*'", "'CASE'", first)    # xdist names the crashed case
    first = re.sub(r"0x[0-9a-fA-F]+", "0xN", first)
    first = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", first)
    return first[:160]


def read_events(path: Path) -> list[dict]:
    """The plugin's JSON lines; a line cut short by a process that was killed is skipped."""
    events = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return events


def summarise(events: list[dict], chosen: list[str]) -> dict:
    """Each chosen case's outcome and reason, from the plugin's events.

    failed: a failed report, or the case's process ended under it (its timeout, a CUDA context
    it left unusable, or a crash: xdist reports the case as crashed; without xdist it started
    and nothing followed). skipped, passed: as pytest reported. not run: chosen, never started
    (an interrupted run, or a name the test file does not have: "not collected").
    """
    by_case = collections.defaultdict(list)
    for e in events:
        if "case" in e:
            by_case[e["case"]].append(e)
    counts = collections.Counter()
    reasons = {k: collections.Counter() for k in ("failed", "skipped", "not run")}
    for name in chosen:
        evs = by_case.get(name, [])
        kinds = {e["event"] for e in evs}
        reports = [e for e in evs if e["event"] == "report"]
        failed = [e for e in reports if e["outcome"] == "failed"]
        own = [e for e in failed if e.get("when") != "???"]     # "???": xdist's crash report
        skipped = [e for e in reports if e["outcome"] == "skipped"]
        timeout = next((e for e in evs if e["event"] == "timeout"), None)
        lost = next((e for e in evs if e["event"] == "cuda context lost"), None)
        if timeout:
            kind, why = "failed", f"ran past the case timeout ({timeout['seconds']:g} s): " \
                                  f"its process was ended"
        elif lost:
            kind, why = "failed", f"left the CUDA context unusable: {lost.get('message')}"
        elif own or failed:
            kind, why = "failed", (own or failed)[0].get("message")
        elif skipped:
            kind, why = "skipped", skipped[0].get("message")
        elif any(e["outcome"] == "passed" for e in reports):
            kind, why = "passed", None
        elif "start" in kinds:
            kind, why = "failed", "started, no report: its process ended or the run was " \
                                  "interrupted under it"
        else:
            kind, why = "not run", "not collected" if "not collected" in kinds else \
                "not started (the run ended first)"
        counts[kind] += 1
        if why is not None:
            reasons[kind][_reason(why)] += 1
    generated = [e for e in events if e["event"] == "generated"]
    return {"counts": dict(counts),
            "reasons": {k: v.most_common() for k, v in reasons.items()},
            # what the generation-time selection built, per test function (one process's)
            "generated": {e["function"]: {"built": e["built"], "kept": e["kept"]}
                          for e in generated}}


class _Stop(Exception):
    """SIGTERM to the runner: stop pytest, then summarise as after a timeout."""


def _run_pytest(cmd: list[str], env: dict, cwd: Path, log: Path, timeout: float) -> int | None:
    """Run pytest in a process group of its own, its output into ``log``; past ``timeout``
    seconds (or on SIGTERM) interrupt it as Ctrl-C would (it then writes its junit report),
    and after a grace period kill the group, xdist workers and all. The exit code, or None
    when it had to be killed."""
    def stop(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop)
    with open(log, "w") as out:
        # A shell starts background commands with SIGINT ignored, and children inherit that:
        # give pytest the default back, or interrupting it would do nothing.
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                why = f"passed its {timeout:g} s limit"
            except (_Stop, KeyboardInterrupt):
                # (Ctrl-C reaches this script alone: pytest has a session of its own.)
                why = "was told to stop"
            print(f"# the pytest run {why}: interrupting it, then summarising what finished",
                  flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                return proc.wait(timeout=_GRACE_S)
            except (subprocess.TimeoutExpired, _Stop, KeyboardInterrupt):
                return None
        finally:
            signal.signal(signal.SIGTERM, previous)
            # Whatever it ended with, no worker of it may go on holding the GPU.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


_GRACE_S = 20   # for an interrupted pytest to stop its workers and write its report

_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")


def _out_of_memory(events: list[dict], chosen: list[str]) -> list[str]:
    """The chosen cases whose failed report says the GPU ran out of memory."""
    oom = {e["case"] for e in events if e.get("event") == "report"
           and e.get("outcome") == "failed" and _OOM.search(e.get("message") or "")}
    return [c for c in chosen if c in oom]


def _pytest_cmd(test_name: str, cases: Path | None, events: Path, case_timeout: float,
                extra: list[str]) -> list[str]:
    """The pytest command of a run: short tracebacks (with the long ones, the default, a
    thousand failures make a junit report and a log of tens of megabytes, slow to write and too
    big to copy back from the GPU machine; ``--tb=long`` in ``extra`` overrides it), the plugin,
    then ``extra`` and the test file."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
            *_plugin_args(cases, events, case_timeout), *extra, test_name]


def _without_workers(args: list[str]) -> list[str]:
    """pytest arguments less pytest-xdist's worker count (-n N, -nN, --numprocesses[=]N)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-n", "--numprocesses"):
            skip = True
        elif not re.fullmatch(r"-n\S+|--numprocesses=\S+", arg):
            out.append(arg)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("test_file", type=Path, help="flash-attn's tests/test_flash_attn.py")
    p.add_argument("--sample", type=int, default=0, help="run a random sample of N cases (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="keep junit.xml, summary.json, events.jsonl and "
                   "pytest.log here (the events and the log are written there as the run goes)")
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds for the whole pytest run, after which it is interrupted and "
                   "what finished is summarised")
    p.add_argument("--case-timeout", type=float, default=0,
                   help="seconds for one case, after which its process is ended (0: no limit)")
    p.add_argument("--rerun-oom", action="store_true",
                   help="run the cases that failed out of GPU memory again, one at a time, "
                   "after the parallel run (within --timeout)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression applied at collection")
    p.add_argument("--write-cases", type=Path, metavar="FILE",
                   help="collect and sample, write the chosen case names to FILE, run nothing")
    p.add_argument("--cases", type=Path, metavar="FILE",
                   help="run the cases named in FILE (from --write-cases); only they are "
                   "generated")
    p.add_argument("--check-cases", action="store_true",
                   help="with --cases: collect them as the run would, say how many the test "
                   "file has and how long it took, run nothing")
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
    if a.check_cases and not a.cases:
        raise SystemExit("argument '--check-cases': needs --cases FILE")
    if a.assume_capability and not re.fullmatch(r"\d+\.\d+", a.assume_capability):
        raise SystemExit(f"argument '--assume-capability': expected MAJOR.MINOR such as 9.0, "
                         f"got {a.assume_capability!r}")
    if a.assume_capability and not (a.write_cases or a.check_cases):
        raise SystemExit("argument '--assume-capability': only for collection (--write-cases, "
                         "--check-cases); the cases themselves need the GPU")
    with tempfile.TemporaryDirectory(prefix="flash_attn_conformance_") as tmp:
        tmp = Path(tmp)
        work = tmp / "tests"
        work.mkdir()
        test_file = work / a.test_file.name
        shutil.copyfile(a.test_file, test_file)
        cases_file = None
        if a.cases:
            names, collected, seed = read_cases(a.cases)
            chosen = [f"{test_file.name}::{n}" for n in names]
            ids_count, a.seed = collected or len(chosen), seed if seed is not None else a.seed
            cases_file = a.cases.resolve()
            if a.check_cases:
                t0 = time.perf_counter()
                found = collect(test_file, write_shim(tmp / "collect", a.assume_capability),
                                None, cases_file)
                took = time.perf_counter() - t0
                missing = sorted(set(names) - {f.split("::", 1)[1] for f in found})
                print(f"# collected {len(found)} of the {len(chosen)} cases in {a.cases} in "
                      f"{took:.1f} s (a pytest process, start to end)")
                for name in missing[:20]:
                    print(f"  not in the test file: {name}")
                return 1 if missing or len(found) != len(chosen) else 0
        else:
            ids = collect(test_file, write_shim(tmp / "collect", a.assume_capability), a.keyword)
            chosen = ids if not a.sample or a.sample >= len(ids) else \
                sorted(random.Random(a.seed).sample(ids, a.sample), key=ids.index)
            ids_count = len(ids)
            if len(chosen) < len(ids):
                cases_file = tmp / "cases.txt"
                cases_file.write_text("\n".join(c.split("::", 1)[1] for c in chosen) + "\n")
        if a.write_cases:
            a.write_cases.write_text(f"# {len(chosen)} of {ids_count} cases (seed {a.seed}) from "
                                     f"{a.test_file.name}\n" +
                                     "\n".join(c.split("::", 1)[1] for c in chosen) + "\n")
            print(f"# wrote {len(chosen)} of {ids_count} case names to {a.write_cases}")
            return 0
        shim = write_shim(tmp / "shim")
        keep = a.out.resolve() if a.out else tmp    # pytest runs in another folder
        keep.mkdir(parents=True, exist_ok=True)
        junit, events, log = keep / "junit.xml", keep / "events.jsonl", keep / "pytest.log"
        for old in (junit, events, log):
            old.unlink(missing_ok=True)
        cmd = _pytest_cmd(test_file.name, cases_file, events, a.case_timeout,
                          [f"--junitxml={junit}", "-o", "junit_family=xunit1", *a.pytest_args]
                          + (["-k", a.keyword] if a.keyword and not cases_file else []))
        print(f"# {len(chosen)} of {ids_count} cases (seed {a.seed}) from {a.test_file}; "
              f"pytest's output: {log}", flush=True)
        t0 = time.perf_counter()
        rc = _run_pytest(cmd, _env(shim), work, log, a.timeout)
        found = read_events(events)
        if not any(e["event"] == "start" for e in found):
            tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
            print(f"# pytest (exit {rc}) started no case; the end of its output:\n{tail}")
        names = [c.split("::", 1)[1] for c in chosen]
        summary = summarise(found, names)
        rerun = _out_of_memory(found, names) if a.rerun_oom else []
        reran = 0
        left = a.timeout - (time.perf_counter() - t0)
        if rerun and left > _GRACE_S:
            again = keep / "rerun_cases.txt"
            again.write_text(f"# the {len(rerun)} cases that ran out of memory beside other "
                             "workers\n" + "\n".join(rerun) + "\n")
            ev2, log2 = keep / "events_rerun.jsonl", keep / "pytest_rerun.log"
            ev2.unlink(missing_ok=True)
            cmd2 = _pytest_cmd(test_file.name, again.resolve(), ev2, a.case_timeout,
                               _without_workers(a.pytest_args))
            print(f"# {len(rerun)} cases ran out of GPU memory: running them again one at a "
                  f"time ({left:.0f} s left); pytest's output: {log2}", flush=True)
            _run_pytest(cmd2, _env(shim), work, log2, left)
            second = read_events(ev2)
            # a case the rerun started counts by the rerun; one it did not reach keeps its
            # out-of-memory failure
            redone = {e["case"] for e in second if e.get("event") == "start"}
            found = [e for e in found if e.get("case") not in redone] + second
            summary, reran = summarise(found, names), len(redone)
        took = time.perf_counter() - t0
        summary.update(rerun_out_of_memory=reran, collected=ids_count, run=len(chosen),
                       seed=a.seed, pytest_exit=rc, seconds=round(took, 1))
        if a.out:
            (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    c = summary["counts"]
    not_run = f", {c['not run']} not run" if c.get("not run") else ""
    print(f"# pytest ran {summary['seconds']:g} s (exit {summary['pytest_exit']})")
    if summary["rerun_out_of_memory"]:
        print(f"# {summary['rerun_out_of_memory']} cases that ran out of GPU memory beside other "
              f"workers were run again one at a time; they count by that run")
    print(f"SUMMARY {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
          f"{c.get('skipped', 0)} skipped{not_run} ({summary['run']} of {summary['collected']} "
          f"cases)")
    for kind in ("failed", "skipped", "not run"):
        for reason, n in summary["reasons"][kind][:25]:
            print(f"  {kind:7s} {n:6d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
