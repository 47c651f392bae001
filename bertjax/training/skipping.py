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
  inner = optax.with_extra_args_support(transform)

  def update(updates: Any, state: Any, params: Any = None, *, skip: jax.Array | None = None,
             **extra_args: Any) -> tuple[Any, Any]:
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    if skip is not None:
      new_state = unless_skipped(skip, state, new_state)
    return new_updates, new_state

  return SkipAware(transform.init, update)


def skippable_chain(*transforms: optax.GradientTransformation) -> SkipAware:
  """`optax.chain` (the same state: a tuple of theirs) of skippable transforms (it passes
  `skip` to each)."""
  return SkipAware(*optax.chain(*(skippable(t) for t in transforms)))


def skippable_partition(transforms: dict[str, optax.GradientTransformation],
                        labels: Any) -> SkipAware:
  """`optax.multi_transform` over skippable transforms (it passes `skip` to each group's)."""
  return SkipAware(*optax.multi_transform({k: skippable(t) for k, t in transforms.items()},
                                          labels))


def moments_unless_skipped(skip: jax.Array | None, state: Any, mu: Any, nu: Any,
                           count: jax.Array) -> tuple[Any, Any, jax.Array]:
  """An Adam-like update's new moments and step count, or `state`'s where `skip` is true;
  selected before the step is computed from them (no `skip`: the new ones)."""
  if skip is None:
    return mu, nu, count
  mu, nu = unless_skipped(skip, (state.mu, state.nu), (mu, nu))
  return mu, nu, jnp.where(skip, state.count, count)


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
    mu, nu, count = moments_unless_skipped(skip, state, mu, nu,
                                           optax.safe_increment(state.count))
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    return direction, optax.ScaleByAdamState(count=count, mu=mu,
                                             nu=optax.tree.cast_like(nu, state.nu))

  return SkipAware(adam.init, update)
