"""BERT's two-phase schedule (Devlin et al. 2019, App. A.2) in miniature, for CPU.

The paper trains 90% of the steps at sequence length 128 and the last 10% at 512 "to learn the
positional embeddings"; here the tiny BERT of configs/bert_tiny.py trains 240 steps at 64 tokens
and the last 60 at 128 (the phase-2 share is larger than the paper's so that it is visible in a
short run), with google-research/bert's max_predictions_per_seq scaled alike (10 -> 20). The
run switches phase by itself and a resume in either phase continues the same batches.

  bertjax train --config configs/bert_tiny_two_phase.py --workdir runs/bert_tiny_two_phase
"""

import common
from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2,
                                  mlp_dim=512, max_positions=128))
  common.tiny_cpu_training(config, batch_size=32)
  config.seq_length = 64
  config.max_predictions = 10
  config.phase2.start_step = 240
  config.phase2.seq_length = 128
  config.phase2.max_predictions = 20
  return config
