"""BERT-base (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers").

Paper, Table/Sec. 3 and App. A.2: L=12, H=768, A=12, 110M parameters; WordPiece vocabulary
30522; 512 positions; 2 segment types; GELU; dropout 0.1; post-LN with eps 1e-12.

  bertjax info --config configs/bert_base.py
"""

from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model())
  config.reference_params = 110_000_000
  return config
