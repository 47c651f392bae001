"""BERT-base (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers").

Paper, Sec. 3 and App. A.2: L=12, H=768, A=12, 110M parameters; WordPiece vocabulary 30522;
512 positions; 2 segment types; GELU; dropout 0.1; post-LN with eps 1e-12. Training: batch 256
sequences, 1M steps (~40 epochs of 3.3B words), Adam lr 1e-4, β1 0.9, β2 0.999, L2 weight decay
0.01, warmup 10,000 steps then linear decay; 90% of the steps at sequence length 128, the rest at
512 — one run here: it switches to phase 2 at step 900,000 by itself (bertjax.config.phases).
Paper hardware: 4 Cloud TPUs in Pod configuration (16 TPU chips), 4 days.

  bertjax compile --config configs/bert_base.py --topology v4-16      # fits? how long?
  python launch/tpu_vm.py up --name bert-base --zone us-central2-b --tpu-type v4-16 \
      --bucket BUCKET -- bertjax train --config configs/bert_base.py \
      --workdir /gcs/BUCKET/bert_base --config.data.dataset=/gcs/BUCKET/wiki_books
"""

import common
from bertjax.config import base_config, bert_model


def get_config():
  config = base_config(bert_model())
  common.bert_paper_training(config)
  config.reference_params = 110_000_000
  return config
