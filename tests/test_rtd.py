"""Replaced-token detection (ELECTRA, DeBERTa-v3): the generator and discriminator step's
properties, each checked also on a broken variant where it must fail; embedding sharing; mesh
invariance; the discriminator alone for fine-tuning and export."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_helpers
from bertjax.data import schema
from bertjax.models import ModelConfig, build_model, init_params, jit_init, layers
from bertjax.models.electra import discriminator_params, generator_params
from bertjax.training import objectives


def _config(sharing: str = "shared", **changes) -> ModelConfig:
  values = dict(family="bert", vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
                mlp_dim=128, max_positions=32, architecture="electra", embedding_size=32,
                pooler=False, generator_hidden_size=16, generator_num_heads=1,
                embedding_sharing=sharing, hidden_dropout=0.0, attention_dropout=0.0)
  values.update(changes)
  return ModelConfig(**values)


def _setup(sharing: str, seed: int = 0, **changes):
  config = _config(sharing, **changes)
  model = build_model(config)
  params = jit_init(model)(jax.random.key(seed))
  # Away from the init (a zero GDES residual, unit norms), so every path carries signal.
  params = jax.tree.map(jnp.asarray, train_helpers.perturbed(params, 0.05, seed))
  batch = {k: jnp.asarray(v) for k, v in schema.example_batch(
      "rtd", 4, 16, 4, vocab_size=config.vocab_size, seed=seed).items()}
  return config, model, params, batch


def _grads(objective, params, batch) -> dict:
  """The gradients of the discriminator's and of the generator's loss, in one program."""
  norm = objective.normalizers(batch)

  def losses(p):
    metrics = objective(p, batch, norm, jax.random.key(1))[1]
    return jnp.stack([metrics["disc_loss"], metrics["mlm_loss"]])
  grads = jax.jit(jax.jacrev(losses))(params)
  return {"disc_loss": jax.tree.map(lambda g: g[0], grads),
          "mlm_loss": jax.tree.map(lambda g: g[1], grads)}


def _max_abs(tree) -> float:
  return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))


def _no_stop_gradient(self):
  """A broken GDES: the discriminator's loss reaches the generator's table."""
  return self.embedding if self.base is None else self.base.embedding + self.embedding


@pytest.mark.slow
@pytest.mark.parametrize("sharing", ["shared", "gdes"])
def test_the_generator_gets_no_gradient_from_the_discriminator_loss(sharing, monkeypatch):
  _, model, params, batch = _setup(sharing)
  objective = objectives.build_objective("rtd", model)
  grads = _grads(objective, params, batch)
  from_disc, from_mlm = grads["disc_loss"], grads["mlm_loss"]
  assert _max_abs(from_disc["generator"]) == 0.0
  assert _max_abs(from_mlm["generator"]) > 1e-4  # the generator does learn, from its MLM
  assert _max_abs(from_disc["discriminator_predictions"]) > 1e-4
  if sharing == "shared":  # the shared tables learn from both losses (ELECTRA)
    assert _max_abs(from_disc["bert"]["word_embeddings"]) > 1e-6
    assert _max_abs(from_mlm["bert"]["word_embeddings"]) > 1e-6
  else:  # and the check fails where the stop-gradient is missing
    monkeypatch.setattr(layers.Embed, "table", _no_stop_gradient)
    broken = _grads(objective, params, batch)["disc_loss"]
    assert _max_abs(broken["generator"]) > 1e-6


@pytest.mark.slow
def test_gdes_the_shared_table_learns_from_the_generator_the_residual_from_the_discriminator(
    monkeypatch):
  config, model, params, batch = _setup("gdes")
  fresh = nn.meta.unbox(init_params(model, jax.random.key(0), 2, 16))
  assert not np.any(np.asarray(fresh["bert"]["word_embeddings"]["embedding"]))  # residual at 0
  objective = objectives.build_objective("rtd", model)
  grads = _grads(objective, params, batch)
  from_disc, from_mlm = grads["disc_loss"], grads["mlm_loss"]
  shared = ("generator", "bert", "word_embeddings", "embedding")
  table = lambda tree: tree[shared[0]][shared[1]][shared[2]][shared[3]]  # noqa: E731
  assert float(jnp.abs(table(from_disc)).max()) == 0.0
  assert float(jnp.abs(from_disc["bert"]["word_embeddings"]["embedding"]).max()) > 1e-6
  assert float(jnp.abs(table(from_mlm)).max()) > 1e-6
  # The discriminator reads the generator's rows plus its residual.
  plain = discriminator_params(params, config)
  np.testing.assert_array_equal(plain["bert"]["word_embeddings"]["embedding"],
                                table(params) + params["bert"]["word_embeddings"]["embedding"])
  assert "generator" not in plain
  monkeypatch.setattr(layers.Embed, "table", _no_stop_gradient)
  broken = _grads(objective, params, batch)["disc_loss"]
  assert float(jnp.abs(table(broken)).max()) > 1e-6


class _ScriptedModel:
  """Stands in for the RTD module: the generator's logits put all mass on `predict(batch)`,
  and the discriminator records the ids it is given."""

  def __init__(self, config: ModelConfig, predict):
    self.config, self.predict, self.seen = config, predict, []

  def apply(self, variables, *args, method=None, rngs=None, **kwargs):
    if method == "generate":
      ids = self.predict(args[3])
      return jnp.where(jax.nn.one_hot(ids, self.config.vocab_size) > 0, 0.0, -1e9)
    self.seen.append(args[0])
    return jnp.zeros(args[0].shape, jnp.float32)


@pytest.mark.parametrize("sample", ["original", "other"])
def test_a_sampled_token_equal_to_the_original_is_labelled_original(sample):
  config = _config()
  batch = {k: jnp.asarray(v) for k, v in schema.example_batch(
      "rtd", 4, 16, 4, vocab_size=config.vocab_size, seed=3).items()}
  # The inputs at the masked positions are [MASK] (id 4), as the data gives them.
  original = np.asarray(batch["input_ids"])
  masked = original.copy()
  rows = np.arange(4)[:, None]
  predicted = np.asarray(batch["masked_lm_weights"]) > 0
  masked[rows, np.asarray(batch["masked_lm_positions"])] = np.where(
      predicted, 4, original[rows, np.asarray(batch["masked_lm_positions"])])
  batch["input_ids"] = jnp.asarray(masked)
  targets = batch["masked_lm_ids"]
  if sample == "original":
    predict = lambda positions: targets  # noqa: E731
  else:
    predict = lambda positions: (targets + 1) % config.vocab_size  # noqa: E731
  model = _ScriptedModel(config, predict)
  objective = objectives.ReplacedTokenDetection(model)
  _, metrics = objective({}, batch, objective.normalizers(batch), jax.random.key(0))
  corrupted = np.asarray(model.seen[-1])
  if sample == "original":
    np.testing.assert_array_equal(corrupted, original)
    assert float(metrics["replaced_fraction"]) == 0.0
  else:
    changed = int(predicted.sum())
    assert (corrupted != original).sum() == changed
    assert float(metrics["replaced_fraction"]) == pytest.approx(changed / original.size)
  # Labels say "replaced" exactly where the ids differ (the scripted discriminator says 0:
  # "original" everywhere, so its accuracy is the fraction left original).
  assert float(metrics["disc_accuracy"]) == pytest.approx(
      1 - float(metrics["replaced_fraction"]))


@pytest.mark.slow
def test_the_discriminator_and_generator_come_apart_as_plain_models():
  config, model, params, _ = _setup("shared")
  disc = discriminator_params(params, config)
  assert set(disc) == {"bert", "discriminator_predictions"}
  plain = config.replace(generator_hidden_size=0)
  ids = jnp.asarray(np.random.RandomState(0).randint(5, 100, (2, 12)))
  want = model.apply({"params": params}, ids, None, None, True, method="discriminate")
  got = build_model(plain, "discriminator").apply({"params": disc}, ids)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The generator alone is an MLM model of the generator's config, the shared tables in it.
  gen_config = config.generator_config()
  gen = generator_params(params, config)
  positions = jnp.asarray([[1, 3, 5], [2, 4, 6]])
  want = model.apply({"params": params}, ids, None, None, positions, True, method="generate")
  gen_model = build_model(gen_config)
  full = nn.meta.unbox(init_params(gen_model, jax.random.key(0), 2, 12))
  got = gen_model.apply({"params": {**gen, "nsp": full["nsp"]}}, ids, None, None, positions)
  np.testing.assert_allclose(np.asarray(got.mlm_logits), np.asarray(want), atol=1e-6)


def _rtd_tiny(**overrides):
  config = train_helpers.tiny_config("bert", **overrides)
  config.objective = "rtd"
  config.model.update(dict(architecture="electra", embedding_size=32, pooler=False,
                           generator_hidden_size=16, generator_num_heads=1))
  return config


@pytest.mark.parametrize("sharing", ["shared", "gdes"])
@pytest.mark.slow
def test_rtd_steps_are_mesh_invariant(devices, sharing):
  """Two steps on one device and on a (2, 2, 2) mesh: every metric and parameter agree (the
  generator's samples included: their key is the step's, whatever the sharding)."""
  config = _rtd_tiny(**{"model.embedding_sharing": sharing})
  _, ref_state, ref_history = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  _, state, history = train_helpers.run_steps(_rtd_tiny(**{"model.embedding_sharing": sharing}),
                                              (2, 2, 2), steps=2)
  assert ref_history[0]["replaced_fraction"] > 0
  for got, want in zip(history, ref_history):
    for key in want:
      assert got[key] == pytest.approx(want[key], rel=2e-5, abs=1e-6), key
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                          jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
