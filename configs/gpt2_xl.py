"""GPT-2 xl (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2 (sizes as corrected in the released checkpoints): 48 layers, d_model 1600,
25 heads, 1558M parameters; byte-level BPE vocabulary 50257, context 1024, pre-LN with a final
LayerNorm, residual projections initialised with std 0.02/sqrt(2·layers).

  bertjax info --config configs/gpt2_xl.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(num_layers=48, hidden_size=1600, num_heads=25, mlp_dim=4 * 1600))
  config.reference_params = 1_558_000_000
  return config
