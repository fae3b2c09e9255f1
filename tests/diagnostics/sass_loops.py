"""A kernel's main loops in SASS, without a GPU: instruction mix and the wgmma waits' places.

    python tests/diagnostics/sass_loops.py SOURCE 'TEMPLATE<ARGS>' [-DNAME ...] [--dump FILE]

e.g. ``python tests/diagnostics/sass_loops.py flash_fwd_sm90.cu "flash_fwd_sm90_fp8_kernel<fc_bf16,
128, 192, false, 2, true, true, false, false, 2>" -DFC_DIAG_SOFTMAX_FENCE``. Compiles one
instantiation with nvcc (``-cubin -arch=sm_90a``, the kernels' options; a ``.cu`` file that
includes the source and takes the kernel's address), disassembles it (``cuobjdump -sass``,
which needs ``nvdisasm`` on PATH: the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``
wheels' ``nvidia/cu13/bin``) and prints ptxas's registers and spills, then for each innermost
loop that issues two or more wgmma (HGMMA / QGMMA) its instruction count and opcode mix, and
where its waits are: the wait for all but the last group (``WARPGROUP.DEPBAR.LE gsb0, 0x1``:
S done), the wait for all (``0x0``: P V done), and how many exponentials (``MUFU.EX2``) come
before and after the latter. Static counts: a branched-over block (a boundary mask) counts
too. ptxas, not the source, decides this order (performance log, session 35).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

CUDA = pathlib.Path(__file__).resolve().parents[2] / "cuda"


def _tool(name):
    path = shutil.which(name)
    if path is None:
        try:
            import nvidia
            for base in nvidia.__path__:
                cand = pathlib.Path(base) / "cu13" / "bin" / name
                if cand.exists():
                    return str(cand)
        except ImportError:
            pass
        sys.exit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                 "(and nvcc on PATH)")
    return path


def compile_sass(source, name, defines):
    """(ptxas's resource lines, SASS text) of one instantiation."""
    nvcc, cuobjdump = _tool("nvcc"), _tool("cuobjdump")
    nvdisasm = _tool("nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ["PATH"])
    tag = hashlib.sha256((source + name + " ".join(defines)).encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, f"k{tag}.cu"), os.path.join(tmp, f"k{tag}.cubin")
        with open(cu, "w") as f:
            f.write(f'#include "{source}"\nvoid* fc_kernel_address = (void*)&{name};\n')
        r = subprocess.run([nvcc, "-cubin", "-std=c++17", "-arch=sm_90a", "-ftz=true", "-O3",
                            f"-I{CUDA}", "-Xptxas", "-v", *defines, "-o", cubin, cu],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-4000:])
        res = [ln.split("info    : ")[-1] for ln in r.stderr.splitlines()
               if "spill" in ln or "Used" in ln or "Potential Performance Loss" in ln]
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                              env=env, check=True).stdout
    return res, sass


def _op(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(sass):
    """[(lo, hi, [(address, instruction)])] of the innermost loops with two or more wgmma."""
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    back = set()
    for a, t in ins:
        if _op(t).startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", t)
            if m and int(m.group(1), 16) < a:
                back.add((int(m.group(1), 16), a))
    gl = [(lo, hi) for lo, hi in back
          if sum("GMMA" in _op(t) for a, t in ins if lo <= a <= hi) >= 2]
    inner = [x for x in gl if not any(y != x and x[0] <= y[0] and y[1] <= x[1] for y in gl)]
    return [(lo, hi, [(a, t) for a, t in ins if lo <= a <= hi]) for lo, hi in sorted(inner)]
    # (backward branches can close overlapping ranges; each is listed, by address)


def describe(body):
    mix = collections.Counter(_op(t).split(".")[0] for _, t in body)
    w1 = [i for i, (_, t) in enumerate(body) if "DEPBAR.LE gsb0, 0x1" in t]
    w0 = [i for i, (_, t) in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in t]
    ex = [i for i, (_, t) in enumerate(body) if "MUFU.EX2" in t]
    waits = f"wait for S at {w1}, wait for all at {w0}"
    if w0:
        waits += (f"; MUFU.EX2 {len(ex)}: {sum(e < w0[0] for e in ex)} before the first wait "
                  f"for all, {sum(e > w0[0] for e in ex)} after")
    return mix, waits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("name")
    ap.add_argument("--dump")
    args, defines = ap.parse_known_args(argv)
    bad = [d for d in defines if not d.startswith("-D")]
    if bad:
        ap.error(f"unrecognised arguments: {bad}")
    res, sass = compile_sass(args.source, args.name, defines)
    print(" | ".join(res))
    if args.dump:
        pathlib.Path(args.dump).write_text(sass)
    found = loops(sass)
    print(f"{len(found)} innermost wgmma loop(s)")
    for lo, hi, body in found:
        mix, waits = describe(body)
        print(f"loop {lo:#x}-{hi:#x}: {len(body)} instructions: "
              + ", ".join(f"{k} {v}" for k, v in mix.most_common(20)))
        print(f"  {waits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
