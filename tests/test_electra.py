"""ELECTRA against transformers: random-init, noise-perturbed ElectraForPreTraining (the
discriminator) and ElectraForMaskedLM (the generator) with an embedding width other than the
hidden size, scanned and unrolled; import -> export -> import bit-identical; fill-mask through
transformers' pipeline on an exported generator; a replaced-token-detection run's two exports."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import hf_models
from bertjax import hf
from bertjax.data.wordpiece import WordPiece
from bertjax.inference import generate as gen
from bertjax.models import build_model, init_params
from bertjax.models.electra import discriminator_params, generator_params

torch = hf_models.torch
transformers = hf_models.transformers

# Embedding width 24 under a hidden size of 64 (ELECTRA-Small's 128 under 256, scaled down).
SMALL = dict(vocab_size=101, embedding_size=24, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=96, max_position_embeddings=40,
             type_vocab_size=2)


def electra(tmp, cls, seed=0, **config):
  torch.manual_seed(seed)
  model = hf_models.perturbed(cls(transformers.ElectraConfig(**{**SMALL, **config})), seed)
  model.save_pretrained(tmp)
  return model


def _max_diff_at(ours, theirs, mask):
  real = np.asarray(mask, bool)
  return float(np.abs(np.asarray(ours)[real] - np.asarray(theirs)[real]).max())


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("width", [24, 64], ids=["projected", "same-width"])
def test_discriminator_parity(tmp_path, scan, width):
  ref = electra(tmp_path, transformers.ElectraForPreTraining, embedding_size=width)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.architecture == "ElectraForPreTraining" and not report.fresh
  assert cfg.embedding_width == width and cfg.architecture == "electra"
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = build_model(cfg, "discriminator").apply(
      {"params": params}, jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask))
  assert _max_diff_at(ours, theirs.logits.numpy(), mask) <= 1e-5


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_generator_parity(tmp_path, scan):
  ref = electra(tmp_path, transformers.ElectraForMaskedLM)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.architecture == "ElectraForMaskedLM"
  assert report.fresh == ["nsp/kernel", "nsp/bias"]  # BertForPreTraining's, never read
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  out = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                               jnp.asarray(mask))
  assert _max_diff_at(out.mlm_logits, theirs.logits.numpy(), mask) <= 1e-5


@pytest.mark.parametrize("cls", ["ElectraForPreTraining", "ElectraForMaskedLM"])
def test_hf_bertjax_hf_is_bit_identical(tmp_path, cls):
  ref = electra(tmp_path / "in", getattr(transformers, cls))
  params, cfg, report = hf.import_hf(tmp_path / "in")
  head = hf.electra.IMPORT_HEADS[cls]
  hf.export_hf(params, cfg, tmp_path / "out", head=head)
  original = load_file(str(tmp_path / "in" / "model.safetensors"))
  exported = load_file(str(tmp_path / "out" / "model.safetensors"))
  original.pop("generator_lm_head.weight", None)  # tied: written only when untied
  assert original.keys() == exported.keys()
  for name in original:
    np.testing.assert_array_equal(original[name], exported[name], err_msg=name)
  again, _, _ = hf.import_hf(tmp_path / "out")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))
  reloaded = getattr(transformers, cls).from_pretrained(tmp_path / "out").eval()
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  a = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask).logits
  b = hf_models.run(reloaded, input_ids=ids, token_type_ids=types, attention_mask=mask).logits
  assert float((a - b).abs().max()) == 0.0


WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "to", "house", "big", "small",
         "red", "blue", "and", "is", "was", "in", "it", "he", "she", "they", "we", ".", ",",
         "##s", "##ed", "##ing", "bird", "tree"]


@pytest.mark.slow
def test_an_rtd_models_generator_exports_for_the_fill_mask_pipeline(tmp_path):
  """A replaced-token-detection model (ELECTRA sharing) splits into a discriminator and a
  generator; transformers' fill-mask pipeline on the generator's export gives bertjax's top 5,
  and ElectraForPreTraining on the discriminator's gives bertjax's logits."""
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
  from bertjax.models import ModelConfig
  cfg = ModelConfig(family="bert", vocab_size=len(vocab), hidden_size=64, num_layers=2,
                    num_heads=4, mlp_dim=96, max_positions=40, architecture="electra",
                    embedding_size=24, pooler=False, generator_hidden_size=32,
                    generator_num_heads=2)
  params = jax.device_get(jax.jit(lambda k: init_params(build_model(cfg), k, 1, 8))(
      jax.random.key(0)))
  params = jax.tree.map(lambda x: np.asarray(x.value if hasattr(x, "value") else x), params,
                        is_leaf=lambda x: hasattr(x, "value"))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype),
                        params)
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "vocab.txt").write_text("\n".join(vocab) + "\n")
  gen_cfg = cfg.generator_config()
  generator = generator_params(params, cfg)
  hf.export_hf(generator, gen_cfg, tmp_path / "generator", tokenizer_dir=tmp_path / "tok")
  disc_cfg = cfg.replace(generator_hidden_size=0, generator_num_heads=0)
  hf.export_hf(discriminator_params(params, cfg), disc_cfg, tmp_path / "discriminator",
               head="discriminator", tokenizer_dir=tmp_path / "tok")
  pipe = transformers.pipeline("fill-mask", model=str(tmp_path / "generator"), device="cpu")
  tokenizer = WordPiece.from_vocab(tmp_path / "tok" / "vocab.txt")
  for text in ["the [MASK] sat on the mat .", "she ran to the big [MASK] house"]:
    ours = gen.fill_mask(params, cfg, tokenizer, text, top_k=5)
    theirs = pipe(text, top_k=5)
    assert [t for t, _ in ours] == [vocab[r["token"]] for r in theirs]
    np.testing.assert_allclose([p for _, p in ours], [r["score"] for r in theirs], atol=1e-5)
  ref = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "discriminator").eval()
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask), method="discriminate")
  # Weights moved far (noise 0.3, for sharp fill-mask scores) put logits up to ~5 and fp32
  # rounding near 1e-5; the parity tests above hold 1e-5 at the usual noise.
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(ours)[real], theirs.logits.numpy()[real], rtol=1e-5,
                             atol=5e-5)


def test_an_rtd_model_is_exported_as_its_two_models_not_one(tmp_path):
  from bertjax.models import ModelConfig
  cfg = ModelConfig(family="bert", vocab_size=50, hidden_size=32, num_layers=1, num_heads=2,
                    mlp_dim=64, max_positions=16, architecture="electra", pooler=False,
                    generator_hidden_size=16, generator_num_heads=1)
  params = jax.jit(lambda k: init_params(build_model(cfg), k))(jax.random.key(0))
  with pytest.raises(hf.HFConversionError, match="discriminator and its generator"):
    hf.export_hf(params, cfg, tmp_path / "out")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["electra", "deberta"])
def test_bertjax_export_writes_an_rtd_models_discriminator_and_generator(tmp_path, layout,
                                                                         capsys):
  """`bertjax export --format hf` of replaced-token-detection weights: the discriminator in
  OUT (ElectraForPreTraining; DeBERTa-v3's as DebertaV2Model, its residual added to the shared
  table) and the generator in OUT/generator, each loaded by transformers with bertjax's
  outputs."""
  from bertjax import cli
  from bertjax.checkpoints.params import save_params
  from bertjax.models import ModelConfig
  shape = dict(family="bert", vocab_size=64, hidden_size=32, num_layers=2, num_heads=2,
               mlp_dim=64, max_positions=32, pooler=False, hidden_dropout=0.0,
               attention_dropout=0.0)
  if layout == "electra":
    shape.update(architecture="electra", embedding_size=16, generator_hidden_size=16,
                 generator_num_heads=1)
  else:
    shape.update(architecture="deberta", position_embedding="relative", type_vocab_size=0,
                 position_buckets=8, max_relative_positions=16, generator_hidden_size=32,
                 generator_num_layers=1, embedding_sharing="gdes")
  cfg = ModelConfig(**shape)
  params = jax.device_get(jax.jit(lambda k: init_params(build_model(cfg), k, 1, 8))(
      jax.random.key(0)))
  params = jax.tree.map(lambda x: np.asarray(getattr(x, "value", x)), params,
                        is_leaf=lambda x: hasattr(x, "value"))
  rng = np.random.RandomState(1)  # the GDES residual away from zero
  params = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                        params)
  save_params(tmp_path / "params", params, cfg)
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "hf", "--out",
                   str(tmp_path / "hf")]) == 0
  out = capsys.readouterr().out
  ids, types, mask, _ = hf_models.batch(cfg.vocab_size)
  types = types if cfg.type_vocab_size else None
  kwargs = dict(input_ids=ids, attention_mask=mask) | (
      {"token_type_ids": types} if types is not None else {})
  model = build_model(cfg)
  real = np.asarray(mask, bool)
  if layout == "electra":
    assert "ElectraForPreTraining" in out and "ElectraForMaskedLM" in out
    disc = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "hf").eval()
    ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                       jnp.asarray(mask), method="discriminate")
    np.testing.assert_allclose(np.asarray(ours)[real],
                               hf_models.run(disc, **kwargs).logits.numpy()[real], atol=1e-5)
    generator_class = transformers.ElectraForMaskedLM
  else:
    assert "DebertaV2Model" in out and "DebertaV2ForMaskedLM" in out
    encoder = transformers.DebertaV2Model.from_pretrained(tmp_path / "hf").eval()
    ours, _ = model.apply({"params": params}, jnp.asarray(ids), None, jnp.asarray(mask),
                          method=lambda m, *a: m.bert(*a))
    np.testing.assert_allclose(
        np.asarray(ours)[real], hf_models.run(encoder, **kwargs).last_hidden_state.numpy()[real],
        atol=1e-5)
    generator_class = transformers.DebertaV2ForMaskedLM
  generator = generator_class.from_pretrained(tmp_path / "hf" / "generator").eval()
  positions = jnp.asarray(np.tile(np.arange(4, dtype=np.int32), (ids.shape[0], 1)))
  ours = model.apply({"params": params}, jnp.asarray(ids),
                     None if types is None else jnp.asarray(types), jnp.asarray(mask),
                     positions, method="generate")
  theirs = hf_models.run(generator, **kwargs).logits.numpy()[:, :4]
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5)
