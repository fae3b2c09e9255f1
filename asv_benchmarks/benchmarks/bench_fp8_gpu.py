"""FP8 (float8_e4m3fn) attention on the GPU against bfloat16, measured in the same process.

* ``Fp8Forward``: the Hopper FP8 forward through the public API (torch tensors, per-(batch,
  key head) descales) at the flash-attn sizes (16k tokens per batch, hidden 2048): its TFLOP/s
  (flash-attn's count), and a bfloat16 peer's time divided by its own (> 1: FP8 faster), the
  peer being SDPA's cuDNN kernel or flashcore's own bfloat16 forward on the same values.
* ``Fp8DecodeRatio``: decoding over an e4m3 KV cache (bf16 query, GQA 32/8, head dim 128,
  ``cache_seqlens`` a CUDA int32 tensor) against the same call over a bfloat16 cache: the
  tokens/s ratio, bf16 time / FP8 time (issue #17's goal: close to 2).

GPU time by flashcore.bench.gpu_time (CUDA events after warm-up, L2 flushed, median), as
``tests/diagnostics/bench_fp8_forward.py`` and ``bench_fp8_decode.py`` measure it.
"""
from .common import (flops, fp8_quantise, gpu_time, require_gpu_backend, sdpa_pinned, shape_for,
                     torch)


def _require_sm90():
    require_gpu_backend("cupy")
    if torch is None or torch.cuda.get_device_capability() != (9, 0):
        raise NotImplementedError("the FP8 forward runs on compute capability 9.0 only")


class Fp8Forward:
    """The FP8 forward: TFLOP/s, and bf16 peers' time over FP8's (> 1: FP8 faster)."""

    params = [["tflops", "sdpa_cudnn", "flashcore_bf16"], [4096, 16384], [128, 256], [False, True]]
    param_names = ["figure", "seqlen", "headdim", "causal"]
    unit = "TFLOP/s or ratio"
    timeout = 180
    rounds = 1

    def setup(self, figure, seqlen, headdim, causal):
        import flashcore
        _require_sm90()
        self.shape = shape_for(seqlen, headdim)
        g = torch.Generator(device="cuda").manual_seed(seqlen + headdim)
        x16 = [torch.randn(*self.shape, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3)]
        (q8, qd), (k8, kd), (v8, vd) = (fp8_quantise(x) for x in x16)
        self.fp8 = lambda: flashcore.attention_forward(q8, k8, v8, causal=causal, q_descale=qd,
                                                       k_descale=kd, v_descale=vd)
        self.bf16 = lambda: flashcore.attention_forward(*x16, causal=causal)
        xt = [x.transpose(1, 2) for x in x16]
        self.cudnn = lambda: torch.nn.functional.scaled_dot_product_attention(
            *xt, is_causal=causal)
        self.causal = causal

    def track_figure(self, figure, *params):
        fp8 = gpu_time(self.fp8)
        if figure == "tflops":
            return flops(*self.shape, self.causal, "forward") / fp8 / 1e12
        if figure == "flashcore_bf16":
            return gpu_time(self.bf16) / fp8
        with sdpa_pinned("sdpa_cudnn"):
            return gpu_time(self.cudnn) / fp8


class Fp8DecodeRatio:
    """Decoding over an FP8 cache: the bf16 cache's GPU time over the FP8 cache's (tokens/s
    ratio; contiguous caches, full lengths)."""

    params = [[1, 8, 64], [16384, 131072]]
    param_names = ["batch", "cache"]
    unit = "ratio"
    timeout = 240
    rounds = 1

    def setup(self, batch, cache):
        import flashcore
        require_gpu_backend("cupy")
        if batch * cache > 8 * 131072:
            raise NotImplementedError("64 x 128k: 34 GB of bf16 cache, left out")
        h, hk, d = 32, 8, 128
        g = torch.Generator(device="cuda").manual_seed(batch * 7 + cache)
        k16, v16 = (torch.randn(batch, cache, hk, d, device="cuda", dtype=torch.bfloat16,
                                generator=g) for _ in range(2))
        (k8, kd), (v8, vd) = fp8_quantise(k16), fp8_quantise(v16)
        q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((batch,), cache, device="cuda", dtype=torch.int32)
        self.bf16 = lambda: flashcore.attention_with_kvcache(q, k16, v16, cache_seqlens=lens)
        self.fp8 = lambda: flashcore.attention_with_kvcache(q, k8, v8, cache_seqlens=lens,
                                                            k_descale=kd, v_descale=vd)

    def track_ratio(self, batch, cache):
        return gpu_time(self.bf16) / gpu_time(self.fp8)
