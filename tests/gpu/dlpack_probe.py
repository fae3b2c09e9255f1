"""Does torch -> CuPy DLPack keep a strided tensor's memory (a diagnostic)?"""
import cupy
import torch

base = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
for name, t in [("contiguous", base), ("transposed view", base.transpose(1, 2)),
                ("sliced view", base[:, :, ::2])]:
    for how, f in [("cupy.from_dlpack(t)", lambda t: cupy.from_dlpack(t)),
                   ("cupy.from_dlpack(to_dlpack(t))", lambda t: cupy.from_dlpack(torch.utils.dlpack.to_dlpack(t)))]:
        try:
            x = f(t)
            print(f"{name:16s} {how:32s} same memory: {x.data.ptr == t.data_ptr()}, strides kept: "
                  f"{x.strides == tuple(s * t.element_size() for s in t.stride())}, dtype {x.dtype}")
        except Exception as e:
            print(f"{name:16s} {how:32s} failed: {type(e).__name__}: {e}")
