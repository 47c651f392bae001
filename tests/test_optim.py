"""Optimizer: learning-rate schedules and the weight-decay mask against hand-computed values."""

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


@pytest.mark.parametrize("name", ["adamw", "lamb"])
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
  if name == "adamw":
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


def test_adafactor_builds_and_steps():
  tx, _ = optim.build_optimizer(_opt(name="adafactor", learning_rate=1e-2, warmup_steps=0,
                                     schedule="constant"), 10)
  params = {"dense": {"kernel": jnp.ones((256, 128)), "bias": jnp.ones(128)}}
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  assert float(jnp.abs(updates["dense"]["kernel"]).sum()) > 0
