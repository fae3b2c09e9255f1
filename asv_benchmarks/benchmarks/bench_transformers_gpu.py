"""End to end: the transformers Llama of issues #14 and #15 (``flashcore.bench.LLAMA``: random
init, 8 layers, hidden 2048, 16 query heads over 4 kv heads, bf16) with flashcore as its
attention (``flashcore.integrations.transformers.register()``) against the same weights under
"sdpa" (torch's SDPA: cuDNN by default on Hopper), both in the same process. Each figure is a
ratio, flashcore's speed over "sdpa"'s: above 1 flashcore is faster.

* ``GenerateRatio``: greedy ``generate``, tokens/s. The dynamic cache (transformers' default:
  a decoding step bound by the host's Python, 128 tokens) and the static cache
  (``cache_implementation="static"``, which transformers compiles; 64 tokens), at batch 1 /
  prompt 512 and batch 8 / prompt 2k. Each model is warmed by a whole generate (the static
  cache's compiles), then the two are timed in turn, 5 rounds, the order turning each round
  (``flashcore.bench.generate_rounds``); the median of the rounds' ratios
  (``flashcore.bench.speed_ratio``: each round's two generates ran one after the other).
  ``dynamic_new_lengths``:
  the dynamic cache over cache lengths new to the process, 3 rounds
  (``flashcore.bench.generate_new_length_rounds``): what a fresh process pays, each step
  meeting a new length.
* ``PrefillRatio``: one prefill forward (a fresh ``DynamicCache``, under the 2D mask
  ``generate`` passes: all ones, or left padding, ``flashcore.bench.prefill_mask``), host and
  GPU time to the logits, at batch 1 / 512 and batch 8 / 2k; 7 rounds, the models in turn,
  each round the best of 3 (``flashcore.bench.prefill_rounds``), the median of the rounds'
  ratios. The masked prefill is where flashcore's route and "sdpa"'s differ most (flashcore
  packs the kept tokens for its varlen kernel; "sdpa" drops an all-ones mask).
* ``TrainStepRatio``: a training step (forward with labels, backward), eager and under
  ``torch.compile``, at batch 1 x 16k and batch 4 x 4k tokens: "sdpa"'s ms a step over
  flashcore's (``flashcore.bench.train_step_ms``: 3 untimed steps, then a loop of 8).

``python tests/diagnostics/bench_callpath.py generate generate_static llama compile`` prints the
same figures with their parts (tokens/s by round, first tokens, compile times, losses).
"""
from .common import (generate_ids, generate_new_length_rounds, generate_rounds, generate_setup,
                     llama_model, prefill_mask, prefill_rounds, require_gpu_backend,
                     require_transformers, speed_ratio, train_step_ms)

_IMPLS = ("sdpa", "flashcore")


def _shape(text):
    batch, n = text.split("x")
    return int(batch), int(n)


class _LlamaRatio:
    """What the figures share: a ratio, one round (one process per parameter set; the figure
    is already a median), torch's GPU backend and transformers required."""

    unit = "ratio"
    timeout = 900       # (the static cache's warm-up compiles the model twice)
    rounds = 1

    def setup(self, *params):
        require_gpu_backend("torch")
        require_transformers()

    def teardown(self, *params):
        self.models = None


class GenerateRatio(_LlamaRatio):
    """flashcore's tokens/s over "sdpa"'s, greedy generate (see the module docstring)."""

    params = [["dynamic", "dynamic_new_lengths", "static"], ["1x512", "8x2048"]]
    param_names = ["cache", "batch_x_prompt"]

    def setup(self, cache, shape):
        super().setup()
        batch, prompt = _shape(shape)
        self.batch, self.prompt = batch, prompt
        self.new = 64 if cache == "static" else 128
        self.models, self.ids, self.kw, _ = generate_setup(_IMPLS, batch, prompt, self.new,
                                                           static=cache == "static")

    def track_ratio(self, cache, shape):
        if cache == "dynamic_new_lengths":
            times = generate_new_length_rounds(self.models, self.batch, self.prompt, self.new,
                                               self.kw, 3)
        else:
            times, _ = generate_rounds(self.models, self.ids, self.kw, 5)
        return speed_ratio(times, "flashcore", "sdpa")


class PrefillRatio(_LlamaRatio):
    """flashcore's prefill speed over "sdpa"'s under a 2D mask (see the module docstring)."""

    params = [["all_ones", "left_padded"], ["1x512", "8x2048"]]
    param_names = ["mask", "batch_x_prompt"]

    def setup(self, mask, shape):
        super().setup()
        batch, prompt = _shape(shape)
        self.models = {impl: llama_model(impl).eval() for impl in _IMPLS}
        self.ids = generate_ids(batch, prompt)
        self.mask = prefill_mask(batch, prompt, mask == "left_padded")

    def track_ratio(self, mask, shape):
        return speed_ratio(prefill_rounds(self.models, self.ids, self.mask, 7), "flashcore",
                           "sdpa")


class TrainStepRatio(_LlamaRatio):
    """"sdpa"'s ms a training step over flashcore's (see the module docstring)."""

    params = [["eager", "compiled"], ["1x16384", "4x4096"]]
    param_names = ["mode", "batch_x_seqlen"]

    def track_ratio(self, mode, shape):
        import torch
        batch, seqlen = _shape(shape)
        ms = {}
        for impl in _IMPLS:
            torch._dynamo.reset()
            model = llama_model(impl)
            ms[impl], _, _ = train_step_ms(model, batch, seqlen, compiled=mode == "compiled")
            del model
            torch.cuda.empty_cache()
        return ms["sdpa"] / ms["flashcore"]
