"""The in-step spike guard: inside the jitted train step, a loss or gradient norm far above its
recent values, or one that is not finite, skips that update; a run of skips (or a non-finite
step) raises an alarm that the host reads with the step's metrics and acts on
(bertjax.resilience.policy). No host sync: the running statistics live in the train state.

The guide: docs/resilience.md, 'The spike guard'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections


@dataclasses.dataclass(frozen=True)
class GuardSettings:
  """The `resilience` keys the jitted step reads (static: a change recompiles)."""

  sigmas: float  # an outlier is above mean + sigmas * std of the history (0: guard off)
  history: int  # accepted steps the mean and std are taken over
  min_history: int  # steps seen before anything is judged an outlier (non-finite: always)
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
               int(r.alarm_skips), int(r.alarm_window), bool(r.get("skip_spikes", True)))


@flax.struct.dataclass
class GuardState:
  """Running statistics carried in the train state (replicated, a few hundred numbers)."""

  losses: jax.Array  # f32[history]: the losses of the latest accepted steps (a ring)
  grad_norms: jax.Array  # f32[history]: their gradient norms
  accepted: jax.Array  # i32: accepted steps so far (the ring's next slot is accepted % history)
  skipped: jax.Array  # i32: updates skipped so far
  skip_steps: jax.Array  # i32[alarm_skips]: the 1-based steps of the latest skips (0: none)
  # i32: 0, or the first step of the trouble the alarm is about (sticky until the host acts).
  alarm: jax.Array


def init(settings: GuardSettings) -> GuardState:
  return GuardState(jnp.zeros((settings.history,), jnp.float32),
                    jnp.zeros((settings.history,), jnp.float32), jnp.zeros((), jnp.int32),
                    jnp.zeros((), jnp.int32), jnp.zeros((settings.alarm_skips,), jnp.int32),
                    jnp.zeros((), jnp.int32))


def _above(history: jax.Array, count: jax.Array, value: jax.Array, sigmas: float
           ) -> jax.Array:
  """Whether `value` is above mean + sigmas * std of the first `count` entries of the ring."""
  valid = jnp.arange(history.shape[0]) < count
  n = jnp.maximum(count, 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(valid, history, 0.0)) / n
  var = jnp.sum(jnp.where(valid, jnp.square(history - mean), 0.0)) / n
  return value > mean + sigmas * jnp.sqrt(var)


def judge(guard: GuardState, step: jax.Array, loss: jax.Array, grad_norm: jax.Array,
          settings: GuardSettings) -> tuple[GuardState, jax.Array]:
  """The guard after step `step` (1-based) and whether its update is skipped."""
  loss = loss.astype(jnp.float32)
  grad_norm = grad_norm.astype(jnp.float32)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  count = jnp.minimum(guard.accepted, settings.history)
  judged = guard.accepted >= settings.min_history
  loss_outlier = judged & _above(guard.losses, count, loss, settings.sigmas)
  norm_outlier = judged & _above(guard.grad_norms, count, grad_norm, settings.sigmas)
  # A gradient-norm spike right after a skipped step is the parameters', not the batch's:
  # the skipped step left them where they were and another batch finds the same cliff.
  # Skipping cannot get past it (every later step would be skipped; found by a DistilBERT
  # run), so that update is taken (clipped like any other) and kept out of the statistics.
  cliff = norm_outlier & ~loss_outlier & finite & (guard.skip_steps[-1] == step - 1)
  skip = ~finite | ((loss_outlier | norm_outlier) & ~cliff)
  slot = guard.accepted % settings.history
  counted = ~skip & ~cliff  # the steps whose values enter the statistics
  keep = lambda ring, value: jnp.where(counted, ring.at[slot].set(value), ring)  # noqa: E731
  skip_steps = jnp.where(skip, jnp.roll(guard.skip_steps, -1).at[-1].set(step),
                         guard.skip_steps)
  # The oldest of the latest `alarm_skips` skips, when they all fall within the window.
  oldest = skip_steps[0]
  crowded = (oldest > 0) & (step - oldest < settings.alarm_window)
  trouble_from = jnp.where(~finite, jnp.where(crowded, oldest, step),
                           jnp.where(crowded, oldest, 0))
  alarm = jnp.where(guard.alarm > 0, guard.alarm,
                    jnp.where(skip, trouble_from, 0)).astype(jnp.int32)
  new = GuardState(keep(guard.losses, loss), keep(guard.grad_norms, grad_norm),
                   guard.accepted + counted.astype(jnp.int32),
                   guard.skipped + skip.astype(jnp.int32), skip_steps, alarm)
  return new, skip


def unless_skipped(skip: jax.Array, old: Any, new: Any) -> Any:
  """`new`, or `old` where the update is skipped: a select, elementwise, so a step that is
  not skipped is bit-identical to one without the guard."""
  return jax.tree.map(lambda o, n: jnp.where(skip, o, n), old, new)


def metrics(guard: GuardState, skip: jax.Array) -> dict[str, jax.Array]:
  """What the host reads with the step's metrics."""
  return {"skipped": skip.astype(jnp.float32), "last_skipped_step": guard.skip_steps[-1]
          .astype(jnp.float32),
          "skipped_updates": guard.skipped.astype(jnp.float32),
          "spike_alarm": guard.alarm.astype(jnp.float32)}
