"""BERT-large (Devlin et al. 2019).

Paper: L=24, H=1024, A=16, "340M" parameters (the exact count of the released checkpoint's
pre-training model is 336.2M; the paper rounds to two significant figures); MLP 4096.

  bertjax info --config configs/bert_large.py
"""

from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096))
  config.reference_params = 340_000_000
  return config
