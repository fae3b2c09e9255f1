"""How fast an SM turns e4m3 bytes into fp16 pairs, two ways (issue #17; needs a GPU, sm_89+).

    python tests/diagnostics/probe_fp8_convert.py

The FP8 decode kernel converts every cache byte it reads (``cvt.rn.f16x2.e4m3x2``,
cuda/ptx.cuh). This times, on every SM at once, 8 independent chains per thread of:

* ``cvt``: the hardware conversion of a byte pair (what the kernel does);
* ``int``: the same result times 2^-8 from integer operations alone (a byte moved to the top of
  each 16-bit half by ``prmt``, shifted right by one under the sign: exact for every finite
  e4m3 value; the 2^8 would go into the descale);
* ``mix``: half the pairs each way (the conversions and the integer operations issue on
  different pipes).

and prints conversions (byte pairs) per clock per SM, and checks that ``int`` times 2^8 equals
``cvt`` on all 65,536 byte pairs (NaN excepted).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ u32 cvt_pair(u32 x) {
    u32 r;
    asm volatile("{\n.reg .b16 a;\ncvt.u16.u32 a, %1;\ncvt.rn.f16x2.e4m3x2 %0, a;\n}" : "=r"(r) : "r"(x));
    return r;
}
__device__ __forceinline__ u32 int_pair(u32 x) {   // bytes 0, 1 of x -> fp16 x 2^-8 in halves 0, 1
    u32 h;
    asm volatile("prmt.b32 %0, %1, 0, 0x1404;" : "=r"(h) : "r"(x));
    return ((h >> 1) & 0x3F803F80u) | (h & 0x80008000u);
}
template <int kMode>
__device__ __forceinline__ u32 conv(u32 x, int j) {
    if (kMode == 0) return cvt_pair(x);
    if (kMode == 1) return int_pair(x);
    return (j & 1) ? int_pair(x) : cvt_pair(x);
}
template <int kMode>
__global__ void bench(u32 seed, int iters, u32* out, long long* clocks) {
    u32 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = seed * (threadIdx.x + 1) + 0x9E3779B9u * j;
    long long t0 = clock64();
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = conv<kMode>(v[j] ^ (u32)i, j);
    }
    long long t1 = clock64();
    u32 acc = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
    if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
}
__global__ void check(u32* cvt_out, u32* int_out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;   // 0 .. 65535: the byte pair
    cvt_out[i] = cvt_pair(i);
    int_out[i] = int_pair(i);
}
"""


def main():
    mod = cp.RawModule(code=SRC, options=("-std=c++17",),
                       name_expressions=["bench<0>", "bench<1>", "bench<2>", "check"])
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    # exactness: int x 2^8 == cvt for every finite pair
    a, b = cp.zeros(65536, cp.uint32), cp.zeros(65536, cp.uint32)
    mod.get_function("check")((256,), (256,), (a, b))
    ca = cp.asnumpy(a).view(np.float16).astype(np.float32)
    ib = cp.asnumpy(b).view(np.float16).astype(np.float32) * 256.0
    fin = np.isfinite(ca)
    bad = int(np.sum(ca[fin] != ib[fin]))
    print(f"int x 2^8 vs cvt over all byte pairs: {bad} mismatches among {int(fin.sum())} "
          f"finite halves ({int((~fin).sum())} NaN halves skipped)")
    iters = 4096
    for mode, name in ((0, "cvt"), (1, "int"), (2, "mix")):
        k = mod.get_function(f"bench<{mode}>")
        for threads, blocks_per_sm in ((256, 4), (512, 2), (1024, 2)):
            out = cp.empty(sms * blocks_per_sm * threads, cp.uint32)
            clocks = cp.empty(sms * blocks_per_sm, cp.int64)
            k((sms * blocks_per_sm,), (threads,), (np.uint32(7), np.int32(iters), out, clocks))
            cp.cuda.runtime.deviceSynchronize()
            k((sms * blocks_per_sm,), (threads,), (np.uint32(7), np.int32(iters), out, clocks))
            cp.cuda.runtime.deviceSynchronize()
            cyc = float(cp.asnumpy(clocks).max())
            pairs_per_sm = blocks_per_sm * threads * iters * 8
            print(f"{name}: {threads} threads x {blocks_per_sm} blocks per SM: "
                  f"{pairs_per_sm / cyc:6.1f} pairs per clock per SM")


if __name__ == "__main__":
    main()
