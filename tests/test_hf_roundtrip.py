"""Hugging Face conversion: bertjax -> HF -> bertjax is bit-identical; HF -> bertjax -> HF
loads in `transformers` with identical logits. Plus the errors a bad checkpoint must produce."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

import hf_models
from bertjax import hf
from bertjax.models import ModelConfig, build_model, jit_init

TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=48,
            max_positions=16)


def _configs():
  return [
      ModelConfig(family="bert", **TINY),
      ModelConfig(family="bert", activation="gelu_tanh", scan_layers=False, **TINY),
      ModelConfig(family="gpt", norm_position="pre", activation="gelu_tanh",
                  layer_norm_eps=1e-5, scale_residual_init=True, type_vocab_size=0, **TINY),
      ModelConfig(family="gpt", norm_position="post", final_layer_norm=False,
                  activation="gelu_tanh", layer_norm_eps=1e-5, type_vocab_size=0,
                  **{**TINY, "mlp_dim": 4 * TINY["hidden_size"]}),
  ]


def _random_params(cfg, seed=0):
  params = jit_init(build_model(cfg))(jax.random.key(seed))
  # Non-trivial biases and norms, so a swapped or dropped tensor cannot go unnoticed.
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                      .astype(np.float32), params)


@pytest.mark.parametrize("cfg", _configs(), ids=["bert", "bert-unrolled", "gpt2", "gpt1"])
def test_bertjax_hf_bertjax_bit_identical(tmp_path, cfg):
  params = _random_params(cfg)
  hf.export_hf(params, cfg, tmp_path)
  back, cfg_back, report = hf.import_hf(tmp_path, scan_layers=cfg.scan_layers)
  assert report.fresh == []
  ours = traverse_util.flatten_dict(jax.device_get(params))
  theirs = traverse_util.flatten_dict(jax.device_get(back))
  assert ours.keys() == theirs.keys()
  for key in ours:
    np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]),
                                  err_msg="/".join(key))
  for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "mlp_dim",
                "max_positions", "activation", "norm_position", "layer_norm_eps"):
    assert getattr(cfg_back, field) == getattr(cfg, field), field


def test_exported_bert_loads_in_transformers_with_equal_logits(tmp_path):
  cfg = _configs()[0]
  params = _random_params(cfg)
  hf.export_hf(params, cfg, tmp_path)
  model = hf_models.transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size, length=10)
  theirs = hf_models.run(model, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask))
  for b, n in enumerate(lengths):
    assert np.abs(np.asarray(ours.mlm_logits[b, :n])
                  - theirs.prediction_logits[b, :n].numpy()).max() <= 1e-5
  assert np.abs(np.asarray(ours.nsp_logits) - theirs.seq_relationship_logits.numpy()).max() \
      <= 1e-5


@pytest.mark.parametrize("make", [hf_models.bert, hf_models.gpt2, hf_models.openai_gpt],
                         ids=["bert", "gpt2", "gpt1"])
def test_hf_bertjax_hf_identical_logits(tmp_path, make):
  ref = make(tmp_path / "ref")
  params, cfg, _ = hf.import_hf(tmp_path / "ref")
  hf.export_hf(params, cfg, tmp_path / "out")
  reloaded = type(ref).from_pretrained(tmp_path / "out").eval()
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  inputs = dict(input_ids=ids, attention_mask=mask)
  if cfg.family == "bert":
    inputs["token_type_ids"] = types
  if make is hf_models.openai_gpt:
    inputs.pop("attention_mask")
  a, b = hf_models.run(ref, **inputs), hf_models.run(reloaded, **inputs)
  for x, y in zip(a.values(), b.values()):
    if hasattr(x, "numpy"):
      np.testing.assert_array_equal(x.numpy(), y.numpy())
  # The exported tensors are the reference's, bit for bit (tied copies excepted).
  original = load_file(str(tmp_path / "ref" / "model.safetensors"))
  exported = load_file(str(tmp_path / "out" / "model.safetensors"))
  for name, value in exported.items():
    np.testing.assert_array_equal(value, original[name], err_msg=name)


def test_bf16_export_loads(tmp_path):
  cfg = _configs()[2]
  params = _random_params(cfg)
  hf.export_hf(params, cfg, tmp_path, dtype="bfloat16")
  model = hf_models.transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
  assert next(model.parameters()).dtype == hf_models.torch.bfloat16


def _rewrite(path, change):
  tensors = load_file(str(path / "model.safetensors"))
  change(tensors)
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_tensor_is_named(tmp_path):
  hf_models.bert(tmp_path)
  _rewrite(tmp_path, lambda t: t.__setitem__("bert.encoder.layer.0.extra.weight",
                                             np.zeros(3, np.float32)))
  with pytest.raises(hf.HFConversionError, match=r"bert\.encoder\.layer\.0\.extra\.weight"):
    hf.import_hf(tmp_path)


def test_wrong_shape_is_named(tmp_path):
  hf_models.bert(tmp_path)
  name = "bert.encoder.layer.1.intermediate.dense.weight"
  _rewrite(tmp_path, lambda t: t.__setitem__(name, t[name][:-1]))
  with pytest.raises(hf.HFConversionError, match=rf"{name.replace('.', '[.]')} has shape"):
    hf.import_hf(tmp_path)


def test_missing_tensor_is_named(tmp_path):
  hf_models.gpt2(tmp_path)
  _rewrite(tmp_path, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
  with pytest.raises(hf.HFConversionError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias is missing"):
    hf.import_hf(tmp_path)


def test_legacy_gamma_beta_names_and_buffers(tmp_path):
  ref = hf_models.bert(tmp_path)

  def legacy(t):
    for key in [k for k in t if "LayerNorm.weight" in k or "LayerNorm.bias" in k]:
      t[key.replace(".weight", ".gamma").replace(".bias", ".beta")] = t.pop(key)
    t["bert.embeddings.position_ids"] = np.arange(40, dtype=np.int64)[None]
  _rewrite(tmp_path, legacy)
  params, cfg, report = hf.import_hf(tmp_path)
  assert "bert.embeddings.position_ids" in report.ignored
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types).prediction_logits.numpy()
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types))
  assert np.abs(np.asarray(ours.mlm_logits) - theirs).max() <= 1e-5


def test_pickle_only_directory_is_refused(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 8,
                                                    "hidden_size": 8, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2,
                                                    "intermediate_size": 8,
                                                    "max_position_embeddings": 8,
                                                    "type_vocab_size": 2}))
  (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
  with pytest.raises(FileNotFoundError, match="pickles"):
    hf.import_hf(tmp_path)


def test_pre_ln_bert_export_is_refused():
  cfg = ModelConfig(family="bert", norm_position="pre", **TINY)
  with pytest.raises(hf.HFConversionError, match="pre-LN BERT"):
    hf.hf_config_dict(cfg)
