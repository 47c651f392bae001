"""T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer"), pre-trained by span corruption: `--config configs/t5.py:size=base` (sizes small,
base, large, 3b, 11b: T5 1.0; `version=1.1` for T5 1.1's layout and sizes small, base, large,
xl, xxl) and `size=tiny` for CPU.

T5 1.0, Section 3.7 and the released checkpoints (layers per stack, d_model, d_ff, heads x
d_kv; parameters as transformers counts the released checkpoints):

  size    layers  d_model  d_ff    heads x d_kv  params          slice
  small   6        512     2048      8 x 64        60,506,624    v4-8
  base    12       768     3072     12 x 64       222,903,552    v4-16
  large   24      1024     4096     16 x 64       737,668,096    v4-32
  3b      24      1024    16384     32 x 128    2,851,598,336    v5p-64
  11b     24      1024    65536    128 x 128   11,307,321,344    v5p-256

ReLU MLP, dropout 0.1, the decoder's output scaled by d_model ** -0.5 before the LM head tied to
the token table. Every size is compiled for its slice with the micro-batches in SIZES (the
reports under docs/compile_reports/, the table in docs/reproducing.md). T5 1.1
(google-research/text-to-text-transfer-transformer's released_checkpoints.md): gated GeLU, no
output scaling, no dropout in pre-training; its head is untied there, but transformers 5 ties
every T5's head (bertjax/hf/t5.py), so these configs tie it; their counts are transformers' for
the tied model (the released ones less the head's 32,128 x d_model):

  size    layers  d_model  d_ff    heads x d_kv  params (tied)   slice
  small   8        512     1024      6 x 64        60,511,616    v4-8
  base    12       768     2048     12 x 64       222,903,552    v4-16
  large   24      1024     2816     16 x 64       750,251,008    v4-32
  xl      24      2048     5120     32 x 64     2,783,959,040    v5p-64
  xxl     24      4096    10240     64 x 64    11,003,736,064    v5p-256

Pre-training, every size (Sections 3.1.2, 3.1.4, 3.7): span corruption with noise density 0.15
and mean span length 3 (inputs 512 tokens, targets 114: `t5_lengths`, no padding), a batch of
2,048 sequences, 1M steps (~1T tokens), Adafactor with the inverse square root schedule (0.01 for
10,000 steps, then 1/sqrt(step)), vocabulary 32,000 SentencePiece pieces + 100 sentinels, padded
to 32,128.

  bertjax compile --config configs/t5.py:size=base --topology v4-16
  python launch/tpu_vm.py up --name t5-base --zone ZONE --tpu-type v4-16 --bucket BUCKET \
      -- bertjax train --config configs/t5.py:size=base --workdir /gcs/BUCKET/t5_base \
      --config.data.dataset=/gcs/BUCKET/c4
  bertjax train --config configs/t5.py:size=base,runlocal --workdir runs/t5_local  # CPU
  bertjax train --config configs/t5.py:size=tiny --workdir runs/t5_tiny  # CPU, minutes
"""

import common
from bertjax.config import base_config, choose, parse_arg, t5_model
from bertjax.reproduction import Contract, Target, golden_contracts

# size: (layers per stack, d_model, d_ff, heads, d_kv, parameters, micro-batches).
SIZES = {
    "small": (6, 512, 2048, 8, 64, 60_506_624, 4),
    "base": (12, 768, 3072, 12, 64, 222_903_552, 4),
    "large": (24, 1024, 4096, 16, 64, 737_668_096, 8),
    "3b": (24, 1024, 16384, 32, 128, 2_851_598_336, 4),
    "11b": (24, 1024, 65536, 128, 128, 11_307_321_344, 8),
}
SIZES_1_1 = {
    "small": (8, 512, 1024, 6, 64, 60_511_616, 4),
    "base": (12, 768, 2048, 12, 64, 222_903_552, 4),
    "large": (24, 1024, 2816, 16, 64, 750_251_008, 8),
    "xl": (24, 2048, 5120, 32, 64, 2_783_959_040, 4),
    "xxl": (24, 4096, 10240, 64, 64, 11_003_736_064, 8),
}
# Every config this file makes (the tests load each).
VARIANTS = (("size=tiny",) + tuple(f"size={size}" for size in SIZES)
            + tuple(f"size={size},version=1.1" for size in SIZES_1_1))


def get_config(arg=None):
  args = parse_arg(arg, size="", version="1.0")
  if args.size == "tiny":
    return tiny()
  v1_1 = args.version == "1.1"
  if args.version not in ("1.0", "1.1"):
    raise ValueError(f"version={args.version!r}: T5 1.0 or 1.1")
  layers, width, ff, heads, head_dim, params, micro_batches = choose(
      SIZES_1_1 if v1_1 else SIZES, "size", args.size)
  model = t5_model(num_layers=layers, hidden_size=width, mlp_dim=ff, num_heads=heads,
                   head_size=head_dim if heads * head_dim != width else 0)
  if v1_1:
    model.update(dict(activation="gelu_tanh", mlp_gated=True, scale_decoder_outputs=False,
                      hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
  config = base_config(model)
  common.t5_training(config)
  common.memory_saving(config, grad_accum_steps=micro_batches)
  config.reference_params = params
  return config


def tiny():
  """2 + 2 layers of width 128 (4 heads of 32, ReLU MLP 512), vocabulary 8,192 (8,092 pieces
  trained on the embedded sample + 100 sentinels), encoder 128 tokens (targets 29), batch 16,
  600 steps of AdamW at 1e-3 (Adafactor's defaults are tuned for T5's sizes), dropout 0.1."""
  config = base_config(t5_model(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=4,
                                mlp_dim=512, max_positions=128))
  common.tiny_cpu_training(config, batch_size=16)
  config.num_train_steps = 600
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    **{variant: Contract(paper="Raffel et al. 2020", missing=(
        "Table 14's per-size scores were not found in any source that could be read here; "
        "the base sizes and 11B have their own targets"))
       for variant in ("size=small", "size=large", "size=3b", "size=small,version=1.1",
                       "size=large,version=1.1", "size=xl,version=1.1",
                       "size=xxl,version=1.1")},
    "size=base": Contract(
        paper="Raffel et al. 2020",
        targets=(
            Target("C4 held-out log-perplexity after 65,536 steps", 1.997, "Shazeer 2020 "
                   "(GLU Variants Improve Transformer), Table 1, FFN_ReLU: 'ReLU (baseline) | "
                   "1.997'", "span corruption, T5-base's shape (d_ff 3,072)"),
            Target("GLUE average of the paper's baseline", 83.28, "Raffel et al. 2020, Table "
                   "9, 'Full data set 0 83.28 19.24 80.88 71.36 ...'", "base size, 2^35 tokens "
                   "of pre-training (not this config's 1M steps)"),
            Target("SuperGLUE average of the paper's baseline", 71.36, "the same row"),
        )),
    "size=base,version=1.1": Contract(
        paper="Raffel et al. 2020 (T5 1.1)",
        targets=(
            Target("C4 held-out log-perplexity after 65,536 steps", 1.942, "Shazeer 2020, "
                   "Table 1, FFN_GEGLU: '1.942 (0.004)'; PiotrNawrot/nanoT5 README.md: 'The T5 "
                   "v1.1 authors report 1.942 negative log-likelihood (NLL) on the held-out set "
                   "of C4 after after 2^16 steps'", "T5-base's shape with GEGLU (d_ff 2,048)"),
        )),
    "size=11b": Contract(
        paper="Raffel et al. 2020",
        targets=(
            Target("GLUE test average", 90.3, "Raffel et al. 2020, as notes on the paper "
                   "give it (thorbenlouw/the-story-of-llms-in-50-papers, T5 notes): 'GLUE: "
                   "90.3 average'"),
            Target("SuperGLUE test average", 88.9, "the same notes: 'SuperGLUE: 88.9 (near "
                   "human performance of 89.8)'", "the leaderboard shows 89.3 for a later "
                   "submission"),
        )),
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "t5:size=small,runlocal"),
}
