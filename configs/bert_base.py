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
from bertjax.reproduction import Contract, Point, Target, golden_contracts


def get_config():
  config = base_config(bert_model())
  common.bert_paper_training(config)
  config.reference_params = 110_000_000
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="Devlin et al. 2019",
        targets=(
            Target("GLUE test average (no WNLI)", 79.6, "Devlin et al. 2019, Table 1: "
                   "'BERT BASE 84.6/83.4 71.2 90.5 93.5 52.1 85.8 88.9 66.4 79.6'"),
            Target("SQuAD v1.1 dev F1", 88.5, "google-research/bert README.md: 'similar to "
                   "the 88.5% reported in the paper for BERT-Base'"),
        ),
        points=(
            # 900K steps of 256 x 128 and 100K of 256 x 512: 42.6B token positions. "Around
            # -1.4" is read to its one decimal: the band is +-0.1.
            Point(42_598_400_000, "mlm_loss", 1.4, 1.3, 1.5,
                  "github.com/google-research/bert/issues/90 (Devlin): 'the held-out natural "
                  "log likelihood for BERT-Base was around -1.4'"),
        ),
        conditions="held-out Wikipedia + BooksCorpus, uncased 30,522-piece WordPiece"),
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "bert_base:runlocal"),
}
