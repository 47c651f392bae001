"""A tiny GPT-2-style decoder for CPU: the tests and quick experiments.

GPT-2 architecture (pre-LN, final LayerNorm, tanh-GELU, tied LM head, 1/sqrt(2L) residual init)
at 2 layers, width 128, 4 heads, context 128, vocabulary 8192; batch 16 x 128 tokens,
300 steps, AdamW (0.9, 0.95) lr 1e-3, warmup 30, cosine to 10%, weight decay 0.1.

  bertjax train --config configs/gpt_tiny.py --workdir runs/gpt_tiny
"""

import common
from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
                                 mlp_dim=512, max_positions=128))
  common.tiny_cpu_training(config, batch_size=16)
  # GPT-3's optimizer shape (Brown et al. 2020, App. B), scaled down.
  config.optimizer.schedule = "cosine"
  config.optimizer.end_lr_fraction = 0.1
  config.optimizer.b2 = 0.95
  config.optimizer.weight_decay = 0.1
  return config
