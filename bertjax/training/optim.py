"""Optimizers and learning-rate schedules, built from the config's `optimizer` group.

- AdamW with BERT's conventions (eps 1e-6, decoupled weight decay 0.01, no decay on LayerNorm
  parameters and biases), LAMB (You et al. 2020, large-batch BERT), Adafactor.
- Schedules: linear warmup + linear decay to zero (BERT), linear warmup + cosine decay to a
  floor and constant after (GPT-2/3), or constant after warmup.
- Global-norm gradient clipping.
- Parameter groups (pre-training and fine-tuning alike): `freeze` gives parts of the encoder
  no update (the embeddings, the bottom K layers, or all of it, or — "base" — every parameter
  of the base model, training only the parameter-efficient additions and the heads), and
  `head_learning_rate` gives the parameters outside the encoder (a fresh classifier, or
  pre-training heads) their own peak learning rate — `optax.multi_transform` over
  per-parameter labels (`parameter_groups`).

Weight decay applies to matrices and embedding tables only: `decay_mask` is the one place that
decides, from the parameter's leaf name; bertjax.models.groups tells which parameter is what.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from bertjax.models.groups import frozen_rows, names_of, parameter_groups, parse_freeze

log = logging.getLogger(__name__)

# Leaves that are decayed; everything else (LayerNorm scale/bias, biases, mlm_bias) is not.
DECAYED_LEAVES = ("kernel", "embedding")
# Leaf-name prefixes of matrices and tables added by parameter-efficient tuning (LoRA's A and
# B, prefix keys/values): decayed too, as Hugging Face's Trainer decays every non-bias,
# non-LayerNorm parameter of a peft model.
DECAYED_PREFIXES = ("lora_", "prefix_")

def decay_mask(params: Any) -> Any:
  """True for parameters that get weight decay: kernels, embedding tables and the added
  matrices (LoRA, prefixes)."""
  def is_decayed(path, _):
    last = str(getattr(path[-1], "key", getattr(path[-1], "name", None)))
    return last in DECAYED_LEAVES or last.startswith(DECAYED_PREFIXES)
  return jax.tree_util.tree_map_with_path(is_decayed, params)


# The position tables a distillation run may freeze (distillation.freeze_position_embeddings:
# DistilBERT's, GPT-2's `wpe`), by their path in the parameter tree.
POSITION_TABLES = (("bert", "position_embeddings"), ("wpe",))


def _is_position_table(path) -> bool:
  names = names_of(path)
  return any(names[:len(table)] == table for table in POSITION_TABLES)


def _frozen(params: Any, freeze: str, freeze_positions: bool) -> Any:
  """`frozen_rows` of `optimizer.freeze`, with the position tables frozen whole as well where
  `freeze_positions` says so."""
  rows = frozen_rows(params, freeze)
  if not freeze_positions:
    return rows
  return jax.tree_util.tree_map_with_path(
      lambda path, f: True if _is_position_table(path) else f, rows)


def _groups(params: Any, freeze: str, freeze_positions: bool) -> Any:
  """`parameter_groups`, with the position tables "frozen" where `freeze_positions` says so."""
  groups = parameter_groups(params, freeze)
  if not freeze_positions:
    return groups
  return jax.tree_util.tree_map_with_path(
      lambda path, g: "frozen" if _is_position_table(path) else g, groups)


def _zero_frozen(freeze: str, freeze_positions: bool = False) -> optax.GradientTransformation:
  """Zeroes the gradient/update of frozen parameters (rows of a scanned stack included)."""
  def keep(u, f):
    if isinstance(f, np.ndarray):
      return jnp.where(jnp.asarray(f), jnp.zeros_like(u), u)
    return jnp.zeros_like(u) if f else u

  def update(updates, state, params=None):
    del params
    return jax.tree.map(keep, updates, _frozen(updates, freeze, freeze_positions)), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_train_steps: int,
                           restart: ml_collections.ConfigDict | None = None) -> optax.Schedule:
  """Warmup then `opt.schedule`: linear (polynomial with `opt.power`; to end_lr_fraction of the
  peak at `decay_steps`, constant after), cosine (likewise) or constant.

  `restart` (a config's `phase2` group): from `restart.start_step` on, a new warmup to
  `restart.learning_rate` over `restart.warmup_steps`, then the same kind of decay to the end of
  training (NVIDIA's and You et al.'s two-phase LAMB recipe). Without a restart peak the first
  schedule runs on through the switch (Devlin et al.)."""
  if restart is not None and int(restart.start_step) > 0 and float(restart.learning_rate) > 0:
    start = int(restart.start_step)
    first = learning_rate_schedule(opt, start)
    second_opt = opt.copy_and_resolve_references()
    second_opt.learning_rate = float(restart.learning_rate)
    second_opt.warmup_steps = int(restart.warmup_steps)
    second_opt.decay_steps = 0
    second = learning_rate_schedule(second_opt, num_train_steps - start)
    return optax.join_schedules([first, second], [start])
  peak, warmup = float(opt.learning_rate), int(opt.warmup_steps)
  if warmup > num_train_steps:
    # A shortened run keeps its config's warmup: one override (num_train_steps) is enough.
    log.warning("optimizer.warmup_steps=%d exceeds the %d steps scheduled: warming up over "
                "all %d", warmup, num_train_steps, num_train_steps)
    warmup = num_train_steps
  warmup_fn = optax.linear_schedule(0.0, peak, warmup)
  decay_steps = int(opt.decay_steps) or num_train_steps
  remaining = max(decay_steps - warmup, 1)
  if opt.schedule == "linear":
    decay_fn = optax.polynomial_schedule(peak, peak * float(opt.end_lr_fraction),
                                         float(opt.get("power", 1.0)), remaining)
  elif opt.schedule == "cosine":
    decay_fn = optax.cosine_decay_schedule(peak, remaining, alpha=float(opt.end_lr_fraction))
  elif opt.schedule == "constant":
    decay_fn = optax.constant_schedule(peak)
  else:
    raise ValueError(f"optimizer.schedule must be linear, cosine or constant, got "
                     f"{opt.schedule!r}")
  return optax.join_schedules([warmup_fn, decay_fn], [warmup])


def build_optimizer(opt: ml_collections.ConfigDict, num_train_steps: int,
                    restart: ml_collections.ConfigDict | None = None,
                    freeze_positions: bool = False,
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The full update rule (clipping, then the optimizer) and its learning-rate schedule
  (`restart`: see `learning_rate_schedule`).

  With `opt.freeze` or `opt.head_learning_rate` set, the parameters are split into groups
  (`parameter_groups`): frozen ones get a zero update and no optimizer state, the head its own
  schedule (the encoder's warmup and decay, to its own peak). `freeze_positions` (a
  distillation run's distillation.freeze_position_embeddings) freezes the position tables the
  same way. Otherwise the optimizer state is the single optimizer's, as checkpoints of earlier
  runs hold it."""
  schedule = learning_rate_schedule(opt, num_train_steps, restart)
  freeze = str(opt.get("freeze", "none"))
  parse_freeze(freeze)
  head_lr = float(opt.get("head_learning_rate", 0.0) or 0.0)
  if head_lr and head_lr != float(opt.learning_rate):
    head_opt = opt.copy_and_resolve_references()
    head_opt.learning_rate = head_lr
    head_schedule = learning_rate_schedule(head_opt, num_train_steps, restart)
  else:
    head_schedule = schedule
  grouped = freeze != "none" or head_schedule is not schedule or freeze_positions
  clip = ([optax.clip_by_global_norm(float(opt.clip_norm))]
          if opt.clip_norm and float(opt.clip_norm) > 0 else [])
  if not grouped:
    return optax.chain(*clip, _core(opt, schedule)), schedule
  update = optax.multi_transform(
      {"frozen": optax.set_to_zero(), "encoder": _core(opt, schedule),
       "head": _core(opt, head_schedule)},
      lambda params: _groups(params, freeze, freeze_positions))
  # Frozen gradients are zeroed before clipping (they take no part in the global norm) and the
  # updates again after: decoupled weight decay moves a parameter with zero gradient, and the
  # frozen rows of a scanned stack share their leaf (and optimizer) with trained rows.
  zero = _zero_frozen(freeze, freeze_positions)
  return optax.chain(zero, *clip, update, zero), schedule


def _core(opt: ml_collections.ConfigDict, schedule: optax.Schedule
          ) -> optax.GradientTransformation:
  wd = float(opt.weight_decay)
  if opt.name == "adamw":
    return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=wd,
                       mask=decay_mask)
  if opt.name == "lamb":
    return optax.lamb(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=wd,
                      mask=decay_mask)
  if opt.name == "adafactor":
    return optax.adafactor(schedule, weight_decay_rate=wd or None,
                           weight_decay_mask=decay_mask if wd else None)
  raise ValueError(f"optimizer.name must be adamw, lamb or adafactor, got {opt.name!r}")
