"""A model family registered from outside the package (no edit under bertjax/): a GPT variant
with its own Hugging Face model_type and renamed tensors validates, trains a step on synthetic
data, has its FLOPs counted, exports and re-imports bit-identically, and generates. Also the
one rule for family options, asked of the registry."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import traverse_util

from bertjax import hf
from bertjax.config.validate import validate_training
from bertjax.hf import formats
from bertjax.hf import gpt as hf_gpt
from bertjax.hf.entries import Entry
from bertjax.inference import generate
from bertjax.models import ModelConfig, build_model, families, gpt, jit_init
from bertjax.training import flops
from train_helpers import run_steps, tiny_config

FAMILY = "test_gpt"
MODEL_TYPE = "test-gpt"
# The variant's tensor names: GPT-2's, renamed (a different checkpoint layout to map).
_RENAMES = (("transformer.", "backbone."), ("wte.", "token_table."), ("wpe.", "position_table."),
            (".h.", ".blocks."), ("attn.c_attn", "mixer.qkv"), ("attn.c_proj", "mixer.out"),
            ("mlp.c_fc", "ffn.up"), ("mlp.c_proj", "ffn.down"), ("ln_1", "norm_1"),
            ("ln_2", "norm_2"), ("ln_f", "final_norm"))


def _rename(name: str) -> str:
  for old, new in _RENAMES:
    name = name.replace(old, new)
  return name


def _entries(cfg, prefix, head, tensors):
  del head, tensors
  return [Entry(e.ours, tuple(_rename(t) for t in e.theirs), e.to_ours, e.to_theirs, e.optional)
          for e in hf_gpt.entries(cfg, "transformer." if prefix else "", gpt1=False)]


def _config_from_hf(config, common):
  return ModelConfig(family=FAMILY, vocab_size=config["vocab"], hidden_size=config["width"],
                     num_layers=config["depth"], num_heads=config["heads"],
                     mlp_dim=config["ffn"], max_positions=config["context"], type_vocab_size=0,
                     norm_position="pre", activation="gelu_tanh", layer_norm_eps=1e-5,
                     hidden_dropout=0.0, attention_dropout=0.0, scale_residual_init=True,
                     **common)


def _config_dict(cfg, request):
  return {"model_type": MODEL_TYPE, "architectures": [request.head and "TestGPTForCausalLM"],
          "vocab": cfg.vocab_size, "width": cfg.hidden_size, "depth": cfg.num_layers,
          "heads": cfg.num_heads, "ffn": cfg.mlp_dim, "context": cfg.max_positions,
          "initializer_range": cfg.initializer_range, "torch_dtype": request.dtype}


TEST_FAMILY = families.Family(
    name=FAMILY, kind="decoder", build=lambda config, head: gpt.GPT(config),
    layer_stacks=gpt.layer_stacks, objectives=("causal_lm",), lm_objective="causal_lm",
    options=frozenset({"loss_chunk"}), tokenizer_style="gpt")
TEST_FORMAT = formats.HFFormat(
    model_type=MODEL_TYPE, family=FAMILY, prefix="backbone.", entries=_entries,
    tied_copies=lambda prefix: {"lm_head.weight": f"{prefix}token_table.weight"},
    config_from_hf=_config_from_hf, config_dict=_config_dict,
    claims=lambda cfg: cfg.family == FAMILY, heads={"pretraining": "TestGPTForCausalLM"})


@pytest.fixture
def registered():
  families.register(TEST_FAMILY)
  formats.register(TEST_FORMAT)
  yield
  formats.unregister(MODEL_TYPE)
  families.unregister(FAMILY)


def _config(**changes):
  config = tiny_config("gpt", **changes)
  config.model.family = FAMILY
  return config


def test_a_family_registered_from_outside_trains_exports_and_generates(registered, tmp_path):
  config = _config()
  validate_training(config)
  trainer, state, history = run_steps(config, (1, 1, 1), steps=1)
  cfg = trainer.model_config
  assert cfg.family == FAMILY and cfg.is_decoder
  assert np.isfinite(history[0]["loss"])

  # Its FLOPs: a GPT's of the same shape (the family has no heads of its own).
  as_gpt = cfg.replace(family="gpt")
  counted = flops.run_flops_per_step(cfg, config)
  assert counted > 0 and counted == flops.run_flops_per_step(as_gpt, config)

  # Export through its format and import back: the same parameters, bit for bit.
  params = jax.device_get(state.params)
  out = hf.export_hf(params, cfg, tmp_path / "hf")
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == MODEL_TYPE
  names = set(hf.read_safetensors(out))
  assert "backbone.blocks.0.mixer.qkv.weight" in names and not any("transformer." in n
                                                                    for n in names)
  imported, imported_cfg, report = hf.import_hf(out, scan_layers=cfg.scan_layers)
  assert report.model_type == MODEL_TYPE and not report.fresh
  assert imported_cfg.family == FAMILY
  ours = traverse_util.flatten_dict(params)
  theirs = traverse_util.flatten_dict(imported)
  assert ours.keys() == theirs.keys()
  for key in ours:
    np.testing.assert_array_equal(np.asarray(theirs[key]), np.asarray(ours[key]), str(key))

  # It generates: the same tokens as the GPT it is built from.
  prompts = [[5, 6, 7], [9, 10]]
  new = generate.generate(params, cfg, prompts, max_new_tokens=4)
  assert new == generate.generate(params, as_gpt, prompts, max_new_tokens=4)
  assert all(len(row) == 4 for row in new)


def test_an_option_the_family_does_not_name_is_refused_naming_who_accepts_it(registered):
  base = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32,
              max_positions=16, type_vocab_size=0)
  ModelConfig(family=FAMILY, loss_chunk=8, **base)  # an option it names
  with pytest.raises(ValueError, match=r"model.layer_sharing='all' is an option of bert "
                                       r"models \(model.family\), not of a test_gpt model"):
    ModelConfig(family=FAMILY, layer_sharing="all", **base)
  with pytest.raises(ValueError, match="model.decoder_layers=2 is an option of t5 and bart"):
    ModelConfig(family="gpt", decoder_layers=2, **base)
  with pytest.raises(ValueError, match="model.family must be one of .*test_gpt.*got 'nope'"):
    ModelConfig(family="nope", **base)


def test_objectives_and_heads_are_asked_of_the_family(registered):
  base = dict(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, mlp_dim=32,
              max_positions=16, type_vocab_size=0)
  cfg = ModelConfig(family=FAMILY, **base)
  with pytest.raises(ValueError, match="a test_gpt model has the heads pretraining, not "
                                       "'sequence_classification'"):
    build_model(cfg, "sequence_classification")
  from bertjax.training.objectives import build_objective
  with pytest.raises(ValueError, match="objective mlm needs a bert model"):
    build_objective("mlm", build_model(cfg))
  params = jit_init(build_model(cfg))(jax.random.key(0))
  assert build_objective("causal_lm", build_model(cfg)) is not None and params


def test_a_family_or_format_is_registered_once():
  with pytest.raises(ValueError, match="registered already"):
    families.register(families.Family(
        name="gpt", kind="decoder", build=lambda c, h: None, layer_stacks=gpt.layer_stacks,
        objectives=("causal_lm",), lm_objective="causal_lm"))
  with pytest.raises(ValueError, match="registered already"):
    formats.register(TEST_FORMAT.__class__(**{**TEST_FORMAT.__dict__, "model_type": "gpt2"}))
