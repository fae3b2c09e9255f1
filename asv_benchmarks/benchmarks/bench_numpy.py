"""The NumPy backend (the reference, tiled like the CUDA kernels) on the CPU, small sizes.

So that a machine without a GPU records results too, and so that a change that makes the
reference much slower (and the test suite with it) shows up.
"""
import numpy as np

import flashcore


class NumpyAttention:
    params = [[128, 512], [64], [False, True]]
    param_names = ["seqlen", "headdim", "causal"]

    def setup(self, seqlen, headdim, causal):
        rng = np.random.default_rng(0)
        shape = (2, seqlen, 4, headdim)
        self.q, self.k, self.v, self.dout = (rng.standard_normal(shape, dtype=np.float32)
                                             for _ in range(4))
        self.causal = causal
        self.out, self.lse = flashcore.attention_forward(self.q, self.k, self.v, causal=causal,
                                                         backend="numpy")

    def time_forward(self, *params):
        flashcore.attention_forward(self.q, self.k, self.v, causal=self.causal, backend="numpy")

    def time_backward(self, *params):
        flashcore.attention_backward(self.dout, self.q, self.k, self.v, self.out, self.lse,
                                     causal=self.causal, backend="numpy")

