"""BERT-large with LAMB at batch 64K/32K (You et al. 2020, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes"), in NVIDIA's published form of the recipe.

Paper: the mixed-batch run, 65,536 sequences at length 128 then 32,768 at 512, reaches SQuAD
v1.1 F1 90.58 in 8,599 iterations instead of 1M — 76 minutes on a TPU v3 Pod (1,024 chips).
NVIDIA DeepLearningExamples (the public recipe): phase 1 batch 65,536 x 128, lr 6e-3, 7,038
steps, warmup 28.43% (2,000 steps); phase 2 batch 32,768 x 512, lr 4e-3, 1,563 steps, warmup
12.8% (200 steps), the schedule restarted at the switch; LAMB β (0.9, 0.999), ε 1e-6, weight
decay 0.01 (not on LayerNorm and biases), global clip 1.0, polynomial decay with power 0.5.
Batches this large are reached by gradient accumulation inside the step.

  bertjax compile --config configs/bert_large_lamb.py --topology v3-2048
  python launch/tpu_vm.py up --name bert-lamb --zone europe-west4-a --tpu-type v3-2048 \
      --bucket BUCKET -- bertjax train --config configs/bert_large_lamb.py \
      --workdir /gcs/BUCKET/bert_lamb --config.data.dataset=/gcs/BUCKET/wiki_books
"""

import common
from bertjax.config import base_config, bert_model
from bertjax.reproduction import Contract, Target


def get_config():
  config = base_config(bert_model(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096))
  config.batch_size = 65_536
  config.seq_length = 128
  config.max_predictions = 20
  config.num_train_steps = 7_038 + 1_563
  config.optimizer.update(dict(name="lamb", learning_rate=6e-3, warmup_steps=2_000,
                               schedule="linear", power=0.5, b1=0.9, b2=0.999, eps=1e-6,
                               weight_decay=0.01, clip_norm=1.0))
  config.phase2.update(dict(start_step=7_038, seq_length=512, batch_size=32_768,
                            max_predictions=76, learning_rate=4e-3, warmup_steps=200))
  config.checkpoint.every = 500
  config.log_every = 10
  # A v3-2048's 16 GiB chips do not hold a step as written (docs/reproducing.md).
  common.memory_saving(config, grad_accum_steps=2)
  config.reference_params = 340_000_000
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="You et al. 2020",
        targets=(
            Target("SQuAD v1.1 F1", 90.584, "You et al. 2020 (LAMB), as in this project's "
                   "reference notes (shared/reference/bert-references.md, 2.2): '76 min on a "
                   "TPUv3 Pod (1,024 chips); SQuAD v1.1 F1 90.584'"),
            Target("pre-training loss at the end (NVIDIA's recipe)", 1.2437, "NVIDIA "
                   "DeepLearningExamples BERT README, as in shared/reference/bert-references.md "
                   "2.1: '32x DGX A100: 1.2 h, final loss 1.2437'", "MLM + NSP at 512 tokens"),
        )),
}
