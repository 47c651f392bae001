"""A tiny BERT for CPU: the README's main job and the tests.

Same architecture as BERT-base (post-LN, GELU, tied MLM decoder, NSP head) at 2 layers,
width 128, 2 heads (the shape of Turc et al. 2019's BERT-Tiny), with a small vocabulary.

  bertjax info --config configs/bert_tiny.py
"""

from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2,
                                  mlp_dim=512, max_positions=128))
  config.batch_size = 32
  config.seq_length = 128
  config.max_predictions = 20
  config.num_train_steps = 300
  config.log_every = 25
  config.eval_every = 100
  config.eval_steps = 4
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 30
  return config
