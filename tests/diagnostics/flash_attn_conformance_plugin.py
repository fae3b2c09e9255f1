"""pytest plugin of the flash-attn conformance run (not a test module, not a script).

``flash_attn_conformance.py`` loads it into the pytest run it starts (``-p
flash_attn_conformance_plugin``; under pytest-xdist every worker loads it too). It adds:

``--conformance-cases FILE``
    Run only the cases named in FILE (``test_name[id]`` a line, ``#`` comments, as
    ``--write-cases`` writes them). flash-attn's file parametrises about half a million cases;
    selecting a few thousand of them by node id after collection made every process build all
    of them first (minutes of CPU and gigabytes each, in every xdist worker). Here the
    selection happens while pytest generates the cases: after each ``parametrize`` of a test
    function, only the partial cases that begin a chosen id are kept, so the cross product
    never grows past the chosen cases times one decorator's values; functions with no chosen
    case are not collected at all. The selection is exact: what generation lets through and
    the file does not name is deselected after collection.
``--conformance-events FILE``
    Append what happens to FILE as JSON lines, each written with one ``write`` as it happens
    (``O_APPEND``: xdist workers and the controller may share the file): the cases each
    function generated, chosen cases that were not collected, each case's start and reports,
    timeouts, a lost CUDA context. The runner's summary is read from it, so a run whose pytest
    was killed, or died with the case it ran, still has one.
``--conformance-case-timeout SECONDS``
    End the process in which one case (setup, call and teardown) has run this long, after
    recording it. A hung kernel blocks inside a CUDA call, where no Python exception can reach
    it; ending the process is what always works. Under xdist the controller reports the case
    as crashed and starts a new worker for the rest.

A process whose CUDA context is unusable after a case (an illegal address or a device-side
assert is sticky: every later CUDA call of the process fails) records it and ends too, so that
the rest of its cases run in a fresh process instead of failing for a reason not their own.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading

import pytest

# After the watchdog's own exit (which needs the GIL), faulthandler's, which does not: a hang
# inside a C call that holds the GIL still ends this many seconds later.
_HARD_EXIT_GRACE_S = 30
_MESSAGE_CHARS = 1000


def pytest_addoption(parser):
    group = parser.getgroup("flash-attn conformance")
    group.addoption("--conformance-cases", metavar="FILE",
                    help="run only the cases named in FILE; the others are never generated")
    group.addoption("--conformance-events", metavar="FILE",
                    help="append starts, outcomes, timeouts to FILE as JSON lines")
    group.addoption("--conformance-case-timeout", type=float, default=0.0, metavar="SECONDS",
                    help="end the process running a case longer than this (0: no limit)")


def case_name(nodeid: str) -> str:
    """A node id without its file: the name ``--write-cases`` writes and the events use."""
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def read_case_names(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


class Cases:
    """The chosen cases, indexed for generation: for each test function (its name within the
    file, ``Class::`` prefixed for methods), every cut of a chosen id at a ``-``. A case's id
    is its parametrize ids joined by ``-`` in the order the decorators apply, so after k of
    them a wanted case's partial id is one of these cuts. (An id with a ``-`` of its own only
    lets a few unwanted partial cases through; the exact filter after collection drops them.)
    """

    def __init__(self, names):
        self.names = set(names)
        self.prefixes: dict[str, set[str]] = {}
        self.functions: set[str] = set()
        for name in self.names:
            function, bracket, ident = name.partition("[")
            self.functions.add(function)
            if bracket:
                parts = ident[:-1].split("-")
                cuts = self.prefixes.setdefault(function, set())
                cuts.update("-".join(parts[:i]) for i in range(1, len(parts) + 1))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.pluginmanager.register(ConformanceRun(config), "flash-attn-conformance-run")


class ConformanceRun:
    """The plugin's state and hooks for one pytest process (the controller or a worker)."""

    def __init__(self, config):
        self.config = config
        self.events = config.getoption("conformance_events")
        self.limit = config.getoption("conformance_case_timeout")
        # xdist workers report to the controller, which records their outcomes: recording
        # them in the worker too would count each twice.
        self.worker = config.workerinput.get("workerid") if hasattr(config, "workerinput") \
            else None
        path = config.getoption("conformance_cases")
        self.cases = None
        if path:
            with open(path) as f:
                self.cases = Cases(read_case_names(f.read()))
        # Where the watchdogs put the stacks of a hung process: pytest captures fd 2 while a
        # case runs, and what it captured is lost with a process that ends.
        self.stacks = None
        if self.limit > 0 and self.events:
            self.stacks = open(f"{self.events}.stacks.txt", "a")

    def emit(self, **event) -> None:
        if not self.events:
            return
        if self.worker:
            event["worker"] = self.worker
        fd = os.open(self.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(event) + "\n").encode())
        finally:
            os.close(fd)

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makeitem(self, collector, name, obj):
        """No items at all for a test function none of whose cases is chosen."""
        if self.cases is None or not collector.funcnamefilter(name) or not callable(obj) \
                or isinstance(obj, type):
            return None
        return None if case_name(f"{collector.nodeid}::{name}") in self.cases.functions else []

    @pytest.hookimpl(wrapper=True)
    def pytest_generate_tests(self, metafunc):
        if self.cases is None or not hasattr(metafunc, "_calls"):
            # No selection, or a pytest whose internals moved: generate everything (slow)
            # and let the filter after collection select (still exact).
            return (yield)
        function = case_name(metafunc.definition.nodeid)
        wanted = self.cases.prefixes.get(function, frozenset())
        parametrize = metafunc.parametrize
        built = []

        def parametrize_chosen(*args, **kwargs):
            # Once nothing is left, a further parametrize would start a new cross product
            # from scratch (pytest multiplies into [one empty case] when it has none): skip.
            if built and not metafunc._calls:
                return
            parametrize(*args, **kwargs)
            built.append(len(metafunc._calls))
            metafunc._calls = [c for c in metafunc._calls if c.id in wanted]

        metafunc.parametrize = parametrize_chosen
        try:
            return (yield)
        finally:
            del metafunc.parametrize
            if built:
                self.emit(event="generated", function=function, built=sum(built),
                          kept=len(metafunc._calls))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config, items):
        if self.cases is None:
            return
        keep, drop = [], []
        for item in items:
            (keep if case_name(item.nodeid) in self.cases.names else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        for name in sorted(self.cases.names - {case_name(item.nodeid) for item in keep}):
            self.emit(event="not collected", case=name)

    def pytest_runtest_logstart(self, nodeid, location):
        if not self.worker:
            self.emit(event="start", case=case_name(nodeid))

    def pytest_runtest_logreport(self, report):
        # A passed setup or teardown says nothing that the call's report does not.
        if self.worker or (report.outcome == "passed" and report.when != "call"):
            return
        # The summary groups by the first line; the rest is in the junit report. (Bounded so
        # that thousands of failures keep the record small enough to copy back.)
        self.emit(event="report", case=case_name(report.nodeid), when=report.when,
                  outcome=report.outcome, message=_message(report)[:_MESSAGE_CHARS])

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        case = case_name(item.nodeid)
        timer = None
        if self.limit > 0:
            timer = threading.Timer(self.limit, self._time_out, args=(case,))
            timer.daemon = True
            timer.start()
            faulthandler.dump_traceback_later(self.limit + _HARD_EXIT_GRACE_S, exit=True,
                                              file=self.stacks or sys.__stderr__)
        try:
            return (yield)
        finally:
            if timer is not None:
                timer.cancel()
                faulthandler.cancel_dump_traceback_later()
            broken = _cuda_error()
            if broken:
                self.emit(event="cuda context lost", case=case, message=broken)
                _say(f"the CUDA context is unusable after {case} ({broken}): ending this "
                     f"process")
                os._exit(3)

    def _time_out(self, case) -> None:
        self.emit(event="timeout", case=case, seconds=self.limit)
        _say(f"{case} ran past {self.limit:g} s: ending this process")
        if self.stacks is not None:
            self.stacks.write(f"--- {case} ran past {self.limit:g} s; the process's threads:\n")
            self.stacks.flush()
            faulthandler.dump_traceback(file=self.stacks, all_threads=True)
        os._exit(124)


def _say(text: str) -> None:
    """A line on the process's real stderr (fd 2 may be pytest's capture file just then)."""
    try:
        sys.__stderr__.write(f"\nflash_attn_conformance_plugin: {text}\n")
        sys.__stderr__.flush()
    except (AttributeError, OSError, ValueError):
        pass


def _message(report) -> str:
    """What junit puts in a failure's or skip's message: the crash line, or the skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:   # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    if isinstance(longrepr, str):   # xdist's "worker 'gwN' crashed while running ..."
        return longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message
    return report.longreprtext if longrepr is not None else ""


def _cuda_error() -> str | None:
    """The error of a synchronise when torch's CUDA context fails it (a sticky error); None
    when it works, and when the process has not used CUDA through torch at all."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception as e:  # torch raises RuntimeError (torch.AcceleratorError in newer ones)
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None
