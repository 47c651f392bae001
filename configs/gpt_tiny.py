"""A tiny GPT-2-style decoder for CPU: the tests and quick experiments.

GPT-2 architecture (pre-LN, final LayerNorm, tanh-GELU, tied LM head, 1/sqrt(2L) residual init)
at 2 layers, width 128, 4 heads, context 128, vocabulary 8192.

  bertjax info --config configs/gpt_tiny.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  return base_config(gpt_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
                               mlp_dim=512, max_positions=128))
