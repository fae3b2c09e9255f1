"""One forward of flashcore and of torch SDPA's cuDNN backend at an ANCHORS size, for Nsight
Compute to profile both kernels side by side (GPU clocks left alone: --clock-control none):

    ncu --clock-control none --nvtx --nvtx-include "fwd/" --launch-count 8 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \\
        --section WarpStateStats python3 tests/diagnostics/profile_fwd.py 128 2048 [causal]

Each implementation runs three times (flashcore, then cuDNN, in turn) inside the NVTX range
"fwd" (every kernel launched there, whatever cuDNN names its kernels); the later launches are
warm. bf16, 16k tokens, hidden 2048; flashcore through
``flashcore.attention`` on torch tensors under ``torch.no_grad``, as a user calls it.
"""
import csv
import sys

if len(sys.argv) > 2 and sys.argv[1] == "--summarise":
    # python3 tests/diagnostics/profile_fwd.py --summarise ncu.csv: the raw page (ncu --csv
    # --page raw) as one line per kernel: time, SM and issue throughput, the top stall reasons
    # (warps stalled per issued instruction)
    lines = open(sys.argv[2]).read().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    head, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]   # (row 1: units)

    def val(r, name):
        try:
            return float(r[head.index(name)].replace(",", ""))
        except (ValueError, IndexError):
            return float("nan")
    stall = [n for n in head if "issue_stalled" in n and n.endswith("per_issue_active.ratio")]
    for r in body:
        name = r[head.index("Kernel Name")][:70]
        top = sorted(((val(r, n), n) for n in stall), reverse=True)[:6]
        print(f"{name} | time {val(r, 'gpu__time_duration.sum'):.0f} ns | SM "
              f"{val(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):.1f}% | issue "
              f"{val(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.1f}% | stalls "
              + ", ".join(f"{n.split('issue_stalled_')[1].split('_per')[0]} {v:.2f}"
                          for v, n in top))
    sys.exit(0)

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from flashcore.bench import shape_for

d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
s = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
b, _, h, _ = shape_for(s, d)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
           for _ in range(3))
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
with torch.no_grad():
    flashcore.attention(q, k, v, causal=causal)       # (kernels compiled and loaded outside)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("fwd")
    for _ in range(3):
        flashcore.attention(q, k, v, causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
print("done")
