"""Counts compute-sanitizer's reports in a log by driver section, kernel and kind of report.

    python3 tests/diagnostics/sanitize_summary.py LOG [LOG ...]

The log is one tool's output over ``sanitize_driver.py`` (which prints ``== section NAME`` before
each group of calls, into the stream the tool writes its reports to). Each report is counted
under the last section line before it, the kernel named in its ``at`` line (offset dropped) and
its first line (e.g. "Uninitialized __global__ memory read of size 4 bytes"); the table is
printed with the most frequent first, and for each (section, kernel) the lowest and highest
offsets in the kernel at which it was reported.
"""

import collections
import re
import sys

PREFIX = re.compile(r"^=+\s?")


def summarise(lines):
    counts = collections.Counter()
    offsets = collections.defaultdict(set)
    section, kind = "(before the first section)", None
    for raw in lines:
        line = raw.rstrip("\n")
        if line.startswith("== section "):
            section = line[len("== section "):]
            continue
        if not line.startswith("="):
            continue
        body = PREFIX.sub("", line)
        text = body.strip()
        if body and not body.startswith(" ") and not text.startswith(("ERROR SUMMARY", "RACECHECK",
                                                                    "COMPUTE-SANITIZER", "Program hit")):
            kind = text
        elif text.startswith("at ") and kind:
            where = text[3:]
            where = re.sub(r"\s+in\s+\S+:\d+$", "", where)
            kernel, _, off = where.rpartition("+")
            if not kernel or not off.startswith("0x"):
                kernel, off = where, ""
            counts[(section, kernel, kind)] += 1
            if off:
                offsets[(section, kernel)].add(off)
            kind = None
    return counts, offsets


def main(paths):
    for path in paths:
        with open(path, errors="replace") as f:
            counts, offsets = summarise(f)
        print(f"# {path}: {sum(counts.values())} reports")
        for (section, kernel, kind), n in counts.most_common():
            offs = sorted(offsets.get((section, kernel), ()), key=lambda o: int(o, 16))
            span = f" [{offs[0]}..{offs[-1]}, {len(offs)} offsets]" if offs else ""
            print(f"{n:8d}  {section} | {kernel[:150]} | {kind}{span}")


if __name__ == "__main__":
    main(sys.argv[1:])
