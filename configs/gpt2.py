"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), one size
per variant: `--config configs/gpt2.py:size=xl` (sizes small, medium, large, xl).

Paper, Table 2 (layers, d_model; parameters as the paper prints them and as the released
checkpoints have them), heads from the released models, and the Cloud TPU slice each size is
planned for here:

  size    layers  d_model  heads  paper  released  lr (GPT-3's nearest size)  slice
  small   12       768     12     117M   124M      6.0e-4                     v4-32
  medium  24      1024     16     345M   355M      3.0e-4                     v4-64
  large   36      1280     20     762M   774M      2.5e-4                     v5p-64
  xl      48      1600     25     1542M  1558M     2.0e-4                     v5p-64

Every size: byte-level BPE vocabulary 50,257, context 1024, batch 512 sequences (524,288
tokens), pre-LN with a final LayerNorm, residual projections initialised with std
0.02/sqrt(2 x layers), d_ff = 4 x d_model. The paper gives no learning rate ("manually tuned")
nor step count: this config takes GPT-3's recipe for the nearest size (Brown et al. 2020, Table
2.1: the rates above; Adam β2 0.95, clip 1.0, weight decay 0.1, warmup 375M tokens, cosine to
10%) and nanoGPT's reproduction length, 600K steps (~300B tokens).

Each size also carries the settings with which `bertjax compile` fits it into its slice
(`memory_saving`: ZeRO-3 over all chips, bf16 compute with fp32 master weights, remat of
everything but matmul outputs, and the micro-batches in SIZES below); the measured memory and
projected time per slice are in docs/reproducing.md, generated from the compile reports checked
in under docs/compile_reports/.

  bertjax compile --config configs/gpt2.py:size=small --topology v4-32
  python launch/tpu_vm.py up --name gpt2-small --zone ZONE --tpu-type v4-32 --bucket BUCKET \
      -- bertjax train --config configs/gpt2.py:size=small --workdir /gcs/BUCKET/gpt2_small \
      --config.data.dataset=/gcs/BUCKET/web_text
  bertjax train --config configs/gpt2.py:size=xl,runlocal --workdir runs/gpt2_local  # CPU
"""

import common
from bertjax.config import base_config, choose, gpt_model, parse_arg

# size: (layers, d_model, heads, learning rate, the released checkpoint's parameter count,
#        micro-batches that make a step fit the size's slice).
SIZES = {
    "small": (12, 768, 12, 6e-4, 124_000_000, 2),
    "medium": (24, 1024, 16, 3e-4, 355_000_000, 2),
    "large": (36, 1280, 20, 2.5e-4, 774_000_000, 1),
    "xl": (48, 1600, 25, 2e-4, 1_558_000_000, 2),
}
# Every config this file makes (the tests load each).
VARIANTS = tuple(f"size={size}" for size in SIZES)


def get_config(arg=None):
  size = parse_arg(arg, size="").size
  layers, width, heads, lr, params, micro_batches = choose(SIZES, "size", size)
  config = base_config(gpt_model(num_layers=layers, hidden_size=width, num_heads=heads,
                                 mlp_dim=4 * width))
  common.gpt2_training(config, learning_rate=lr)
  # A step as written does not fit the size's slice; these settings make it (docs/reproducing.md).
  common.memory_saving(config, grad_accum_steps=micro_batches)
  config.reference_params = params
  return config
