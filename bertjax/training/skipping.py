"""Optimizer updates that the spike guard (bertjax.resilience.guard) skips at no cost: told
`skip`, Adam's moments are selected before its step is computed from them, so XLA fuses the
update as it fuses the plain one; small states are selected after. The guide:
docs/resilience.md, 'What the guard costs'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from bertjax.resilience.guard import unless_skipped

# Why not select the whole state after optax's update: the new moment is then no longer an
# output, so XLA recomputes it inside the parameters' fusion from the old one, which the
# selecting fusion overwrites in place; XLA:CPU copies each moment first (+2.7% of a BERT-base
# step, +4.8% of GPT-2 small's). Selected before the step reads them, the moments are outputs
# again and the fused loops are the plain update's: bit-identical when nothing is skipped.


class SkipAware(optax.GradientTransformationExtraArgs):
  """A transformation whose `update(..., skip=...)` returns its state unchanged where the
  scalar `skip` is true (its updates are then meaningless: the caller keeps the parameters).
  Without `skip` it is the transformation it wraps."""


def skippable(transform: optax.GradientTransformation) -> SkipAware:
  """`transform` taking `skip`; its state's structure is unchanged (checkpoints stay
  interchangeable). One that is SkipAware already passes `skip` on; for any other the new
  state is selected after its update."""
  if isinstance(transform, SkipAware):
    return transform

  def update(updates: Any, state: Any, params: Any = None, *, skip: jax.Array | None = None,
             **extra_args: Any) -> tuple[Any, Any]:
    if isinstance(transform, optax.GradientTransformationExtraArgs):
      new_updates, new_state = transform.update(updates, state, params, **extra_args)
    else:
      new_updates, new_state = transform.update(updates, state, params)
    if skip is not None:
      new_state = unless_skipped(skip, state, new_state)
    return new_updates, new_state

  return SkipAware(transform.init, update)


def skippable_chain(*transforms: optax.GradientTransformation) -> SkipAware:
  """`optax.chain(*transforms)` (the same state: a tuple of theirs) passing `skip` to each."""
  parts = [skippable(t) for t in transforms]

  def init(params: Any) -> tuple:
    return tuple(part.init(params) for part in parts)

  def update(updates: Any, state: tuple, params: Any = None, **extra_args: Any
             ) -> tuple[Any, tuple]:
    if len(state) != len(parts):
      raise ValueError(f"an optimizer state of {len(state)} parts for a chain of {len(parts)}")
    new_state = []
    for part, part_state in zip(parts, state):
      updates, part_state = part.update(updates, part_state, params, **extra_args)
      new_state.append(part_state)
    return updates, tuple(new_state)

  return SkipAware(init, update)


def skippable_partition(transforms: dict[str, optax.GradientTransformation],
                        labels: Any) -> SkipAware:
  """`optax.multi_transform` over skippable transforms (it passes `skip` to each group's)."""
  partition = optax.multi_transform({k: skippable(t) for k, t in transforms.items()}, labels)
  return SkipAware(partition.init, partition.update)


def scale_by_adam(b1: float, b2: float, eps: float, eps_root: float = 0.0) -> SkipAware:
  """`optax.scale_by_adam` (its state, its arithmetic: optax's own moment and bias-correction
  helpers) with the skip selected between the moments and the direction computed from them."""
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root)

  def update(updates: Any, state: optax.ScaleByAdamState, params: Any = None, *,
             skip: jax.Array | None = None, **extra_args: Any
             ) -> tuple[Any, optax.ScaleByAdamState]:
    del params, extra_args
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    if skip is not None:
      mu, nu = unless_skipped(skip, (state.mu, state.nu), (mu, nu))
      count = jnp.where(skip, state.count, count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    return direction, optax.ScaleByAdamState(count=count, mu=mu,
                                             nu=optax.tree.cast_like(nu, state.nu))

  return SkipAware(adam.init, update)
