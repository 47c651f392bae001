"""MosaicBERT (Portes et al., NeurIPS 2023, "MosaicBERT: A Bidirectional Encoder Optimized for
Fast Pretraining"): BERT-base's shape with FlashAttention, ALiBi, gated linear units,
unpadding, bf16 and a 30% masking rate; 79.6 average GLUE (dev) after 1.13 hours on 8 A100-80GB.

Architecture (mosaicml/examples, benchmarks/bert/src/bert_layers.py): post-LN (eps 1e-12);
word and token-type embeddings, no position table (ALiBi: a penalty -slope_h |i - j| per head,
the reference slopes); a GeGLU MLP with half-width 3,072 whose gate projection has no bias;
attention projections with biases; dropout 0.1 on embeddings and residual branches, none on
attention probabilities; vocabulary 30,528 (30,522 padded to a multiple of 8); no NSP and no
pooler in the MLM model (137M parameters).

Pre-training (yamls/main/mosaic-bert-base-uncased.yaml): 70,000 steps of 4,096 x 128 tokens
(C4), 30% masking, decoupled AdamW lr 5e-4, β (0.9, 0.98), ε 1e-6, weight decay 1e-5 (per
step at the peak rate; 0.02 here, in optax's convention of a multiple of the rate), linear
warmup over 6% of the run (4,200 steps) then linear decay to 0.02 x peak, bf16.

What differs here, stated rather than hidden: the unpadded instances are packed rows
(data.bert_instances=packed: several documents per row, none attending to another) where
MosaicBERT removes padding token by token inside the model; the MLP's output projection has no
bias either (model.mlp_bias covers both projections: 9,216 parameters fewer); weight decay
skips biases and norms (MosaicBERT decays everything); dropout on the MLP comes after its
output projection (MosaicBERT's before it); fine-tuning puts a fresh dense + GELU + LayerNorm
head on [CLS] where MosaicBERT's classifier has a fresh tanh pooler.

  bertjax compile --config configs/mosaicbert.py --topology v4-32
  bertjax train --config configs/mosaicbert.py --workdir /gcs/BUCKET/mosaicbert \
      --config.data.dataset=/gcs/BUCKET/c4
"""

import common
from bertjax.config import base_config, bert_model
from bertjax.reproduction import Contract, Target


def get_config():
  config = base_config(bert_model(
      vocab_size=30_528, max_positions=512, position_embedding="alibi", mlp_gated=True,
      mlp_bias=False, pooler=False, attention_dropout=0.0))
  config.objective = "mlm"
  config.data.bert_instances = "packed"
  config.data.mask_prob = 0.30
  config.data.dupe_factor = 0  # a new mask every time a sequence is seen
  config.batch_size = 4_096
  config.seq_length = 128
  config.max_predictions = 40  # 30% of 128
  config.num_train_steps = 70_000
  config.optimizer.update(dict(name="adamw", learning_rate=5e-4, warmup_steps=4_200,
                               schedule="linear", end_lr_fraction=0.02, b1=0.9, b2=0.98,
                               eps=1e-6, clip_norm=0.0,
                               # Composer's decoupled decay: 1e-5 of the weights per step at
                               # the peak rate; optax's adamw multiplies by the rate.
                               weight_decay=1e-5 / 5e-4))
  config.checkpoint.every = 5_000
  common.memory_saving(config, zero3=True)
  config.reference_params = 137_000_000
  return config


# What the paper reports (docs/reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    "": Contract(
        paper="Portes et al. 2023",
        targets=(
            Target("GLUE dev average, the 70K-step model", 84.28, "mosaicml/mosaic-bert-base "
                   "model card: '| 0.8495 | 0.9029 | 0.9074| 0.9246 | 0.5511 | 0.8927 | 0.9003 | "
                   "0.8136 | 0.8428 |'", "averaged over 5 pre-training seeds"),
            Target("GLUE dev average", 79.6, "Portes et al. 2023 (arXiv 2312.17482), "
                   "abstract: 'a downstream average GLUE (dev) score of 79.6 in 1.13 hours on "
                   "8 A100 80 GB GPUs'", "C4, 30% masking; the 1.13 h run, not all 70K steps"),
        )),
}
