"""The `:runlocal` variant every config has: its recipe at laptop scale."""

from __future__ import annotations

import ml_collections

from bertjax.config import ramp

ConfigDict = ml_collections.ConfigDict

# The variant every config has, applied by the loader after get_config.
RUNLOCAL = "runlocal"

# What `:runlocal` makes of any config (see `runlocal`).
_LOCAL_MODEL = dict(num_layers=2, hidden_size=128, num_heads=2, vocab_size=8192,
                    max_positions=128)
_LOCAL_BATCH = 16
_LOCAL_STEPS = 200
_LOCAL_LR = 1e-3


def runlocal(config: ConfigDict) -> ConfigDict:
  """The `:runlocal` variant of any config: its recipe at laptop scale, trained on CPU in
  minutes, to try a paper config end to end (data, objective, schedule, checkpoints, eval)
  before paying for its slice.

  Kept: the model family and numerics (norm position, activation, final LayerNorm, residual
  init, segment types, dropout rates and kind, attention implementation, MLP-to-width ratio),
  the objective and its data layout (BERT instances, masking, dupe factor; the tokenizer style
  follows the objective), the optimizer with its moments, clipping and weight decay, and the
  schedule's shape: warmup, decay end and a second phase at the same fractions of the run, the
  second phase's sequence length, batch and learning rate in the same ratios to the first.
  Shrunk: 2 layers of width 128 with 2 heads, 8192 pieces trained on the embedded Wikipedia
  sample (built into WORKDIR/data on first use), 128 positions (the longest phase's sequences
  scaled to 128, predictions per sequence alike), batch 16, 200 steps, peak learning rate 1e-3
  (the tiny configs'; a paper's is tuned for its size), logs every 10 steps, an eval and a
  checkpoint every 100. CPU settings: float32, no remat, no loss chunking, one micro-batch,
  data parallelism over the local devices, no profile, no paper parameter count. Dropped: a
  batch-size ramp (a batch of 16 has no room to grow in stages the local devices can split)
  and a sequence-length warmup.
  """
  if config.finetune.task:
    raise ValueError(f"{RUNLOCAL} shrinks a pre-training recipe; a fine-tuning config runs at "
                     "the scale of its weights and task")
  steps = int(config.num_train_steps)
  batch_ramp = ramp.from_config(config)
  if batch_ramp is not None:  # the schedule counts full batches (bertjax.config.ramp)
    steps = round(batch_ramp.full_batches(steps))

  def scaled(value: int) -> int:  # a step count at the same fraction of the shorter run
    return 0 if not value else max(1, round(int(value) * _LOCAL_STEPS / steps))

  ratio = int(config.model.mlp_dim) / int(config.model.hidden_size)
  _shrink_rtd(config.model)
  if "head_size" in config.model:
    config.model.head_size = 0  # T5-3B's and 11B's 128-wide heads: the local width's
    config.model.decoder_layers = 0  # an encoder-decoder's decoder as deep as its encoder
  config.model.update(dict(_LOCAL_MODEL, mlp_dim=round(ratio * _LOCAL_MODEL["hidden_size"]),
                           dtype="float32", param_dtype="float32", remat_policy="none",
                           loss_chunk=0))
  p2 = config.phase2
  longest = max(int(config.seq_length), int(p2.seq_length))
  shrink = min(1.0, _LOCAL_MODEL["max_positions"] / longest)
  for group, key in ((config, "seq_length"), (config, "max_predictions"), (p2, "seq_length"),
                     (p2, "max_predictions")):
    if group[key]:
      group[key] = max(1, round(int(group[key]) * shrink))
  if p2.batch_size:
    p2.batch_size = max(1, round(int(p2.batch_size) * _LOCAL_BATCH / int(config.batch_size)))
  config.batch_size = _LOCAL_BATCH
  config.grad_accum_steps = 1
  if "batch_ramp" in config:
    config.batch_ramp.update(dict(start_batch_size=0, increment=0, samples=0))
  if "seq_warmup" in config:
    config.seq_warmup.update(dict(start_length=0, increment=0, samples=0))
  p2.grad_accum_steps = 0
  lr = config.optimizer.learning_rate
  if p2.learning_rate:
    p2.learning_rate = float(p2.learning_rate) * _LOCAL_LR / float(lr)
  config.optimizer.learning_rate = _LOCAL_LR
  config.optimizer.warmup_steps = scaled(config.optimizer.warmup_steps)
  config.optimizer.decay_steps = scaled(config.optimizer.decay_steps)
  p2.start_step = scaled(p2.start_step)
  p2.warmup_steps = scaled(p2.warmup_steps)
  config.num_train_steps = _LOCAL_STEPS
  config.data.update(dict(source="corpus", dataset="", sources="embedded", tokenizer="",
                          weights="", epoch_documents=0, num_workers=0, build_workers=0))
  config.mesh.update(dict(data=-1, fsdp=1, tensor=1))
  config.dcn_mesh.update(dict(data=-1, fsdp=1, tensor=1))
  config.checkpoint.every = 100
  config.log_every = 10
  config.eval_every = 100
  config.eval_steps = 2
  config.profile.start_step = -1
  config.init_from = ""
  config.reference_params = 0
  return config


def _shrink_rtd(model: ConfigDict) -> None:
  """An ELECTRA or DeBERTa-v3 at the local width: the embedding width and the generator in
  the same proportions to the discriminator (width, heads, depth, MLP ratio)."""
  width, heads, layers = int(model.hidden_size), int(model.num_heads), int(model.num_layers)
  scale = _LOCAL_MODEL["hidden_size"] / width
  if int(model.embedding_size):
    model.embedding_size = max(8, round(int(model.embedding_size) * scale))
  if not int(model.generator_hidden_size):
    return
  generator_heads = max(1, round((int(model.generator_num_heads) or heads)
                                 * _LOCAL_MODEL["num_heads"] / heads))
  generator_width = max(generator_heads, round(int(model.generator_hidden_size) * scale))
  mlp_ratio = int(model.generator_mlp_dim) / int(model.generator_hidden_size)
  model.generator_hidden_size = generator_width - generator_width % generator_heads
  model.generator_num_heads = generator_heads
  model.generator_mlp_dim = round(mlp_ratio * model.generator_hidden_size)
  if int(model.generator_num_layers):
    model.generator_num_layers = max(1, round(int(model.generator_num_layers)
                                              * _LOCAL_MODEL["num_layers"] / layers))
