"""A tiny GPT-2-style decoder for CPU: the tests and quick experiments.

GPT-2 architecture (pre-LN, final LayerNorm, tanh-GELU, tied LM head, 1/sqrt(2L) residual init)
at 2 layers, width 128, 4 heads, context 128, vocabulary 8192.

  bertjax info --config configs/gpt_tiny.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
                                 mlp_dim=512, max_positions=128))
  config.batch_size = 16
  config.seq_length = 128
  config.num_train_steps = 300
  config.log_every = 25
  config.eval_every = 100
  config.eval_steps = 4
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 30
  config.optimizer.schedule = "cosine"
  config.optimizer.end_lr_fraction = 0.1
  config.optimizer.b2 = 0.95
  config.optimizer.weight_decay = 0.1
  return config
