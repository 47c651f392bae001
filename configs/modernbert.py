"""ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer: A Modern Bidirectional
Encoder for Fast, Memory Efficient, and Long Context Finetuning and Inference"), one size per
variant: `--config configs/modernbert.py:size=base` (base, large; tiny: BERT-Tiny's shape in
this layout, the README's main job and the modern model of docs/models.md's comparison).

Architecture (App. B, Table 4): pre-LN with a LayerNorm after the embedding and none before
layer 0's attention, a final LayerNorm; LayerNorm eps 1e-5 without biases; no bias in any
attention or MLP projection or the head's dense (the decoder keeps one, tied to the
embedding); GeGLU MLP; rotary positions, no position or token-type table, no pooler; every
third layer global (from layer 0), the others a 128-token sliding window (64 each side);
vocabulary 50,368; 8,192 positions.

  size   params  layers  width  heads  GLU half-width  batch (seq)  peak lr  warmup
  base   149M    22       768   12     1,152           4,608        8e-4     3B tokens
  large  395M    28      1024   16     2,624           4,928        5e-4     2B tokens

Pre-training (App. A, Table 3): 1.719T tokens at 1,024 tokens per sequence, packed (documents
in rows with no attention across them: data.bert_instances=packed), 30% MLM masking (80/10/10),
no NSP; StableAdamW β (0.9, 0.98), ε 1e-6, fully decoupled weight decay 1e-5 per step at
the peak rate (not on biases or norms; optimizer.weight_decay here is that over the peak
learning rate, since the update multiplies it by the rate), no gradient clipping; linear
warmup then constant (the trapezoidal schedule's decay comes at the end of context
extension); RoPE base 10,000 in every layer in this phase; dropout 0.1 on the attention output
only. Then context extension (`:size=base,stage=extension`): 8,192 tokens, batch 576 (large
616), lr 3e-4 (large 5e-5), global layers' RoPE base 160,000, 250B tokens at that rate, then
50B with a 1-sqrt decay to 0 (optimizer.schedule="wsd", decay_fraction 50/300).

StableAdamW is `optimizer.name="stable_adamw"` (bertjax.training.optim: AdamW with per-tensor
update clipping; tiny keeps AdamW, at 2e-3 with bf16 compute: the README main job's recipe).
What differs here, stated rather than hidden: base's batch-size ramp (768 -> 4,608 over 50B
tokens) grows in 6 stages of 768 (bertjax.config.ramp; the schedule's warmup counts tokens)
and large trains at its full batch from the start (its ramp is not among the figures cited
here); large's 5e-4 -> 5e-5 restart after 900B tokens is left to a second run; the
attention-output dropout is bertjax's hidden_dropout, which also drops out the embeddings and
the MLP's output (both 0 in the paper); steps are tokens / (batch x sequence length).

  bertjax compile --config configs/modernbert.py:size=base --topology v5p-64
  bertjax compile --config configs/modernbert.py:size=large --topology v5p-128
  bertjax train --config configs/modernbert.py:size=base --workdir /gcs/BUCKET/modernbert_base \
      --config.data.dataset=/gcs/BUCKET/web_text
  bertjax train --config configs/modernbert.py:size=tiny --workdir runs/modernbert_tiny  # CPU
"""

import common
from bertjax.config import base_config, bert_model, choose, parse_arg, ramp
from bertjax.reproduction import Contract, Target, golden_contracts

# size: (layers, width, heads, GLU half-width, batch, peak lr, warmup tokens, the paper's
#        parameter count, micro-batches that make a step fit the slice in the docstring).
SIZES = {
    "base": (22, 768, 12, 1152, 4608, 8e-4, 3_000_000_000, 149_000_000, 4),
    "large": (28, 1024, 16, 2624, 4928, 5e-4, 2_000_000_000, 395_000_000, 7),
    # bert_tiny's width, depth and heads; the GLU half-width gives as many layer parameters.
    "tiny": (2, 128, 2, 336, 32, 2e-3, 0, 0, 1),
}
STAGES = ("pretrain", "extension")
# Every config this file makes (the tests load each).
VARIANTS = tuple(f"size={size}" for size in SIZES) + ("size=base,stage=extension",
                                                      "size=large,stage=extension")
# The batch-size warmup of pre-training: (first batch and increment in sequences, tokens over
# which the batch grows to its full size). Base: 768 -> 4,608 over 50B tokens (the authors'
# yamls/modernbert/modernbert-base-pretrain.yaml: batch_size_warmup_tokens 50B from the
# micro-batch of 96 on each of 8 GPUs); large's yaml is not among the sources this file cites,
# and large trains at its full batch from the start.
RAMPS = {"base": (768, 50_000_000_000)}
# Table 3's weight decay, per step at the peak learning rate (large: 1e-6 after its restart).
PAPER_WEIGHT_DECAY = {"base": 1e-5, "large": 1e-5}
PRETRAIN_TOKENS = 1_719_000_000_000
# Context extension: 250B tokens at the constant rate, then 50B decaying (1-sqrt).
EXTENSION_TOKENS = 300_000_000_000
EXTENSION_DECAY_TOKENS = 50_000_000_000


def modernbert_model(layers: int, width: int, heads: int, glu: int, vocab: int):
  """The `model` group of a ModernBERT (Table 4's layout; phase-1 RoPE bases)."""
  return bert_model(
      vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=heads, mlp_dim=glu,
      max_positions=8192, type_vocab_size=0, norm_position="pre", final_layer_norm=True,
      activation="gelu", layer_norm_eps=1e-5, hidden_dropout=0.1, attention_dropout=0.0,
      position_embedding="rotary", rope_theta=10_000.0, local_rope_theta=10_000.0,
      mlp_gated=True, attention_bias=False, mlp_bias=False, norm_bias=False, head_bias=False,
      pooler=False, local_window=128, global_every=3, first_attention_norm=False)


def get_config(arg=None):
  arg = parse_arg(arg, size="", stage="pretrain")
  layers, width, heads, glu, batch, lr, warmup_tokens, params, micro = choose(SIZES, "size",
                                                                              arg.size)
  stage = choose({s: s for s in STAGES}, "stage", arg.stage)
  tiny = arg.size == "tiny"
  config = base_config(modernbert_model(layers, width, heads, glu, 8192 if tiny else 50_368))
  config.objective = "mlm"
  config.data.bert_instances = "packed"
  config.data.mask_prob = 0.30
  config.data.dupe_factor = 0  # a new mask every time a sequence is seen
  if tiny:
    common.tiny_cpu_training(config, batch_size=32)
    config.model.local_window = 64  # of 128 positions: the local layers see half the row
    config.max_predictions = 40  # 30% of 128
    # Long enough to leave the frequent-token plateau, so that a QA fine-tune from it beats
    # random init (docs/finetuning.md); still minutes on 2 CPU cores.
    config.num_train_steps = 1650
    # Twice tiny_cpu_training's rate on the same linear schedule, bf16 compute (float32
    # weights) where the CPU has native bf16 products: the 1e-3 float32 recipe's final eval
    # accuracy by mid-run, in well under half its time
    # (docs/results/2026-11-27-main-job-recipe.md). "auto": float32 on a CPU without them,
    # where bf16 steps are slower (bertjax/training/defaults.py).
    config.optimizer.learning_rate = lr
    config.model.dtype = "auto"
    config.eval_every = 275  # the curve the recipe is judged by (time to accuracy)
    config.checkpoint.every = 550
    return config
  config.batch_size = batch
  config.seq_length = 1024
  config.max_predictions = 308  # 30% of 1,024
  config.num_train_steps = PRETRAIN_TOKENS // (batch * 1024)
  if arg.size in RAMPS:
    # The batch-size warmup (bertjax.config.ramp), keyed on tokens like the schedule.
    start, ramp_tokens = RAMPS[arg.size]
    config.batch_ramp.update(dict(start_batch_size=start, increment=start,
                                  samples=ramp_tokens // 1024))
    config.num_train_steps = ramp.steps_for_samples(
        ramp.from_config(config), PRETRAIN_TOKENS // 1024, batch)
  # StableAdamW's decay is fully decoupled (1e-5 of the weights per step at the peak, scaled
  # by the schedule); the update multiplies its rate by the learning rate: divide it out.
  config.optimizer.update(dict(name="stable_adamw", learning_rate=lr,
                               warmup_steps=warmup_tokens // (batch * 1024),
                               schedule="constant", b1=0.9, b2=0.98, eps=1e-6,
                               weight_decay=PAPER_WEIGHT_DECAY[arg.size] / lr, clip_norm=0.0))
  if stage == "extension":
    batch = {"base": 576, "large": 616}[arg.size]
    config.batch_size = batch
    config.batch_ramp.update(dict(start_batch_size=0, increment=0, samples=0))
    config.seq_length = 8192
    config.max_predictions = 2458  # 30% of 8,192
    config.model.rope_theta = 160_000.0
    config.num_train_steps = EXTENSION_TOKENS // (batch * 8192)
    extension_lr = {"base": 3e-4, "large": 5e-5}[arg.size]
    config.optimizer.update(dict(learning_rate=extension_lr, warmup_steps=0,
                                 weight_decay={"base": 1e-5, "large": 1e-6}[arg.size]
                                 / extension_lr, schedule="wsd", decay_shape="1-sqrt",
                                 decay_fraction=EXTENSION_DECAY_TOKENS / EXTENSION_TOKENS,
                                 end_lr_fraction=0.0))
  config.checkpoint.every = 5_000
  # A step as written does not fit the slice; these settings make it (docs/reproducing.md).
  common.memory_saving(config, grad_accum_steps=micro)
  config.reference_params = params
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    **{variant: Contract(
        paper="Warner et al. 2024",
        targets=(
            Target("GLUE score", 88.4, "answerdotai/ModernBERT-base model card, as a page "
                   "summarising it quotes: 'On GLUE, it scores 88.4'", "the released model, "
                   "after the context extension (2T tokens)"),
        )) for variant in ("size=base", "size=base,stage=extension")},
    **{variant: Contract(
        paper="Warner et al. 2024",
        targets=(
            Target("GLUE score", 90.4, "Warner et al. 2024, Table 1, as research notes "
                   "transcribing it give it: '| ModernBERT-large | 90.4 |'", "the released "
                   "model, after the context extension; the model card's table was not "
                   "readable here"),
        )) for variant in ("size=large", "size=large,stage=extension")},
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "modernbert:size=base,runlocal"),
}
