"""The papers' training recipes the config files share (big_vision's configs/common.py): a
recipe sets the training keys of a config built on bertjax.config.schema.base_config.

    import common
    config = common.bert_paper_training(base_config(bert_model()))
"""

from __future__ import annotations

from ml_collections import ConfigDict

from bertjax.config import ramp


def tiny_cpu_training(config: ConfigDict, batch_size: int) -> ConfigDict:
  """The training settings of the tiny CPU configs (minutes on 2 cores): 300 steps of
  `batch_size` x 128 tokens, lr 1e-3 after 30 warmup steps, logs every 25 steps, eval every
  100 on 4 batches."""
  config.batch_size = batch_size
  config.seq_length = 128
  config.num_train_steps = 300
  config.log_every = 25
  config.eval_every = 100
  config.eval_steps = 4
  config.checkpoint.every = 100
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 30
  return config


def bert_paper_training(config: ConfigDict) -> ConfigDict:
  """Devlin et al. (2019, App. A.2): batch 256, 1M steps, Adam lr 1e-4 (β 0.9/0.999, weight
  decay 0.01), 10k warmup steps then linear decay, dropout 0.1 (the model default); 90% of the
  steps at sequence length 128 and the last 10% at 512, with google-research/bert's
  max_predictions_per_seq 20 and 76 (MLPerf's value at 512) for the two phases."""
  config.batch_size = 256
  config.num_train_steps = 1_000_000
  config.seq_length = 128
  config.max_predictions = 20
  config.optimizer.update(dict(name="adamw", learning_rate=1e-4, warmup_steps=10_000,
                               schedule="linear", b1=0.9, b2=0.999, weight_decay=0.01))
  config.phase2.update(dict(start_step=900_000, seq_length=512, max_predictions=76))
  config.checkpoint.every = 10_000
  config.log_every = 100
  return config


def gpt2_training(config: ConfigDict, learning_rate: float) -> ConfigDict:
  """GPT-2's published shape of training (Radford et al. 2019: batch 512 x 1024 tokens) with
  what the paper leaves out taken from GPT-3's recipe (Brown et al. 2020, App. B): Adam β
  (0.9, 0.95) ε 1e-8, clip 1.0, weight decay 0.1, warmup 375M tokens (715 steps), cosine to
  10%; 600K steps (~300B tokens, nanoGPT's reproduction length)."""
  config.batch_size = 512
  config.seq_length = 1024
  config.num_train_steps = 600_000
  config.optimizer.update(dict(name="adamw", learning_rate=learning_rate, warmup_steps=715,
                               schedule="cosine", end_lr_fraction=0.1, b1=0.9, b2=0.95,
                               eps=1e-8, weight_decay=0.1, clip_norm=1.0))
  config.checkpoint.every = 2_000
  return config


def t5_training(config: ConfigDict) -> ConfigDict:
  """Raffel et al. (2020, Sections 3.1.2, 3.1.4 and 3.7): span corruption at noise density
  0.15 and mean span length 3 on inputs of 512 tokens (targets 114), batch 2,048, 1M steps,
  Adafactor (factored second moments, no momentum, update clipping 1.0: optax's defaults) with
  the inverse square root schedule at 0.01 for 10,000 steps."""
  config.objective = "span_corruption"
  config.batch_size = 2048
  config.seq_length = 512
  config.num_train_steps = 1_000_000
  config.data.mask_prob = 0.15
  config.data.noise_span_length = 3.0
  config.optimizer.update(dict(name="adafactor", learning_rate=0.01, warmup_steps=10_000,
                               schedule="rsqrt", weight_decay=0.0))
  config.checkpoint.every = 5_000
  return config


def memory_saving(config: ConfigDict, grad_accum_steps: int | None = None,
                  zero3: bool = True) -> ConfigDict:
  """The settings with which `bertjax compile` fits a paper config into its slice, in the
  order they were tried: ZeRO-3 over every device (`zero3`), bf16 compute with float32
  master weights, activation checkpointing that keeps only matmul outputs ("dots": the
  recomputed work is elementwise), then `grad_accum_steps` micro-batches (None: as set)."""
  if zero3:
    config.mesh.update(dict(data=1, fsdp=-1, tensor=1))
  config.model.dtype = "bfloat16"
  config.model.remat_policy = "dots"
  if grad_accum_steps is not None:
    config.grad_accum_steps = grad_accum_steps
  return config


def gpt3_training(config: ConfigDict, batch_tokens: int, learning_rate: float,
                  ramp_start: int) -> ConfigDict:
  """Brown et al. (2020, Table 2.1 and App. B): context 2048, `batch_tokens` per step, 300B
  tokens in all, Adam β (0.9, 0.95) ε 1e-8, clip 1.0, weight decay 0.1, linear warmup over the
  first 375M tokens, cosine decay to 10% of the peak over 260B tokens, constant after; the
  batch grows linearly from a small value over the first 4-12B tokens "depending on the model
  size" (bertjax.config.ramp): here from `ramp_start` sequences in steps of `ramp_start` over
  the first 4B tokens (the paper gives no size-by-size table; Megatron-LM's GPT-3 175B example
  ramps over 12B), the schedule's warmup and decay counted in tokens. The paper states no
  dropout; none is used (common for LLM pre-training on this many tokens), which also lets
  `model.attention=auto` pick the fused attention kernel on TPU and GPU (the kernels have no
  attention dropout)."""
  config.model.hidden_dropout = 0.0
  config.model.attention_dropout = 0.0
  config.seq_length = 2048
  config.batch_size = batch_tokens // 2048
  config.batch_ramp.update(dict(start_batch_size=ramp_start, increment=ramp_start,
                                samples=4_000_000_000 // 2048))
  config.num_train_steps = ramp.steps_for_samples(
      ramp.from_config(config), -(-300_000_000_000 // 2048), config.batch_size)
  config.optimizer.update(dict(
      name="adamw", learning_rate=learning_rate, warmup_steps=round(375e6 / batch_tokens),
      schedule="cosine", decay_steps=round(260e9 / batch_tokens), end_lr_fraction=0.1,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0))
  config.checkpoint.every = 2_000
  config.log_every = 50
  return config
