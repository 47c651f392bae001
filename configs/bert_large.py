"""BERT-large (Devlin et al. 2019).

Paper: L=24, H=1024, A=16, MLP 4096, "340M" parameters (the released checkpoint's pre-training
model has 336.2M; the paper rounds to two significant figures). Training as BERT-base: batch 256,
1M steps, Adam lr 1e-4 (0.9, 0.999), weight decay 0.01, warmup 10k, linear decay, dropout 0.1,
90% of the steps at 128 tokens and the last 10% at 512 (phase 2 from step 900,000, switched by
the run itself). Paper hardware: 16 Cloud TPUs (64 TPU chips), 4 days.

  bertjax compile --config configs/bert_large.py --topology v4-64 --step 900000  # phase 2
  python launch/tpu_vm.py up --name bert-large --zone us-central2-b --tpu-type v4-64 \
      --bucket BUCKET -- bertjax train --config configs/bert_large.py \
      --workdir /gcs/BUCKET/bert_large --config.data.dataset=/gcs/BUCKET/wiki_books
"""

import common
from bertjax.config import base_config, bert_model
from bertjax.reproduction import Contract, Target


def get_config():
  config = base_config(bert_model(hidden_size=1024, num_layers=24, num_heads=16, mlp_dim=4096))
  common.bert_paper_training(config)
  config.reference_params = 340_000_000
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="Devlin et al. 2019",
        targets=(
            Target("GLUE test average (no WNLI)", 82.1, "Devlin et al. 2019, Table 1: "
                   "'BERT LARGE 86.7/85.9 72.1 92.7 94.9 60.5 86.5 89.3 70.1 82.1'"),
            Target("SQuAD v1.1 dev F1", 91.0, "google-research/bert README.md, 'BERT-Large, "
                   "Uncased (Original) | 91.0/84.3 | 86.05'", "the released model; EM 84.3"),
            Target("MNLI accuracy", 86.05, "google-research/bert README.md, the same row"),
            Target("masked-LM accuracy (MLPerf)", 0.720, "mlcommons/training "
                   "retired_benchmarks/bert/README.md: 'a masked lm accuracy >= 0.720'",
                   "phase 2 from MLPerf's checkpoint (0.34085 before training), eval_10k"),
        )),
}
