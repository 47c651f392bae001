"""The hash dropout mask: Bernoulli statistics, independence, sharding invariance, and the
threefry option equal to flax.linen.Dropout."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from bertjax.parallel import sharding
from bertjax.models import ModelConfig
from bertjax.models.dropout import Dropout, hash_keep_mask

ATTENTION_SHAPE = (4, 12, 128, 128)  # [batch, heads, query, key]: 786,432 draws


def _within_sigmas(observed: float, p: float, n: int, sigmas: float = 5.0) -> bool:
  return abs(observed - p) <= sigmas * np.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_matches_one_minus_rate(rate):
  for seed in range(3):
    keep = np.asarray(hash_keep_mask(jax.random.key(seed), ATTENTION_SHAPE, rate))
    assert _within_sigmas(keep.mean(), 1 - rate, keep.size), (seed, keep.mean())
    # Every query row and every (batch, head) map on its own, too (not only on average).
    per_map = keep.reshape(-1, 128 * 128).mean(axis=1)
    assert all(_within_sigmas(m, 1 - rate, 128 * 128) for m in per_map)


def test_neighbours_rows_and_maps_are_independent():
  """Joint keep frequency of element pairs at distance 1 along each axis equals p², so
  neighbouring keys, queries, heads and sequences do not share bits."""
  p = 0.5
  keep = np.asarray(hash_keep_mask(jax.random.key(0), ATTENTION_SHAPE, 1 - p))
  for axis in range(4):
    a = np.take(keep, range(keep.shape[axis] - 1), axis=axis)
    b = np.take(keep, range(1, keep.shape[axis]), axis=axis)
    joint = (a & b).mean()
    assert _within_sigmas(joint, p * p, a.size), (axis, joint)


def test_different_keys_give_independent_masks_and_the_same_key_the_same_mask():
  p = 0.9
  a = np.asarray(hash_keep_mask(jax.random.key(1), ATTENTION_SHAPE, 1 - p))
  b = np.asarray(hash_keep_mask(jax.random.key(2), ATTENTION_SHAPE, 1 - p))
  again = np.asarray(hash_keep_mask(jax.random.key(1), ATTENTION_SHAPE, 1 - p))
  np.testing.assert_array_equal(a, again)
  assert _within_sigmas((a == b).mean(), p * p + (1 - p) ** 2, a.size)


def test_dropout_preserves_the_expectation_and_scales_kept_elements():
  x = jnp.full((64, 128, 96), 3.0)
  y = np.asarray(Dropout(0.2).apply({}, x, deterministic=False,
                                    rngs={"dropout": jax.random.key(0)}))
  np.testing.assert_allclose(np.unique(y), [0.0, 3.0 / 0.8], rtol=1e-6)
  assert abs(y.mean() - 3.0) < 5 * 3.0 / 0.8 * np.sqrt(0.2 * 0.8 / y.size)
  np.testing.assert_array_equal(Dropout(0.2).apply({}, x, deterministic=True), x)


def test_mask_is_the_same_however_the_tensor_is_sharded(devices):
  """The bits are a function of each element's global index: a mask built sharded over
  batch and key axes equals the one built on one device."""
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  layout = NamedSharding(mesh, PartitionSpec("data", "tensor", None, "fsdp"))
  build = lambda key: hash_keep_mask(key, ATTENTION_SHAPE, 0.1)  # noqa: E731
  sharded = jax.jit(build, out_shardings=layout)(jax.random.key(3))
  assert sharded.sharding.spec == layout.spec
  np.testing.assert_array_equal(np.asarray(sharded), np.asarray(jax.jit(build)(jax.random.key(3))))


def test_threefry_option_is_flax_dropout():
  x = jax.random.normal(jax.random.key(0), (8, 16, 32))
  rngs = {"dropout": jax.random.key(5)}
  ours = Dropout(0.3, rng="threefry").apply({}, x, deterministic=False, rngs=rngs)
  flax = nn.Dropout(0.3).apply({}, x, deterministic=False, rngs=rngs)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(flax))


def test_bad_settings_are_named():
  with pytest.raises(ValueError, match="inner|part"):
    hash_keep_mask(jax.random.key(0), (2, 70_000, 70_000), 0.1)  # 4.9e9 > 2**32 per map
  with pytest.raises(ValueError, match="dropout rate"):
    hash_keep_mask(jax.random.key(0), (4, 4), 1.5)
  with pytest.raises(ValueError, match="dropout_rng"):
    ModelConfig(family="bert", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1,
                mlp_dim=8, max_positions=8, dropout_rng="philox")
