"""GPT-2 medium (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2 (sizes as corrected in the released checkpoints): 24 layers, d_model 1024,
16 heads, 355M parameters; byte-level BPE vocabulary 50257, context 1024, pre-LN with a final
LayerNorm, residual projections initialised with std 0.02/sqrt(2·layers).

  bertjax info --config configs/gpt2_medium.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(num_layers=24, hidden_size=1024, num_heads=16, mlp_dim=4 * 1024))
  config.reference_params = 355_000_000
  return config
