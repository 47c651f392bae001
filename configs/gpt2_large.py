"""GPT-2 large (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Paper, Table 2 (sizes as corrected in the released checkpoints): 36 layers, d_model 1280,
20 heads, 774M parameters; byte-level BPE vocabulary 50257, context 1024, pre-LN with a final
LayerNorm, residual projections initialised with std 0.02/sqrt(2·layers).

  bertjax info --config configs/gpt2_large.py
"""

from bertjax.config import base_config, gpt_model


def get_config():
  config = base_config(gpt_model(num_layers=36, hidden_size=1280, num_heads=20, mlp_dim=4 * 1280))
  config.reference_params = 774_000_000
  return config
