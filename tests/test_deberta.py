"""DeBERTa-v2/v3 (He et al. 2021, 2023) against transformers' DebertaV2ForMaskedLM: random-init
parity of the disentangled attention (c2p and p2c terms, log-bucketed or clipped distances,
shared or own position projections), HF -> bertjax -> HF and bertjax -> HF -> bertjax round
trips, the legacy head names, refusals; the bucketing against transformers' own function."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

import hf_models
from bertjax import hf
from bertjax.models import (ModelConfig, abstract_params, attention, build_model, jit_init,
                            relative)

torch = hf_models.torch
transformers = hf_models.transformers
modeling = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")

# DeBERTa-v3's layout at a tiny size: 8 buckets with distances up to 16 told apart, so that a
# length-24 input has distances bucketed logarithmically (beyond 4) and clipped (beyond 15).
SMALL = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=64, type_vocab_size=0,
             relative_attention=True, position_biased_input=False, pos_att_type="p2c|c2p",
             position_buckets=8, max_relative_positions=16, share_att_key=True,
             norm_rel_ebd="layer_norm", layer_norm_eps=1e-7, hidden_act="gelu", legacy=False)
LENGTH = 24


def deberta(tmp, seed=0, cls=None, **config):
  """A random-init, noise-perturbed transformers DeBERTa-v2 saved to `tmp`."""
  torch.manual_seed(seed)
  model = (cls or transformers.DebertaV2ForMaskedLM)(
      transformers.DebertaV2Config(**{**SMALL, **config}))
  model = hf_models.perturbed(model, seed)
  model.save_pretrained(tmp)
  return model


def _inputs(vocab, length=LENGTH):
  """ids, token types and a ragged padding mask (hf_models.batch) at DeBERTa's test length."""
  return hf_models.batch(vocab, length=length)


def _max_diff_at(ours, theirs, lengths):
  """Max abs difference over each row's real (non-padded) positions."""
  return max(float(np.abs(np.asarray(ours[b, :n]) - np.asarray(theirs[b, :n])).max())
             for b, n in enumerate(lengths))


def _ours(cfg, params, ids, types, mask):
  return build_model(cfg).apply({"params": params}, jnp.asarray(ids),
                                jnp.asarray(types) if cfg.type_vocab_size else None,
                                jnp.asarray(mask))


def _theirs(model, ids, types, mask, with_types):
  inputs = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
  if with_types:
    inputs["token_type_ids"] = types
  return hf_models.run(model, **inputs)


CASES = [
    pytest.param(dict(), id="v3-buckets-c2p|p2c-shared"),
    pytest.param(dict(position_buckets=-1, max_relative_positions=-1), id="no-buckets"),
    pytest.param(dict(position_buckets=-1, max_relative_positions=10), id="no-buckets-clipped"),
    pytest.param(dict(pos_att_type="c2p"), id="c2p"),
    pytest.param(dict(pos_att_type="p2c"), id="p2c"),
    pytest.param(dict(share_att_key=False), id="own-projections"),
    pytest.param(dict(share_att_key=False, pos_att_type="c2p", norm_rel_ebd="none"),
                 id="own-c2p-no-norm"),
    pytest.param(dict(share_att_key=False, pos_att_type=["p2c"], position_buckets=-1),
                 id="own-p2c-no-buckets"),
    pytest.param(dict(embedding_size=64, type_vocab_size=2, hidden_act="gelu_new",
                      hidden_size=64, intermediate_size=80), id="embedding_size-types"),
]


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("shape", CASES)
def test_deberta_parity(tmp_path, shape, scan, request):
  ref = deberta(tmp_path, **shape)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == ["nsp/kernel", "nsp/bias"]
  assert cfg.architecture == "deberta" and cfg.position_embedding == "relative"
  ids, types, mask, lengths = _inputs(cfg.vocab_size)
  theirs = _theirs(ref, ids, types, mask, bool(cfg.type_vocab_size))
  ours = _ours(cfg, params, ids, types, mask)
  logits = _max_diff_at(ours.mlm_logits, theirs.logits.numpy(), lengths)
  hidden = _max_diff_at(ours.sequence, theirs.hidden_states[-1].numpy(), lengths)
  print(f"{request.node.callspec.id}: max abs diff logits {logits:.2e}, hidden {hidden:.2e}")
  assert logits <= 1e-5 and hidden <= 1e-5


def test_parity_with_legacy_head_names_and_its_export(tmp_path):
  """transformers' default `legacy=True` head (cls.predictions.*, its decoder tied) imports
  with parity; the export (lm_predictions, legacy=False) loads back in transformers with the
  same logits."""
  ref = deberta(tmp_path / "in", legacy=True, share_att_key=False)
  assert any(k.startswith("cls.predictions.") for k in load_file(
      str(tmp_path / "in" / "model.safetensors")))
  params, cfg, report = hf.import_hf(tmp_path / "in")
  assert report.fresh == ["nsp/kernel", "nsp/bias"]
  ids, types, mask, lengths = _inputs(cfg.vocab_size)
  theirs = _theirs(ref, ids, types, mask, False).logits.numpy()
  assert _max_diff_at(_ours(cfg, params, ids, types, mask).mlm_logits, theirs, lengths) <= 1e-5
  hf.export_hf(params, cfg, tmp_path / "out")
  reloaded = transformers.DebertaV2ForMaskedLM.from_pretrained(tmp_path / "out").eval()
  assert not reloaded.config.legacy
  again = _theirs(reloaded, ids, types, mask, False).logits.numpy()
  assert _max_diff_at(again, theirs, lengths) <= 1e-5


@pytest.mark.slow
def test_packed_documents_match_each_document_alone(tmp_path):
  """Positions restart in every packed document: the relative distances, and so the outputs,
  are those of each document run on its own."""
  ref = deberta(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  rng = np.random.RandomState(1)
  sizes = (10, 14)
  docs = [rng.randint(3, cfg.vocab_size, (1, n)) for n in sizes]
  document_ids = np.concatenate([np.full((1, n), i + 1) for i, n in enumerate(sizes)], axis=1)
  positions = np.concatenate([np.arange(n)[None] for n in sizes], axis=1)
  ours = build_model(cfg).apply(
      {"params": params}, jnp.asarray(np.concatenate(docs, axis=1)), None,
      jnp.ones((1, sum(sizes)), jnp.int32), document_ids_BL=jnp.asarray(document_ids),
      positions_BL=jnp.asarray(positions)).mlm_logits
  start = 0
  for doc in docs:
    theirs = hf_models.run(ref, input_ids=doc).logits.numpy()
    n = doc.shape[1]
    assert np.abs(np.asarray(ours[:, start:start + n]) - theirs).max() <= 1e-5
    start += n


def test_bare_model_imports_with_a_fresh_head(tmp_path):
  ref = deberta(tmp_path, cls=transformers.DebertaV2Model, share_att_key=False)
  assert not any(k.startswith("deberta.") for k in load_file(
      str(tmp_path / "model.safetensors")))
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=False)
  assert sorted(report.fresh) == sorted(["mlm_transform/kernel", "mlm_transform/bias",
                                         "mlm_norm/scale", "mlm_norm/bias", "mlm_bias",
                                         "nsp/kernel", "nsp/bias"])
  ids, types, mask, lengths = _inputs(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
  assert _max_diff_at(_ours(cfg, params, ids, types, mask).sequence, theirs, lengths) <= 1e-5


# Changes that each must break parity: without them passing, the parity tests could pass on a
# model that ignores the term or the bucketing they are meant to check.
def _without_p2c(original):
  return lambda cfg, q, k, pos_query, pos_key, index: original(cfg, q, k, None, pos_key, index)


def _without_c2p(original):
  return lambda cfg, q, k, pos_query, pos_key, index: original(cfg, q, k, pos_query, None, index)


def _p2c_reversed(original):
  """p2c read at the distance s - l instead of l - s."""
  def scores(cfg, q, k, pos_query, pos_key, index):
    c2p = original(cfg, q, k, None, pos_key, index)
    return c2p + original(cfg, q, k, pos_query, None, jnp.swapaxes(index, -1, -2))
  return scores


BROKEN = {
    "no-p2c": ("disentangled_scores", _without_p2c),
    "no-c2p": ("disentangled_scores", _without_c2p),
    "p2c-reversed": ("disentangled_scores", _p2c_reversed),
    "linear-buckets": ("log_buckets", lambda original: lambda d, b, m: np.clip(d, -b, b)),
    "buckets-off-by-one": ("log_buckets", lambda original: lambda d, b, m: original(d, b, m + 1)),
    "buckets-floor": ("log_buckets",
                      lambda original: lambda d, b, m: np.where(
                          np.abs(d) <= b // 2, d, original(d, b, m) - np.sign(d))),
    "sqrt-H-scale": ("score_divisor", lambda original: lambda cfg: float(np.sqrt(cfg.head_dim))),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_parity_fails_when_the_math_is_wrong(tmp_path, monkeypatch, broken):
  ref = deberta(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  ids, types, mask, lengths = _inputs(cfg.vocab_size)
  theirs = _theirs(ref, ids, types, mask, False).logits.numpy()
  assert _max_diff_at(_ours(cfg, params, ids, types, mask).mlm_logits, theirs, lengths) <= 1e-5
  name, wrong = BROKEN[broken]
  monkeypatch.setattr(relative, name, wrong(getattr(relative, name)))
  assert _max_diff_at(_ours(cfg, params, ids, types, mask).mlm_logits, theirs, lengths) > 1e-3


@pytest.mark.parametrize("buckets,max_distance,length", [(8, 16, 24), (256, 512, 1100),
                                                         (6, 40, 64), (32, 64, 300)])
def test_buckets_are_transformers_own(buckets, max_distance, length):
  """Every distance's table row is the one transformers' build_relative_position +
  clamp(... + span) reads, far beyond the bucketed range included."""
  cfg = _config(position_buckets=buckets, max_relative_positions=max_distance,
                max_positions=max(length, 16))
  x = torch.zeros(1, length, 1)
  rel = modeling.build_relative_position(x, x, bucket_size=buckets, max_position=max_distance)
  expected = torch.clamp(rel + buckets, 0, 2 * buckets - 1)[0].numpy()
  np.testing.assert_array_equal(np.asarray(relative.relative_index(cfg, length))[0, 0],
                                expected)


def _config(**overrides):
  values = dict(family="bert", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                mlp_dim=48, max_positions=32, type_vocab_size=0, layer_norm_eps=1e-7,
                architecture="deberta", position_embedding="relative", pooler=False,
                position_buckets=8, max_relative_positions=16, hidden_dropout=0.0,
                attention_dropout=0.0)
  values.update(overrides)
  return ModelConfig(**values)


def _random_params(cfg, seed=0):
  params = jit_init(build_model(cfg))(jax.random.key(seed))
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                      .astype(np.float32), params)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("change", [dict(share_attention_key=False),
                                    dict(relative_attention_terms="p2c", position_buckets=0,
                                         relative_embedding_norm=False, type_vocab_size=2)],
                         ids=["own-projections", "p2c-no-buckets-types"])
@pytest.mark.slow
def test_bertjax_hf_bertjax_is_bit_identical(tmp_path, scan, change):
  cfg = _config(scan_layers=scan, **change)
  params = _random_params(cfg)
  hf.export_hf(params, cfg, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == "deberta-v2" and config["legacy"] is False
  back, cfg_back, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == ["nsp/kernel", "nsp/bias"]
  ours = traverse_util.flatten_dict(jax.device_get(params))
  theirs = traverse_util.flatten_dict(jax.device_get(back))
  assert ours.keys() == theirs.keys()
  for key in set(ours) - {("nsp", "kernel"), ("nsp", "bias")}:
    np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]),
                                  err_msg="/".join(key))
  assert cfg_back == cfg.replace(hidden_dropout=0.0, attention_dropout=0.0)
  # transformers reads the export: the same logits as bertjax.
  model = transformers.DebertaV2ForMaskedLM.from_pretrained(tmp_path).eval()
  ids, types, mask, lengths = _inputs(cfg.vocab_size, length=20)
  theirs_logits = _theirs(model, ids, types, mask, bool(cfg.type_vocab_size)).logits.numpy()
  ours_logits = _ours(cfg, params, ids, types, mask).mlm_logits
  assert _max_diff_at(ours_logits, theirs_logits, lengths) <= 1e-5


def test_hf_bertjax_hf_is_bit_identical(tmp_path):
  deberta(tmp_path / "in", share_att_key=False, type_vocab_size=2)
  params, cfg, _ = hf.import_hf(tmp_path / "in")
  hf.export_hf(params, cfg, tmp_path / "out")
  original = load_file(str(tmp_path / "in" / "model.safetensors"))
  exported = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert original.keys() == exported.keys()
  for name in original:
    np.testing.assert_array_equal(original[name], exported[name], err_msg=name)
  assert hf.model_config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == cfg


def test_checkpoint_extras_transformers_skips_are_ignored(tmp_path):
  """Microsoft's checkpoints carry an absolute position table and the RTD head
  (mask_predictions); transformers skips both on load, and so does the import."""
  deberta(tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  extra = {"deberta.embeddings.position_embeddings.weight": np.zeros((64, 32), np.float32),
           "mask_predictions.classifier.weight": np.zeros((1, 32), np.float32)}
  save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
  _, _, report = hf.import_hf(tmp_path)
  assert set(extra) <= set(report.ignored)


@pytest.mark.parametrize("change,key", [
    (dict(position_biased_input=True), "position_biased_input"),
    (dict(conv_kernel_size=3), "conv_kernel_size"),
    (dict(relative_attention=False), "relative_attention"),
    (dict(pos_att_type="p2p|c2p"), "pos_att_type"),
    (dict(embedding_size=16), "embedding_size"),
    (dict(hidden_act="tanh"), "hidden_act"),
])
def test_unsupported_configs_are_refused_by_key(change, key):
  hf_config = {**SMALL, "model_type": "deberta-v2", **change}
  with pytest.raises(hf.HFConversionError, match=key):
    hf.model_config_from_hf(hf_config)


def test_non_deberta_layouts_and_heads_are_refused_on_export(tmp_path):
  cfg = _config(norm_position="pre")
  with pytest.raises(hf.HFConversionError, match="norm_position='pre'"):
    hf.hf_config_dict(cfg)
  params = jit_init(build_model(_config()))(jax.random.key(0))
  with pytest.raises(hf.HFConversionError, match="a deberta-v2 model exports with a head of"):
    hf.to_hf_state_dict(params, _config(), head="discriminator")


def test_relative_attention_runs_on_the_xla_core():
  cfg = _config(attention="auto")
  for platform in ("tpu", "gpu"):
    assert attention.resolve(cfg.replace(dtype="bfloat16"), platform, training=False
                             ).attention == "xla"
  params = jit_init(build_model(cfg))(jax.random.key(0))
  with pytest.raises(ValueError, match="needs the XLA attention core|takes no score bias"):
    build_model(cfg.replace(attention="cudnn")).apply({"params": params},
                                                      jnp.ones((1, 8), jnp.int32))


def test_parameters_are_named_and_the_table_is_the_encoders():
  """One relative table (and norm) for the encoder, outside the scanned layers; every
  parameter carries logical axis names; own position projections only for the terms in use."""
  cfg = _config(share_attention_key=False, relative_attention_terms="c2p")
  abstract = abstract_params(build_model(cfg))
  leaves = jax.tree_util.tree_leaves_with_path(
      abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  for path, leaf in leaves:
    assert isinstance(leaf, nn.Partitioned) and len(leaf.names) == leaf.value.ndim, path
  encoder = abstract["bert"]["encoder"]
  assert encoder["rel_embeddings"]["embedding"].value.shape == (16, 32)
  assert set(encoder["rel_embeddings_norm"]) == {"scale", "bias"}
  attn = encoder["layers"]["attention"]
  assert "pos_key_proj" in attn and "pos_query_proj" not in attn
  assert attn["pos_key_proj"]["kernel"].value.shape == (2, 32, 4, 8)


@pytest.mark.parametrize("scan,dtype,matmul_output", [
    (True, "float32", "auto"), (True, "bfloat16", "float32"), (False, "bfloat16", "compute")])
@pytest.mark.slow
def test_training_step_with_dropout_and_remat_has_finite_gradients(scan, dtype, matmul_output):
  """Dropout on the position table and the probabilities, a remat policy, mixed precision (the
  CPU float32-output mode included): gradients reach the table and are finite."""
  cfg = _config(scan_layers=scan, hidden_dropout=0.1, attention_dropout=0.1,
                remat_policy="dots" if scan else "none", dtype=dtype,
                matmul_output=matmul_output, share_attention_key=scan)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 12)))

  def loss(p):
    out = model.apply({"params": p}, ids, deterministic=False,
                      rngs={"dropout": jax.random.key(1)})
    return jnp.mean(jax.nn.log_softmax(out.mlm_logits.astype(jnp.float32))[..., 0])

  grads = jax.jit(jax.grad(loss))(params)
  table = grads["bert"]["encoder"]["rel_embeddings"]["embedding"]
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  assert float(jnp.abs(table).max()) > 0
