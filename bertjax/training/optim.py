"""Optimizers and learning-rate schedules, built from the config's `optimizer` group.

AdamW with BERT's conventions, StableAdamW (Wortsman et al. 2023, Alg. 2; ModernBERT's), LAMB
(You et al. 2020) and Adafactor; warmup then linear, cosine, constant or warmup-stable-decay
schedules (Hägele et al. 2024); global-norm clipping; parameter groups (`freeze`,
`head_learning_rate`) as `optax.multi_transform` over per-parameter labels
(`parameter_groups`). `decay_mask` is the one place that decides which parameters take weight
decay; bertjax.models.groups tells which parameter is what.

The guide: docs/training.md, 'Optimisation (`config.optimizer`)'.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from bertjax.config import ramp
from bertjax.models.groups import frozen_rows, names_of, parameter_groups, parse_freeze
from bertjax.training import skipping

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
  if opt.schedule == "rsqrt":
    # T5's inverse square root (Raffel et al. 2020, Section 3.1.2): the peak for the first
    # warmup_steps steps, then peak * sqrt(warmup_steps / step); no ramp.
    k = float(max(warmup, 1))
    return lambda step: peak * jnp.sqrt(k / jnp.maximum(jnp.asarray(step, jnp.float32), k))
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
  elif opt.schedule == "wsd":
    decay_fn = _stable_then_decay(peak, peak * float(opt.end_lr_fraction), remaining,
                                  float(opt.decay_fraction), str(opt.decay_shape))
  else:
    raise ValueError(f"optimizer.schedule must be linear, cosine, constant, wsd or rsqrt, got "
                     f"{opt.schedule!r}")
  return optax.join_schedules([warmup_fn, decay_fn], [warmup])


DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def _stable_then_decay(peak: float, end: float, steps: int, decay_fraction: float,
                       shape: str) -> optax.Schedule:
  """`steps` steps at `peak`, the last `decay_fraction` of them decaying to `end`: linearly,
  along a half cosine, or as 1 - sqrt(fraction of the decay done) (ModernBERT's "1-sqrt")."""
  if shape not in DECAY_SHAPES:
    raise ValueError(f"optimizer.decay_shape must be one of {', '.join(DECAY_SHAPES)}, got "
                     f"{shape!r}")
  if not 0.0 < decay_fraction <= 1.0:
    raise ValueError(f"optimizer.decay_fraction must be in (0, 1], got {decay_fraction}")
  decay = max(int(round(decay_fraction * steps)), 1)
  stable = steps - decay

  def schedule(count):
    done = jnp.clip((count - stable) / decay, 0.0, 1.0)
    if shape == "linear":
      left = 1.0 - done
    elif shape == "cosine":
      left = 0.5 * (1.0 + jnp.cos(jnp.pi * done))
    else:
      left = 1.0 - jnp.sqrt(done)
    return end + (peak - end) * left
  return schedule


class StableAdamState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any


def scale_by_stable_adam(b1: float, b2: float, eps: float) -> skipping.SkipAware:
  """Adam's bias-corrected direction m̂ / (√v̂ + ε), each tensor's divided by
  max(1, √mean(g² / max(v̂, ε²))) (Wortsman et al. 2023, Alg. 2): a tensor whose gradient
  outgrew its second-moment estimate (a loss spike's first step) takes a smaller step, in
  place of clipping the global gradient norm."""
  def init(params):
    return StableAdamState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params),
                           jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params=None, *, skip=None, **extra_args):
    del params, extra_args
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    mu, nu, count = skipping.moments_unless_skipped(skip, state, mu, nu,
                                                    optax.safe_int32_increment(state.count))
    first = 1 - b1 ** count.astype(jnp.float32)
    second = 1 - b2 ** count.astype(jnp.float32)

    def step(g, m, v):
      v_hat = v / second
      rms = jnp.sqrt(jnp.mean(g * g / jnp.maximum(v_hat, eps * eps)))
      return (m / first) / (jnp.sqrt(v_hat) + eps) / jnp.maximum(1.0, rms)
    return jax.tree.map(step, grads, mu, nu), StableAdamState(count, mu, nu)
  return skipping.SkipAware(init, update)


def stable_adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float,
                 weight_decay: float, mask: Any) -> optax.GradientTransformation:
  """StableAdamW with decoupled weight decay scaled by the learning rate, as optax's adamw."""
  return skipping.skippable_chain(scale_by_stable_adam(b1, b2, eps),
                                  optax.add_decayed_weights(weight_decay, mask),
                                  optax.scale_by_learning_rate(schedule))


def build_optimizer(opt: ml_collections.ConfigDict, num_train_steps: int,
                    restart: ml_collections.ConfigDict | None = None,
                    freeze_positions: bool = False, batch_ramp: ramp.BatchRamp | None = None,
                    ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The full update rule (clipping, then the optimizer) and its learning-rate schedule
  (`restart`: see `learning_rate_schedule`). With a `batch_ramp` the schedule counts the
  samples consumed in full batches (`ramp.BatchRamp.full_batch_steps`), so warmup_steps and
  decay_steps keep their meaning in tokens while the early steps are small.

  With `opt.freeze` or `opt.head_learning_rate` set, the parameters are split into groups
  (`parameter_groups`): frozen ones get a zero update and no optimizer state, the head its own
  schedule (the encoder's warmup and decay, to its own peak). `freeze_positions` (a
  distillation run's distillation.freeze_position_embeddings) freezes the position tables the
  same way. Otherwise the optimizer state is the single optimizer's, as checkpoints of earlier
  runs hold it."""
  schedule_steps = num_train_steps
  if batch_ramp is not None:
    schedule_steps = math.ceil(batch_ramp.full_batches(num_train_steps))
  schedule = _keyed(learning_rate_schedule(opt, schedule_steps, restart), batch_ramp)
  freeze = str(opt.get("freeze", "none"))
  parse_freeze(freeze)
  head_lr = float(opt.get("head_learning_rate", 0.0) or 0.0)
  if head_lr and head_lr != float(opt.learning_rate):
    head_opt = opt.copy_and_resolve_references()
    head_opt.learning_rate = head_lr
    head_schedule = _keyed(learning_rate_schedule(head_opt, schedule_steps, restart), batch_ramp)
  else:
    head_schedule = schedule
  grouped = freeze != "none" or head_schedule is not schedule or freeze_positions
  clip = ([clip_by_global_norm(float(opt.clip_norm))]
          if opt.clip_norm and float(opt.clip_norm) > 0 else [])
  if not grouped:
    return skipping.skippable_chain(*clip, _core(opt, schedule)), schedule
  update = skipping.skippable_partition(
      {"frozen": optax.set_to_zero(), "encoder": _core(opt, schedule),
       "head": _core(opt, head_schedule)},
      lambda params: _groups(params, freeze, freeze_positions))
  # Frozen gradients are zeroed before clipping (they take no part in the global norm) and the
  # updates again after: decoupled weight decay moves a parameter with zero gradient, and the
  # frozen rows of a scanned stack share their leaf (and optimizer) with trained rows.
  zero = _zero_frozen(freeze, freeze_positions)
  return skipping.skippable_chain(zero, *clip, update, zero), schedule


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` (same empty state, so checkpoints are interchangeable) with
  every gradient multiplied by one scalar, min(1, max_norm / norm), as torch's
  `clip_grad_norm_` does, instead of divided by the norm: XLA fuses a scalar multiply into
  each consumer (the moments' updates), where optax's divide was written out as a copy of
  every gradient and read back twice. Unclipped gradients pass unchanged (times 1.0);
  clipped ones differ from optax's by rounding."""

  def update_fn(updates, state, params=None):
    del params
    scale = jnp.minimum(1.0, max_norm / optax.tree.norm(updates))
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _keyed(schedule: optax.Schedule, batch_ramp: ramp.BatchRamp | None) -> optax.Schedule:
  """`schedule` read at the samples consumed in full batches (itself without a ramp)."""
  if batch_ramp is None:
    return schedule
  return lambda count: schedule(batch_ramp.full_batch_steps(count))


def _core(opt: ml_collections.ConfigDict, schedule: optax.Schedule
          ) -> optax.GradientTransformation:
  wd = float(opt.weight_decay)
  # optax.adamw's and optax.lamb's chains (their states, their arithmetic) with an Adam that
  # the spike guard skips without copying the moments (bertjax.training.skipping).
  if opt.name == "adamw":
    return skipping.skippable_chain(
        skipping.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps),
        optax.add_decayed_weights(wd, decay_mask), optax.scale_by_learning_rate(schedule))
  if opt.name == "lamb":
    return skipping.skippable_chain(
        skipping.scale_by_adam(b1=opt.b1, b2=opt.b2, eps=opt.eps),
        optax.add_decayed_weights(wd, decay_mask), optax.scale_by_trust_ratio(),
        optax.scale_by_learning_rate(schedule))
  if opt.name == "stable_adamw":
    return stable_adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=wd,
                        mask=decay_mask)
  if opt.name == "adafactor":  # its factored moments are small: selected after the update
    return optax.adafactor(schedule, weight_decay_rate=wd or None,
                           weight_decay_mask=decay_mask if wd else None)
  raise ValueError(f"optimizer.name must be adamw, stable_adamw, lamb or adafactor, got "
                   f"{opt.name!r}")
