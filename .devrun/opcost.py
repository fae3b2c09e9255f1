import time, torch, flashcore
from flashcore.backends import torch_backend as tb
from flashcore.spec import forward_spec
dev = "cuda"
q = torch.randn(1, 128, 2, 64, device=dev, dtype=torch.bfloat16)
x = torch.randn(4, device=dev)
lib = torch.library.Library("probe", "DEF")
lib.define("lowlevel(Tensor a) -> Tensor")
lib.impl("lowlevel", lambda a: torch.empty_like(a), "CUDA")
@torch.library.custom_op("probe::hi", mutates_args=())
def hi(a: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a): return torch.empty_like(a)
    @staticmethod
    def backward(ctx, g): return g
spec = forward_spec(q, q, q, causal=True)
ops = tb.torch_ops()
args = (q, q, q, None, None, None, 0, 0, True, spec.softmax_scale, spec.window_left, spec.window_right, 0.0, False)
def bench(fn, n=3000):
    for _ in range(200): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best
with torch.no_grad():
    r = {"empty_like": bench(lambda: torch.empty_like(x)),
         "lowlevel_op": bench(lambda: torch.ops.probe.lowlevel.default(x)),
         "custom_op_trivial": bench(lambda: torch.ops.probe.hi.default(x)),
         "Function_trivial": bench(lambda: F.apply(x)),
         "backend_forward_direct": bench(lambda: tb._BACKEND.forward(spec, q, q, q)),
         "fwd_op_direct": bench(lambda: ops.fwd.default(*args)),
         "forward_spec_memo": bench(lambda: forward_spec(q, q, q, causal=True)),
         "flashcore.attention": bench(lambda: flashcore.attention(q, q, q, causal=True)),
         "sdpa": bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))}
for k, v in r.items(): print(f"{k:28s} {v:8.1f} us")
