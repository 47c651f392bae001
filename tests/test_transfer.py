"""Continued pre-training from other weights on the one trainer: `init_from` keeps the encoder,
heads the weights lack start fresh, heads the model lacks are left out, `optimizer.freeze`
holds the encoder bit for bit and `optimizer.head_learning_rate` is the fresh head's own rate.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

import train_helpers
from bertjax.checkpoints import weights as weights_lib
from bertjax.checkpoints import params as checkpoint
from bertjax.models import build_model, groups
from bertjax.training import loop


def _flat(tree) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


@pytest.fixture(scope="module")
def classifier_weights(tmp_path_factory):
  """A fine-tuned-looking OUT/best: a BERT encoder with a classifier, no pre-training heads."""
  directory = tmp_path_factory.mktemp("tuned") / "best"
  config = train_helpers.tiny_config("bert")
  cfg = checkpoint.ModelConfig.from_mapping(config.model.to_dict())
  model = build_model(cfg, "sequence_classification")
  params = nn.meta.unbox(jax.jit(lambda r: model.init(r, *_example(cfg))["params"])(
      jax.random.key(7)))
  params = jax.tree.map(lambda x: x + 0.01, jax.tree.map(np.asarray, params))  # not an init
  checkpoint.save_params(directory, params, cfg)
  (directory / weights_lib.FINETUNE_FILE).write_text(json.dumps({"task": "classification"}))
  return directory, _flat(params)


def _example(cfg):
  from bertjax.models import example_inputs
  return example_inputs(cfg)


def _continue(tmp_path, name, source, **overrides):
  config = train_helpers.tiny_config("bert", num_train_steps=3, init_from=str(source),
                                     **{"checkpoint.every": 0, **overrides})
  loop.train_and_evaluate(config, tmp_path / name)
  params, _ = checkpoint.load_params(tmp_path / name / "params")
  return _flat(params)


@pytest.mark.slow
def test_frozen_encoder_and_a_fresh_head_with_its_own_rate(tmp_path, classifier_weights):
  source, loaded = classifier_weights
  fast = _continue(tmp_path, "fast_head", source, **{
      "optimizer.freeze": "encoder", "optimizer.head_learning_rate": 3e-2})
  encoder = {k: v for k, v in fast.items() if k.startswith("bert/")}
  assert encoder and all(k in loaded for k in encoder)
  for name, value in encoder.items():  # loaded, then frozen bit for bit
    np.testing.assert_array_equal(value, loaded[name], err_msg=name)
  heads = sorted(k for k in fast if not k.startswith("bert/"))
  assert heads and not any(k.startswith("classifier") for k in fast)  # left out
  # The head's rate is its own: the same run with learning_rate at that value and no head
  # rate gives the same head; the config's encoder rate alone gives another.
  same = _continue(tmp_path, "lr_as_head", source, **{
      "optimizer.freeze": "encoder", "optimizer.learning_rate": 3e-2})
  slow = _continue(tmp_path, "no_head_rate", source, **{"optimizer.freeze": "encoder"})
  for name in heads:
    np.testing.assert_array_equal(fast[name], same[name], err_msg=name)
  assert any(not np.array_equal(fast[n], slow[n]) for n in heads)


@pytest.mark.slow
def test_unfrozen_encoder_trains_and_another_shape_is_refused(tmp_path, classifier_weights):
  source, loaded = classifier_weights
  trained = _continue(tmp_path, "unfrozen", source, **{"optimizer.head_learning_rate": 3e-2})
  assert any(not np.array_equal(trained[k], loaded[k]) for k in trained if k.startswith("bert/"))
  # An encoder of another shape is a wrong checkpoint, not a fresh head: refused by name.
  with pytest.raises(ValueError, match=r"does not fit the model.*\n.*bert/encoder/layers"):
    _continue(tmp_path, "refused", source, **{"model.num_layers": 3})


def test_freeze_kinds_over_the_pretraining_tree():
  config = train_helpers.tiny_config("bert")
  cfg = checkpoint.ModelConfig.from_mapping(config.model.to_dict())
  params = nn.meta.unbox(jax.eval_shape(
      lambda r: build_model(cfg, "pretraining").init(r, *_example(cfg))["params"],
      jax.random.key(0)))
  labels = _flat_groups(groups.parameter_groups(params, "embeddings"))
  assert labels["bert/word_embeddings/embedding"] == "frozen"
  assert labels["bert/encoder/layers/mlp/wi/kernel"] == "encoder"
  assert labels["mlm_bias"] == "head" and labels["nsp/kernel"] == "head"
  rows = _flat_groups(groups.frozen_rows(params, "bottom:1"))
  assert np.asarray(rows["bert/encoder/layers/mlp/wi/kernel"]).ravel().tolist() == [True, False]
  with pytest.raises(ValueError, match="freeze"):
    groups.parse_freeze("top:1")


def _flat_groups(tree):
  return {"/".join(str(getattr(p, "key", p)) for p in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(
              tree, is_leaf=lambda x: isinstance(x, (str, bool, np.ndarray)))}
