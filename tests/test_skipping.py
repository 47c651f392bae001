"""The optimizer's side of the spike guard's skip (bertjax.training.skipping): bit-identical to
optax's AdamW and LAMB when nothing is skipped, every optimizer's state kept exactly on a skip,
and no copy of the moments in the compiled step (the select after optax's update made two)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.config.schema import optimizer_group
from bertjax.resilience.guard import unless_skipped
from bertjax.training import optim


def _opt(**kw):
  cfg = optimizer_group()
  cfg.update(dict(learning_rate=1e-2, warmup_steps=2, weight_decay=0.01, clip_norm=1.0))
  cfg.update(kw)
  return cfg


def _params():
  keys = jax.random.split(jax.random.key(0), 3)
  return {"encoder": {"dense": {"kernel": jax.random.normal(keys[0], (16, 8)),
                                "bias": jnp.zeros(8)}},
          "mlm_head": {"kernel": jax.random.normal(keys[1], (8, 4))},
          "norm": {"scale": jnp.ones(8)}}


def _grads(i, params, scale=1.0):
  return jax.tree.map(lambda p: scale * jax.random.normal(jax.random.key(100 + i), p.shape),
                      params)


def _same(a, b) -> bool:
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_the_skippable_optimizers_are_optaxs_bit_for_bit(name):
  """Five steps of the built optimizer (told `skip=False` as the guarded step tells it, and not
  told) against optax.adamw / optax.lamb after the same clipping: the same state structure
  (checkpoints interchangeable) and the same bits."""
  opt = _opt(name=name)
  ours, schedule = optim.build_optimizer(opt, 20)
  core = (optax.adamw if name == "adamw" else optax.lamb)(
      schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
      mask=optim.decay_mask)
  theirs = optax.chain(optim.clip_by_global_norm(1.0), core)
  params = _params()
  runs = {"told": (params, ours.init(params)), "untold": (params, ours.init(params)),
          "optax": (params, theirs.init(params))}
  assert jax.tree.structure(runs["told"][1]) == jax.tree.structure(runs["optax"][1])

  @jax.jit
  def step(params, state, grads, skip):
    updates, state = ours.update(grads, state, params, skip=skip)
    return optax.apply_updates(params, updates), state

  plain = {k: jax.jit(lambda p, s, g, tx=tx: (lambda u, s2: (optax.apply_updates(p, u), s2))(
      *tx.update(g, s, p))) for k, tx in (("untold", ours), ("optax", theirs))}
  for i in range(5):
    grads = _grads(i, params)
    runs["told"] = step(*runs["told"], grads, jnp.asarray(False))
    for k in plain:
      runs[k] = plain[k](*runs[k], grads)
  assert _same(runs["told"], runs["optax"]) and _same(runs["untold"], runs["optax"])


@pytest.mark.parametrize("opt", [
    dict(name="adamw"), dict(name="lamb"), dict(name="stable_adamw"),
    dict(name="adafactor", clip_norm=0.0),
    dict(name="adamw", head_learning_rate=1e-1, freeze="embeddings")],
    ids=["adamw", "lamb", "stable_adamw", "adafactor", "groups"])
def test_a_skipped_update_leaves_the_state_as_it_was(opt):
  """Two steps, then a skipped one on NaN gradients: the state comes back bit for bit (step
  counts included), and the run goes on exactly as one that never met the bad batch."""
  tx, _ = optim.build_optimizer(_opt(**opt), 20)
  params = _params()

  @jax.jit
  def step(params, state, grads, skip):
    updates, new_state = tx.update(grads, state, params, skip=skip)
    return unless_skipped(skip, params, optax.apply_updates(params, updates)), new_state

  no, yes = jnp.asarray(False), jnp.asarray(True)
  clean = guarded = (params, tx.init(params))
  for i in range(2):
    clean = step(*clean, _grads(i, params), no)
    guarded = step(*guarded, _grads(i, params), no)
  before = guarded
  guarded = step(*guarded, _grads(9, params, scale=jnp.nan), yes)
  assert _same(guarded, before)
  for i in range(2, 4):
    clean = step(*clean, _grads(i, params), no)
    guarded = step(*guarded, _grads(i, params), no)
  assert _same(guarded, clean)


def _copies(update) -> int:
  """Copies of a moment-sized buffer in the compiled step, donated as the trainer donates."""
  params = {"w": jnp.zeros((512, 256))}

  def step(params, state, grads):
    skip = optax.global_norm(grads) > 1e6
    return update(params, state, grads, skip)

  tx, _ = optim.build_optimizer(_opt(name="adamw", clip_norm=0.0), 20)
  text = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, tx.init(params), {"w": jnp.ones((512, 256))}).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  return len(re.findall(r"= f32\[512,256\]\S* copy\(", entry[:entry.index("\n}")]))


def test_the_skip_writes_no_copy_of_the_moments():
  """The skip selects Adam's moments before its direction is computed from them: no copies. The
  select after optax's update, which the guard used to make, copies both moments (the check
  is shown to see them)."""
  tx, _ = optim.build_optimizer(_opt(name="adamw", clip_norm=0.0), 20)

  def ours(params, state, grads, skip):
    updates, state = tx.update(grads, state, params, skip=skip)
    return unless_skipped(skip, params, optax.apply_updates(params, updates)), state

  def select_after(params, state, grads, skip):
    updates, new_state = tx.update(grads, state, params)
    return unless_skipped(skip, (params, state),
                          (optax.apply_updates(params, updates), new_state))

  assert _copies(ours) == 0
  assert _copies(select_after) >= 2
