"""BART against transformers: random-init, noise-perturbed BartForConditionalGeneration,
imported; encoder states and logits at real positions with padding, packed examples (positions
restarting in each) against each example alone, import -> export -> import bit-identical, and the
export loading in transformers with equal logits. fp32, eval mode, max abs difference <= 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from bertjax import hf
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.bart import segment_positions

torch, transformers = hf_models.torch, hf_models.transformers


def _reference(tmp, seed: int = 0, **config):
  defaults = dict(vocab_size=101, d_model=32, encoder_layers=2, decoder_layers=3,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                  decoder_ffn_dim=48, max_position_embeddings=40, dropout=0.1,
                  attention_dropout=0.1, activation_dropout=0.1)
  defaults.update(config)
  torch.manual_seed(seed)
  model = hf_models.perturbed(
      transformers.BartForConditionalGeneration(transformers.BartConfig(**defaults)), seed)
  model.save_pretrained(tmp)
  return model


def _batch(vocab: int, lengths: list[int], width: int, seed: int):
  rng = np.random.RandomState(seed)
  ids = rng.randint(3, vocab, (len(lengths), width))
  mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
  return np.where(mask == 1, ids, 1), mask


def _close(ours, theirs, lengths, tol=1e-5):
  diff = hf_models.max_diff_at(ours, theirs, lengths)
  assert diff <= tol, diff


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("scale_embedding", [False, True])
def test_logits_and_encoder_states_match_transformers(tmp_path, scale_embedding, scan):
  ref = _reference(tmp_path, scale_embedding=scale_embedding)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == [] and cfg.family == "bart" and cfg.scale_embeddings == scale_embedding
  enc_lengths, dec_lengths = [30, 17, 24], [9, 12, 5]
  ids, mask = _batch(cfg.vocab_size, enc_lengths, 30, 0)
  dec, dec_mask = _batch(cfg.vocab_size, dec_lengths, 12, 1)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                         decoder_attention_mask=dec_mask)
  model = build_model(cfg)
  ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(dec), jnp.asarray(mask),
                     jnp.asarray(dec_mask))
  _close(ours, theirs.logits.numpy(), dec_lengths)
  encoded = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask),
                        method=model.encode)
  _close(encoded, theirs.encoder_last_hidden_state.numpy(), enc_lengths)


def test_packed_examples_match_each_example_alone(tmp_path):
  ref = _reference(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  rng = np.random.RandomState(3)
  examples = [(rng.randint(3, cfg.vocab_size, n), rng.randint(3, cfg.vocab_size, m))
              for n, m in ((13, 6), (22, 9))]
  enc_row, dec_row = np.ones((1, 38), np.int64), np.ones((1, 17), np.int64)
  enc_seg, dec_seg = np.zeros_like(enc_row), np.zeros_like(dec_row)
  e = d = 0
  for k, (inp, tgt) in enumerate(examples, start=1):
    enc_row[0, e:e + len(inp)], enc_seg[0, e:e + len(inp)] = inp, k
    dec_row[0, d:d + len(tgt)], dec_seg[0, d:d + len(tgt)] = tgt, k
    e, d = e + len(inp), d + len(tgt)
  ours = np.asarray(build_model(cfg).apply(
      {"params": params}, jnp.asarray(enc_row), jnp.asarray(dec_row),
      encoder_segments_BS=jnp.asarray(enc_seg), decoder_segments_BL=jnp.asarray(dec_seg)))
  d = 0
  for inp, tgt in examples:
    alone = hf_models.run(ref, input_ids=inp[None], decoder_input_ids=tgt[None]).logits.numpy()
    diff = np.abs(ours[0, d:d + len(tgt)] - alone[0]).max()
    assert diff <= 1e-5, diff
    d += len(tgt)


def test_segment_positions_restart_in_each_example():
  segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  assert np.asarray(segment_positions(jnp.asarray(segments))).tolist() == [
      [0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_import_export_import_is_bit_identical_and_loads_in_transformers(tmp_path):
  ref = _reference(tmp_path / "ref")
  params, cfg, _ = hf.import_hf(tmp_path / "ref")
  hf.export_hf(params, cfg, tmp_path / "out")
  again, cfg2, report = hf.import_hf(tmp_path / "out")
  assert cfg2 == cfg and report.fresh == []
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  loaded = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
  ids, mask = _batch(cfg.vocab_size, [15, 9], 15, 4)
  dec, dec_mask = _batch(cfg.vocab_size, [7, 4], 7, 5)
  inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                decoder_attention_mask=dec_mask)
  want = hf_models.run(ref, **inputs).logits.numpy()
  got = hf_models.run(loaded, **inputs).logits.numpy()
  _close(got, want, [7, 4], tol=0.0)


def test_a_fresh_model_exports_and_loads(tmp_path):
  cfg = ModelConfig(family="bart", vocab_size=64, hidden_size=24, num_layers=2, decoder_layers=1,
                    num_heads=4, mlp_dim=40, max_positions=32, type_vocab_size=0,
                    layer_norm_eps=1e-5, scan_layers=False)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(1))
  hf.export_hf(params, cfg, tmp_path)
  loaded = transformers.BartForConditionalGeneration.from_pretrained(tmp_path).eval()
  ids, mask = _batch(cfg.vocab_size, [11, 6], 11, 6)
  dec, dec_mask = _batch(cfg.vocab_size, [5, 3], 5, 7)
  theirs = hf_models.run(loaded, input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                         decoder_attention_mask=dec_mask).logits.numpy()
  ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(dec), jnp.asarray(mask),
                     jnp.asarray(dec_mask))
  _close(ours, theirs, [5, 3])


def test_a_nonzero_output_bias_is_refused_by_name(tmp_path):
  ref = _reference(tmp_path)
  with torch.no_grad():
    ref.final_logits_bias.add_(0.5)
  ref.save_pretrained(tmp_path)
  with pytest.raises(hf.HFConversionError, match="final_logits_bias is not zero"):
    hf.import_hf(tmp_path)
