"""GPT-3 (Brown et al. 2020, "Language Models are Few-Shot Learners"), Table 2.1, one size per
variant: `--config configs/gpt3.py:size=13b` (sizes 125m, 350m, 760m, 1p3b, 2p7b, 6p7b, 13b;
1.3b, 2.7b and 6.7b are accepted too).

Table 2.1 (parameters, layers, d_model, heads x head dim, batch tokens, learning rate), and
the Cloud TPU slice each size is planned for here:

  size  GPT-3 name    params  layers  d_model  heads      batch  lr       slice    ramp from
  125m  GPT-3 Small   125M    12       768     12 x 64    0.5M   6.0e-4   v4-32     16 (32K)
  350m  GPT-3 Medium  350M    24      1024     16 x 64    0.5M   3.0e-4   v4-64     32 (64K)
  760m  GPT-3 Large   760M    24      1536     16 x 96    0.5M   2.5e-4   v4-64     32 (64K)
  1p3b  GPT-3 XL      1.3B    24      2048     24 x 128   1M     2.0e-4   v5p-64    32 (64K)
  2p7b  GPT-3 2.7B    2.7B    32      2560     32 x 80    1M     1.6e-4   v5p-128   64 (128K)
  6p7b  GPT-3 6.7B    6.7B    32      4096     32 x 128   2M     1.2e-4   v5p-256  128 (256K)
  13b   GPT-3 13B     13B     40      5140     40 x 128   2M     1.0e-4   v5p-512  256 (512K)

App. B, every size: Adam β (0.9, 0.95), ε 1e-8, global clip 1.0, weight decay 0.1, warmup over
the first 375M tokens, cosine decay to 10% over 260B tokens, 300B tokens in all; context 2048,
GPT-2's vocabulary (50,257), d_ff = 4 x d_model; batch 0.5M tokens = 256 sequences of 2048.
The batch-size ramp ("from a small value (32k tokens) to the full value over the first 4-12
billion tokens of training, depending on the model size"): over the first 4B tokens for every
size here (the paper gives no size-by-size figure), from the "ramp from" sequences (tokens) in
steps of as many: 32K tokens is 16 sequences, and a stage's batch must spread over the slice's
data-parallel devices, so the larger slices start at one sequence per device (a larger start
than the paper's). Steps are those that consume 300B tokens with the ramp; the learning-rate
schedule counts tokens (bertjax.config.ramp). Not reproduced: the alternating dense and
locally banded sparse attention layers (every layer is dense here). Two rows of the table do not add up, and this config
uses what the model must have: XL's 24 heads of 128 are 3072, not d_model 2048, so it has 16
heads of 128 (as Megatron-LM's GPT-3 1.3B; the parameter count does not depend on it), and
13B's d_model is printed as 5140 where 40 heads x 128 = 5120 (what every reproduction uses).

Each size also carries the settings with which `bertjax compile` fits it into its slice
(`memory_saving`: ZeRO-3 over all chips, bf16 compute with fp32 master weights, remat of
everything but matmul outputs, and the micro-batches in SIZES below); the measured memory
and projected time per slice are in docs/reproducing.md, generated from the compile reports
checked in under docs/compile_reports/.

  bertjax compile --config configs/gpt3.py:size=13b --topology v5p-512
  python launch/tpu_vm.py up --name gpt3-13b --zone ZONE --tpu-type v5p-512 --bucket BUCKET \
      -- bertjax train --config configs/gpt3.py:size=13b --workdir /gcs/BUCKET/gpt3_13b \
      --config.data.dataset=/gcs/BUCKET/web_text
  bertjax train --config configs/gpt3.py:size=13b,runlocal --workdir runs/gpt3_local  # CPU
"""

import common
from bertjax.config import base_config, choose, gpt_model, parse_arg
from bertjax.reproduction import Contract, Target

# size: (layers, d_model, heads, batch tokens, learning rate, the paper's parameter count,
#        micro-batches that make a step fit the size's slice, the ramp's first batch and
#        increment in sequences: 16 (32K tokens) or one per device of the slice).
SIZES = {
    "125m": (12, 768, 12, 524_288, 6e-4, 125_000_000, 2, 16),
    "350m": (24, 1024, 16, 524_288, 3e-4, 350_000_000, 4, 32),
    "760m": (24, 1536, 16, 524_288, 2.5e-4, 760_000_000, 4, 32),
    "1p3b": (24, 2048, 16, 1_048_576, 2e-4, 1_300_000_000, 2, 32),
    "2p7b": (32, 2560, 32, 1_048_576, 1.6e-4, 2_700_000_000, 2, 64),
    "6p7b": (32, 4096, 32, 2_097_152, 1.2e-4, 6_700_000_000, 4, 128),
    "13b": (40, 5120, 40, 2_097_152, 1e-4, 13_000_000_000, 2, 256),
}
# Every config this file makes (the tests load each).
VARIANTS = tuple(f"size={size}" for size in SIZES)


def get_config(arg=None):
  size = parse_arg(arg, size="").size.replace(".", "p")  # 1.3b -> 1p3b
  layers, width, heads, batch_tokens, lr, params, micro_batches, ramp_start = choose(
      SIZES, "size", size)
  config = base_config(gpt_model(num_layers=layers, hidden_size=width, num_heads=heads,
                                 mlp_dim=4 * width, max_positions=2048))
  common.gpt3_training(config, batch_tokens=batch_tokens, learning_rate=lr,
                       ramp_start=ramp_start)
  # A step as written does not fit the size's slice; these settings make it (docs/reproducing.md).
  common.memory_saving(config, grad_accum_steps=micro_batches)
  config.reference_params = params
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    **{f"size={size}": Contract(
        paper="Brown et al. 2020",
        targets=(
            Target("HellaSwag accuracy (zero-shot)", hellaswag, "Brown et al. 2020 as "
                   "karpathy/llm.c dev/vislog.ipynb lists it ('hella3_baseline = { # for "
                   f"GPT-3', key '{key}': {hellaswag})", note),
        )) for size, key, hellaswag, note in (
            ("125m", "124M", 0.337, ""), ("350m", "350M", 0.436, ""),
            ("760m", "774M", 0.510, "the notebook keys GPT-3 Large by GPT-2's size name"),
            ("1p3b", "1558M", 0.547, "the notebook keys GPT-3 XL by GPT-2's size name"))},
    **{f"size={size}": Contract(
        paper="Brown et al. 2020",
        targets=(
            Target("LAMBADA accuracy (zero-shot)", lambada, "Brown et al. 2020, as "
                   "kingoflolz/mesh-transformer-jax README.md's zero-shot table reports it "
                   f"(rows the authors reported): '{row}'", f"LAMBADA perplexity {ppl}"),
            Target("HellaSwag accuracy (zero-shot)", hellaswag, "the same row"),
        )) for size, lambada, ppl, hellaswag, row in (
            ("2p7b", 0.671, 4.60, 0.628, "GPT-3-2.7B | 4.60 | 67.1% | 62.3% | 62.8%"),
            ("6p7b", 0.703, 4.00, 0.674, "GPT-3-6.7B | 4.00 | 70.3% | 64.5% | 67.4%"),
            ("13b", 0.725, 3.56, 0.709, "GPT-3-13B | 3.56 | 72.5% | 67.9% | 70.9%"))},
}
