"""A tiny BERT for CPU: the README's main job and the tests.

Same architecture as BERT-base (post-LN, GELU, tied MLM decoder, NSP head) at 2 layers,
width 128, 2 heads (the shape of Turc et al. 2019's BERT-Tiny), with a small vocabulary;
batch 32 x 128 tokens, 300 steps, AdamW lr 1e-3 with 30 warmup steps (about 5 minutes on
2 CPU cores).

  bertjax train --config configs/bert_tiny.py --workdir runs/bert_tiny
"""

import common
from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2,
                                  mlp_dim=512, max_positions=128))
  return common.tiny_cpu_training(config, batch_size=32)
