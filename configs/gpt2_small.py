"""GPT-2 small (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2 (sizes as corrected in the released checkpoints): 12 layers, d_model 768,
12 heads, 124M parameters; byte-level BPE vocabulary 50257, context 1024, pre-LN with a final
LayerNorm, residual projections initialised with std 0.02/sqrt(2·layers).

  bertjax info --config configs/gpt2_small.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(num_layers=12, hidden_size=768, num_heads=12, mlp_dim=4 * 768))
  config.reference_params = 124_000_000
  return config
