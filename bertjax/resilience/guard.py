"""The in-step spike guard: inside the jitted train step, an update whose loss and gradient norm
are both far above their recent values, or whose loss or norm is not finite, is skipped; a run
of skips (or a non-finite step) raises an alarm that the host reads with the step's metrics and
acts on (bertjax.resilience.policy). No host sync: the running statistics live in the train
state.

The guide: docs/resilience.md, 'The spike guard'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

# The scale of a normal distribution from its median absolute deviation: sigma = 1.4826 MAD.
_MAD_TO_SIGMA = 1.4826
# Values are judged as logarithms (a spike multiplies the loss and the gradient norm); a loss
# of 0 or below is taken as this, so it is never an outlier.
_SMALLEST = 1e-30


@dataclasses.dataclass(frozen=True)
class GuardSettings:
  """The `resilience` keys the jitted step reads (static: a change recompiles)."""

  sigmas: float  # an outlier is above median + sigmas * the history's step noise (0: off)
  history: int  # accepted steps the median and MAD are taken over
  min_history: int  # accepted steps before anything finite is judged an outlier
  min_ratio: float  # ... and never one less than this many times the history's median
  # A loss spike is also above the highest loss of the run so far, decayed by half every this
  # many accepted steps: a level the run was at recently is no instability.
  peak_half_life: float
  alarm_skips: int  # this many skips ...
  alarm_window: int  # ... within this many steps raise the alarm
  # Keep the old parameters and moments on an outlier step (False: the update is applied and
  # the outlier only counted towards the alarm, which rewinds the run).
  skip: bool = True

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> GuardSettings | None:
    r = config.get("resilience")
    if r is None or float(r.spike_sigmas) <= 0:
      return None
    return cls(float(r.spike_sigmas), int(r.spike_history), int(r.spike_min_history),
               float(r.spike_min_ratio), float(r.spike_peak_half_life), int(r.alarm_skips),
               int(r.alarm_window), bool(r.get("skip_spikes", True)))


@flax.struct.dataclass
class GuardState:
  """Running statistics carried in the train state (replicated, a few hundred numbers). The
  field names are the checkpoint's: a checkpoint whose guard has other names (an earlier
  rule's) starts the statistics afresh."""

  log_losses: jax.Array  # f32[history]: log loss of the latest accepted steps (a ring)
  log_grad_norms: jax.Array  # f32[history]: log of their gradient norms
  # f32: the highest log loss so far, less log 2 per peak_half_life accepted steps since.
  log_loss_peak: jax.Array
  accepted: jax.Array  # i32: accepted steps so far (the ring's next slot is accepted % history)
  skipped: jax.Array  # i32: updates skipped so far
  skip_steps: jax.Array  # i32[alarm_skips]: the 1-based steps of the latest skips (0: none)
  # f32[2]: the loss and gradient norm of the latest skipped step (what its record says).
  skip_values: jax.Array
  # i32: 0, or the first step of the trouble the alarm is about (sticky until the host acts).
  alarm: jax.Array


def init(settings: GuardSettings) -> GuardState:
  return GuardState(jnp.zeros((settings.history,), jnp.float32),
                    jnp.zeros((settings.history,), jnp.float32), jnp.zeros((), jnp.float32),
                    jnp.zeros((), jnp.int32),
                    jnp.zeros((), jnp.int32), jnp.zeros((settings.alarm_skips,), jnp.int32),
                    jnp.zeros((2,), jnp.float32), jnp.zeros((), jnp.int32))


def _median(values: jax.Array, valid: jax.Array) -> jax.Array:
  """The median of the entries of `values` where `valid` (at least one)."""
  ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
  n = jnp.maximum(jnp.sum(valid), 1)
  return 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])


def threshold(ring: jax.Array, count: jax.Array, newest: jax.Array, sigmas: float,
              min_ratio: float) -> jax.Array:
  """The log value above which an entry is an outlier against the first `count` entries of
  `ring` (log values in time order but for the wrap after slot `newest`): the median + sigmas
  robust standard deviations of the step-to-step noise, at least log min_ratio above the
  median, and never below the highest entry.

  The noise is 1.4826 MAD of consecutive differences over sqrt 2: a trend (the fast fall of
  early training) does not widen it as it widens the spread around the median, so a spike
  stands out early too; median-based, a few earlier outliers move nothing. The highest: a
  series with heavy tails (a fine-tune's hard batches once its loss is near zero) has shown
  values that high, and they were healthy."""
  index = jnp.arange(ring.shape[0])
  valid = index < jnp.maximum(count, 1)
  center = _median(ring, valid)
  # ring[i] - ring[i - 1] for the valid pairs of consecutive entries (not across the wrap).
  steps = jnp.abs(ring - jnp.roll(ring, 1))
  paired = valid & (index >= 1) & (index != (newest + 1) % ring.shape[0])
  noise = _MAD_TO_SIGMA * _median(steps, paired) / math.sqrt(2)
  highest = jnp.max(jnp.where(valid, ring, -jnp.inf))
  return jnp.maximum(center + jnp.maximum(sigmas * noise, math.log(min_ratio)), highest)


def _log(value: jax.Array) -> jax.Array:
  return jnp.log(jnp.maximum(value.astype(jnp.float32), _SMALLEST))


def judge(guard: GuardState, step: jax.Array, loss: jax.Array, grad_norm: jax.Array,
          settings: GuardSettings) -> tuple[GuardState, jax.Array]:
  """The guard after step `step` (1-based) and whether its update is skipped.

  A finite update is skipped only when its loss and its gradient norm are both outliers: a
  batch that the model finds much harder than any recent one and that pushes it much harder.
  Either alone is ordinary training: gradient norms jump while the loss falls early in a run,
  and a fine-tune's hard batches have high losses with norms in their usual range.
  """
  loss = loss.astype(jnp.float32)
  grad_norm = grad_norm.astype(jnp.float32)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  log_loss, log_norm = _log(loss), _log(grad_norm)
  count = jnp.minimum(guard.accepted, settings.history)
  judged = guard.accepted >= settings.min_history
  newest = (guard.accepted - 1) % settings.history  # the slot of the latest accepted step
  above = lambda ring, value: value > threshold(  # noqa: E731
      ring, count, newest, settings.sigmas, settings.min_ratio)
  # The decayed peak of the loss: a fine-tune whose loss fell from 0.7 to 0.001 meets batches
  # at 0.1-0.2 (one misclassified example), far above its recent steps but below where it was.
  decay = math.log(2.0) / settings.peak_half_life
  peak = jnp.where(guard.accepted > 0, guard.log_loss_peak, log_loss)
  spike = (judged & (log_loss > peak) & above(guard.log_losses, log_loss)
           & above(guard.log_grad_norms, log_norm))
  skip = ~finite | spike
  slot = guard.accepted % settings.history
  keep = lambda ring, value: jnp.where(skip, ring, ring.at[slot].set(value))  # noqa: E731
  skip_steps = jnp.where(skip, jnp.roll(guard.skip_steps, -1).at[-1].set(step),
                         guard.skip_steps)
  skip_values = jnp.where(skip, jnp.stack([loss, grad_norm]), guard.skip_values)
  # The oldest of the latest `alarm_skips` skips, when they all fall within the window.
  oldest = skip_steps[0]
  crowded = (oldest > 0) & (step - oldest < settings.alarm_window)
  trouble_from = jnp.where(~finite, jnp.where(crowded, oldest, step),
                           jnp.where(crowded, oldest, 0))
  alarm = jnp.where(guard.alarm > 0, guard.alarm,
                    jnp.where(skip, trouble_from, 0)).astype(jnp.int32)
  new_peak = jnp.where(skip, peak, jnp.maximum(log_loss, peak - decay))
  new = GuardState(keep(guard.log_losses, log_loss), keep(guard.log_grad_norms, log_norm),
                   new_peak, guard.accepted + (~skip).astype(jnp.int32),
                   guard.skipped + skip.astype(jnp.int32), skip_steps, skip_values, alarm)
  return new, skip


def unless_skipped(skip: jax.Array, old: Any, new: Any) -> Any:
  """`new`, or `old` where the update is skipped: a select, elementwise, so a step that is
  not skipped is bit-identical to one without the guard."""
  return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)


def metrics(guard: GuardState, skip: jax.Array) -> dict[str, jax.Array]:
  """What the host reads with the step's metrics: the verdict, the running count, and the
  latest skipped step with its own loss and gradient norm (a read at a later step names the
  skipped step's values, not the values of the step it was read at)."""
  return {"skipped": skip.astype(jnp.float32),
          "last_skipped_step": guard.skip_steps[-1].astype(jnp.float32),
          "last_skipped_loss": guard.skip_values[0],
          "last_skipped_grad_norm": guard.skip_values[1],
          "skipped_updates": guard.skipped.astype(jnp.float32),
          "spike_alarm": guard.alarm.astype(jnp.float32)}
