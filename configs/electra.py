"""ELECTRA (Clark et al. 2020, "ELECTRA: Pre-training Text Encoders as Discriminators Rather
Than Generators"), one size per variant: `--config configs/electra.py:size=small` (small, base,
large; tiny: a CPU-sized ELECTRA for docs/models.md's RTD-vs-MLM experiment;
`objective=mlm`: the same discriminator shape pre-trained by MLM alone).

Replaced-token detection: a generator (an MLM encoder whose width, MLP and heads are a fraction
of the discriminator's, at the same depth) fills 15% masked positions (25% for Large; of them
85% get [MASK], 15% keep their token, none a random one) with samples from its output at
temperature 1 (the original may be drawn, and then counts as original); the discriminator
labels every token original or replaced; loss = generator MLM + 50 × discriminator.
Generator and discriminator share the token, position and token-type embeddings and their
LayerNorm (ELECTRA's `embeddings` scope), of width `embedding_size` (Small: 128), each
projecting them to its own hidden size. BERT's uncased WordPiece vocabulary (30,522), 512
positions, GELU, post-LN, no NSP.

Table 6 (pre-training hyper-parameters) and Table 1 (sizes):

  size   layers  width  FFN    heads  embed  generator  mask  lr    batch  steps  seq  params
  small  12      256    1024   4      128    1/4        15%   5e-4  128    1M     128  14M
  base   12      768    3072   12     768    1/3        15%   2e-4  256    766K   512  110M
  large  24      1024   4096   16     1024   1/4        25%   2e-4  2048   400K   512  335M

Adam β (0.9, 0.999), ε 1e-6, weight decay 0.01 (not on biases and LayerNorms), 10,000 warmup
steps then linear decay to 0, gradient clipping at global norm 1.0, dropout 0.1 (attention
too), λ = 50 (google-research/electra's configure_pretraining.py and optimization.py). The
parameter counts are the discriminator's (what is fine-tuned), rounded by the paper: 14M is
13,549,057 here (to the million), 110M is 109,483,009 (to ten million), 335M is 335,142,913 -
transformers' ElectraForPreTraining counts exactly. The released checkpoints differ from the
paper's table: Small++ (4M steps, a full-size generator), Large trained 1.75M steps
(`--config.num_train_steps=1750000`).

Masks are drawn when the data is read, a new one every epoch (data.dupe_factor=0), where
ELECTRA draws them in the graph every step: the same distribution.

  bertjax compile --config configs/electra.py:size=small --topology v5e-8
  bertjax compile --config configs/electra.py:size=base --topology v4-16
  bertjax compile --config configs/electra.py:size=large --topology v4-128
  bertjax train --config configs/electra.py:size=base --workdir /gcs/BUCKET/electra_base \
      --config.data.dataset=/gcs/BUCKET/wiki_books
  bertjax train --config configs/electra.py:size=tiny --workdir runs/electra_tiny  # CPU
"""

import common
from bertjax.config import base_config, bert_model, choose, parse_arg
from bertjax.reproduction import Contract, Target, golden_contracts

# size: (layers, width, FFN, heads, embedding width, generator fraction, mask fraction, peak
#        lr, batch, steps, sequence length, the paper's (discriminator) parameter count).
SIZES = {
    "small": (12, 256, 1024, 4, 128, 1 / 4, 0.15, 5e-4, 128, 1_000_000, 128, 14_000_000),
    "base": (12, 768, 3072, 12, 768, 1 / 3, 0.15, 2e-4, 256, 766_000, 512, 110_000_000),
    "large": (24, 1024, 4096, 16, 1024, 1 / 4, 0.25, 2e-4, 2048, 400_000, 512, 335_000_000),
    # BERT-Tiny's discriminator (2 x 128, 2 heads) with a 32-wide generator: minutes on CPU.
    "tiny": (2, 128, 512, 2, 128, 1 / 4, 0.15, 1e-3, 32, 300, 128, 0),
}
OBJECTIVES = ("rtd", "mlm")
# Every config this file makes (the tests load each).
VARIANTS = tuple(f"size={size}" for size in SIZES) + ("size=tiny,objective=mlm",)


def electra_model(layers: int, width: int, ffn: int, heads: int, embedding: int,
                  generator_fraction: float | None):
  """The `model` group of an ELECTRA discriminator and, with a fraction, its generator."""
  generator = {}
  if generator_fraction:
    generator = dict(generator_hidden_size=round(width * generator_fraction),
                     generator_num_heads=max(1, round(heads * generator_fraction)),
                     generator_mlp_dim=round(ffn * generator_fraction),
                     embedding_sharing="shared")
  return bert_model(
      vocab_size=30_522, hidden_size=width, num_layers=layers, num_heads=heads, mlp_dim=ffn,
      max_positions=512, type_vocab_size=2, norm_position="post", activation="gelu",
      layer_norm_eps=1e-12, hidden_dropout=0.1, attention_dropout=0.1, architecture="electra",
      embedding_size=embedding if embedding != width else 0, pooler=False, **generator)


def get_config(arg=None):
  arg = parse_arg(arg, size="", objective="rtd")
  (layers, width, ffn, heads, embedding, fraction, mask, lr, batch, steps, seq,
   params) = choose(SIZES, "size", arg.size)
  objective = choose({o: o for o in OBJECTIVES}, "objective", arg.objective)
  config = base_config(electra_model(layers, width, ffn, heads, embedding,
                                     fraction if objective == "rtd" else None))
  config.objective = objective
  config.discriminator_weight = 50.0
  config.data.bert_instances = "full_sentences"
  config.data.mask_prob = mask
  config.data.mask_token_prob = 0.85
  config.data.random_token_prob = 0.0
  config.data.dupe_factor = 0  # a new mask every time a sequence is seen
  if arg.size == "tiny":
    common.tiny_cpu_training(config, batch_size=batch)
    config.max_predictions = 20
    config.model.vocab_size = 8192
    config.model.max_positions = 128
    return config
  config.batch_size = batch
  config.seq_length = seq
  config.max_predictions = round(mask * seq)
  config.num_train_steps = steps
  config.optimizer.update(dict(name="adamw", learning_rate=lr, warmup_steps=10_000,
                               schedule="linear", b1=0.9, b2=0.999, eps=1e-6,
                               weight_decay=0.01, clip_norm=1.0))
  config.checkpoint.every = 10_000
  config.log_every = 100
  if arg.size == "large":
    # A v4-128's chips do not hold the step as written (54.2 GiB of 30.8 in float32 without
    # remat, docs/compile_reports/); these settings make it fit.
    common.memory_saving(config)
  config.reference_params = params
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    **{f"size={size}": Contract(
        paper="Clark et al. 2020",
        targets=(
            Target("GLUE test score", glue, "google-research/electra README.md, Released "
                   f"Models: '{row}'", f"the released {released} (not this config's "
                   "step count)"),
            Target("MNLI dev accuracy (median of runs)", mnli, "google-research/electra "
                   "README.md, Expected Results", f"the released {released}"),
        )) for size, glue, mnli, released, row in (
            ("small", 77.4, 81.3, "ELECTRA-Small++ (4M steps)",
             "ELECTRA-Small | 12 | 256 | 14M | 77.4"),
            ("base", 82.7, 88.8, "ELECTRA-Base++", "ELECTRA-Base | 12 | 768 | 110M | 82.7"),
            ("large", 85.2, 90.9, "ELECTRA-1.75M", "ELECTRA-Large | 24 | 1024 | 335M | 85.2"))},
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "electra:size=small,runlocal"),
}
