"""Optimizer: learning-rate schedules and the weight-decay mask against hand-computed values."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.config.schema import optimizer_group
from bertjax.training import optim
from bertjax.models import ModelConfig, build_model, jit_init


def _opt(**kw):
  cfg = optimizer_group()
  cfg.update(kw)
  return cfg


def test_linear_warmup_then_linear_decay_to_zero():
  schedule = optim.learning_rate_schedule(_opt(learning_rate=1e-4, warmup_steps=10), 110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.5e-4)
  assert float(schedule(10)) == pytest.approx(1e-4)  # warmup endpoint = peak
  assert float(schedule(60)) == pytest.approx(0.5e-4)  # halfway through decay
  assert float(schedule(110)) == pytest.approx(0.0, abs=1e-12)  # decay end


def test_cosine_to_floor_then_constant():
  schedule = optim.learning_rate_schedule(
      _opt(learning_rate=6e-4, warmup_steps=100, schedule="cosine", end_lr_fraction=0.1,
           decay_steps=1100), 2000)
  assert float(schedule(100)) == pytest.approx(6e-4)
  # Halfway: floor + (peak - floor) * (1 + cos(pi/2)) / 2 = 0.55 * peak.
  assert float(schedule(600)) == pytest.approx(0.55 * 6e-4, rel=1e-5)
  assert float(schedule(1100)) == pytest.approx(6e-5, rel=1e-5)
  assert float(schedule(1900)) == pytest.approx(6e-5, rel=1e-5)


def test_warmup_longer_than_training_is_clipped_with_a_warning(caplog):
  """Shortening a run takes one override: the warmup ends at the last step, peak reached."""
  schedule = optim.learning_rate_schedule(_opt(learning_rate=1e-4, warmup_steps=20), 10)
  assert "warmup_steps=20 exceeds the 10 steps scheduled" in caplog.text
  assert float(schedule(5)) == pytest.approx(5e-5)
  assert float(schedule(10)) == pytest.approx(1e-4)


def test_decay_mask_excludes_layernorm_and_biases():
  cfg = ModelConfig(family="bert", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                    mlp_dim=32, max_positions=8)
  params = jit_init(build_model(cfg))(jax.random.key(0))
  mask = optim.decay_mask(params)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(mask)}
  decayed = {k for k, v in flat.items() if v}
  assert "['bert']['word_embeddings']['embedding']" in decayed
  assert "['bert']['encoder']['layers']['mlp']['wi']['kernel']" in decayed
  for name, value in flat.items():
    if "norm" in name or name.endswith("['bias']") or "mlm_bias" in name:
      assert not value, name


@pytest.mark.parametrize("name", ["adamw", "stable_adamw", "lamb"])
def test_weight_decay_reaches_kernels_only(name):
  """With zero gradients, only decayed parameters move: by exactly lr * wd * value (AdamW)."""
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
            "norm": {"scale": jnp.ones(2)}}
  tx, _ = optim.build_optimizer(_opt(name=name, learning_rate=0.1, warmup_steps=0,
                                     schedule="constant", weight_decay=0.5), 10)
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert np.all(np.asarray(new["dense"]["bias"]) == 1.0)
  assert np.all(np.asarray(new["norm"]["scale"]) == 1.0)
  if name in ("adamw", "stable_adamw"):
    np.testing.assert_allclose(np.asarray(new["dense"]["kernel"]), 1 - 0.1 * 0.5, rtol=1e-6)
  else:
    assert np.all(np.asarray(new["dense"]["kernel"]) < 1.0)


def test_global_norm_clipping_precedes_the_optimizer():
  """With b1=b2=0 and a huge eps, Adam's update is g/eps: proportional to the clipped gradient.
  Gradients of norm 20 and 200 clip to the same norm 1, so their updates are identical."""
  tx, _ = optim.build_optimizer(_opt(learning_rate=1.0, warmup_steps=0, schedule="constant",
                                     weight_decay=0.0, clip_norm=1.0, b1=0.0, b2=0.0,
                                     eps=1e6), 10)
  params = {"w": jnp.zeros(4)}
  small, _ = tx.update({"w": jnp.full(4, 10.0)}, tx.init(params), params)
  large, _ = tx.update({"w": jnp.full(4, 100.0)}, tx.init(params), params)
  np.testing.assert_allclose(np.asarray(small["w"]), np.asarray(large["w"]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(small["w"]), -0.5 / 1e6, rtol=1e-4)


@pytest.mark.parametrize("scale", [1e-3, 3.0, 1e4])
def test_clipping_equals_optax_and_writes_no_scaled_copy(scale):
  """`optim.clip_by_global_norm` against optax's: unclipped gradients bit-identical, clipped
  ones within float32 rounding, the same (empty) state; and in the compiled AdamW step no
  buffer holds the clipped gradients: the scale is fused into the moments' updates (optax's
  divide writes one out per parameter, checked: the HLO test then fails)."""
  grads = {"w": jax.random.normal(jax.random.key(0), (64, 32)) * scale,
           "b": jax.random.normal(jax.random.key(1), (32,)) * scale}
  ours_clip, optax_clip = optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
  ours, ours_state = ours_clip.update(grads, ours_clip.init(grads))
  theirs, theirs_state = optax_clip.update(grads, optax_clip.init(grads))
  assert type(ours_state) is type(theirs_state)
  for name in grads:
    np.testing.assert_allclose(ours[name], theirs[name], rtol=2e-7, atol=0)
  if scale < 1.0:  # a norm of about 0.05: not clipped
    assert all(np.array_equal(ours[k], grads[k]) for k in grads)

  tx = optax.chain(ours_clip, optax.adamw(1e-3))

  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params = {"w": jnp.zeros((512, 256))}
  big = {"w": jnp.ones((512, 256))}
  state = tx.init(params)
  text = jax.jit(step).lower(params, big, state).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  written = [line for line in entry.splitlines()
             if re.search(r"= f32\[512,256\]\S* (?!parameter|bitcast|get-tuple-element)", line)]
  assert len(written) == 3, written


def test_adafactor_builds_and_steps():
  tx, _ = optim.build_optimizer(_opt(name="adafactor", learning_rate=1e-2, warmup_steps=0,
                                     schedule="constant"), 10)
  params = {"dense": {"kernel": jnp.ones((256, 128)), "bias": jnp.ones(128)}}
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert float(jnp.abs(updates["dense"]["kernel"]).sum()) > 0


@pytest.mark.parametrize("shape, halfway", [("linear", 0.5), ("cosine", 0.5),
                                            ("1-sqrt", 1 - 0.5 ** 0.5)])
def test_warmup_stable_decay(shape, halfway):
  """10 warmup steps, then 100: constant for 80, the last 20 (decay_fraction 0.2) down to
  the floor (10% of the peak) along the shape."""
  schedule = optim.learning_rate_schedule(
      _opt(learning_rate=1e-3, warmup_steps=10, schedule="wsd", decay_fraction=0.2,
           decay_shape=shape, end_lr_fraction=0.1), 110)
  floor = 1e-4
  assert float(schedule(5)) == pytest.approx(0.5e-3)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(90)) == pytest.approx(1e-3)  # the end of the stable part
  assert float(schedule(100)) == pytest.approx(floor + (1e-3 - floor) * halfway, rel=1e-5)
  assert float(schedule(110)) == pytest.approx(floor, rel=1e-5)
  assert float(schedule(200)) == pytest.approx(floor, rel=1e-5)


def test_a_wsd_shape_or_fraction_out_of_range_is_refused():
  with pytest.raises(ValueError, match="decay_shape must be one of linear, cosine, 1-sqrt"):
    optim.learning_rate_schedule(_opt(schedule="wsd", decay_shape="sqrt"), 100)
  with pytest.raises(ValueError, match="decay_fraction must be in"):
    optim.learning_rate_schedule(_opt(schedule="wsd", decay_fraction=0.0), 100)


def _stable_adamw_reference(gradients, lr, b1, b2, eps):
  """Wortsman et al. 2023, Alg. 2 for one tensor, in numpy (float64), no weight decay."""
  m = v = np.zeros_like(gradients[0], np.float64)
  steps = []
  for t, g in enumerate(gradients, start=1):
    g = np.asarray(g, np.float64)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    rms = np.sqrt(np.mean(g * g / np.maximum(v_hat, eps * eps)))
    steps.append(-lr / max(1.0, rms) * m_hat / (np.sqrt(v_hat) + eps))
  return steps


def _run(tx, gradients_a, gradients_b):
  params = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(5)}
  state, steps = tx.init(params), []
  for a, b in zip(gradients_a, gradients_b):
    updates, state = tx.update({"a": jnp.asarray(a), "b": jnp.asarray(b)}, state, params)
    steps.append({k: np.asarray(v) for k, v in updates.items()})
  return steps


def test_stable_adamw_clips_each_tensors_step_as_the_paper_does():
  """Both tensors' steps equal a numpy transcription of the algorithm; a gradient spike in one
  tensor shrinks that tensor's step below AdamW's and leaves the other tensor's unchanged."""
  rng = np.random.RandomState(0)
  quiet = [rng.normal(size=(4, 3)).astype(np.float32) * 1e-2 for _ in range(6)]
  spiky = [x.copy() for x in quiet]
  spiky[4] = spiky[4] * 300.0
  other = [rng.normal(size=5).astype(np.float32) for _ in range(6)]
  hyper = dict(learning_rate=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.0,
               clip_norm=0.0, b1=0.9, b2=0.98, eps=1e-6)
  tx, _ = optim.build_optimizer(_opt(name="stable_adamw", **hyper), 10)
  ours, calm = _run(tx, spiky, other), _run(tx, quiet, other)
  for name, gradients in (("a", spiky), ("b", other)):
    reference = _stable_adamw_reference(gradients, 1e-2, 0.9, 0.98, 1e-6)
    for got, want in zip(ours, reference):
      np.testing.assert_allclose(got[name], want, rtol=2e-5, atol=1e-9)
  for spiked, unspiked in zip(ours, calm):
    np.testing.assert_array_equal(spiked["b"], unspiked["b"])
  adamw, _ = optim.build_optimizer(_opt(name="adamw", **hyper), 10)
  plain = _run(adamw, spiky, other)
  assert np.abs(ours[4]["a"]).max() < 0.5 * np.abs(plain[4]["a"]).max()
