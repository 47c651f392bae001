"""T5 against transformers: random-init, noise-perturbed T5ForConditionalGeneration in the 1.0
(ReLU, scaled decoder output) and 1.1 (gated GeLU, unscaled) layouts, imported; encoder states
and logits at real positions with padding, packed examples against each example alone, the
bucket function over every distance, import -> export -> import bit-identical, and the export
loading in transformers with equal logits. fp32, eval mode, max abs difference <= 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from bertjax import hf
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models.t5 import relative_buckets

torch, transformers = hf_models.torch, hf_models.transformers

LAYOUTS = {
    "t5-1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "t5-1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def _reference(tmp, layout: str, seed: int = 0, **config):
  defaults = dict(vocab_size=101, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                  num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                  relative_attention_max_distance=20, dropout_rate=0.1,
                  # Logits of a few units, as a trained T5's (the default factor 1.0 gives
                  # logits of 20 and more, whose float32 rounding alone exceeds 1e-5).
                  initializer_factor=0.3)
  defaults.update(LAYOUTS[layout], **config)
  torch.manual_seed(seed)
  model = hf_models.perturbed(
      transformers.T5ForConditionalGeneration(transformers.T5Config(**defaults)), seed)
  model.save_pretrained(tmp)
  return model


def _batch(vocab: int, lengths: list[int], width: int, seed: int):
  rng = np.random.RandomState(seed)
  ids = rng.randint(2, vocab, (len(lengths), width))
  mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
  return ids * mask, mask


def _close(ours, theirs, lengths, tol=1e-5):
  diff = hf_models.max_diff_at(ours, theirs, lengths)
  assert diff <= tol, diff


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_and_encoder_states_match_transformers(tmp_path, layout, scan):
  ref = _reference(tmp_path, layout)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == [] and cfg.family == "t5"
  assert cfg.scale_decoder_outputs == (layout == "t5-1.0") and cfg.mlp_gated == (
      layout == "t5-1.1")
  # Encoder rows longer than the buckets' exact range, ragged padding on both sides.
  enc_lengths, dec_lengths = [30, 17, 24], [9, 12, 5]
  ids, mask = _batch(cfg.vocab_size, enc_lengths, 30, 0)
  dec, dec_mask = _batch(cfg.vocab_size, dec_lengths, 12, 1)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                         decoder_attention_mask=dec_mask, output_hidden_states=True)
  model = build_model(cfg)
  ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(dec), jnp.asarray(mask),
                     jnp.asarray(dec_mask))
  _close(ours, theirs.logits.numpy(), dec_lengths)
  encoded = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask),
                        method=model.encode)
  _close(encoded, theirs.encoder_last_hidden_state.numpy(), enc_lengths)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_examples_match_each_example_alone(tmp_path, layout):
  """Two examples packed into one encoder row and one decoder row (segment ids 1, 2, padding 0)
  give, at each example's positions, the logits transformers gives that example alone: no
  position reads another example, in self- or cross-attention."""
  ref = _reference(tmp_path, layout)
  params, cfg, _ = hf.import_hf(tmp_path)
  rng = np.random.RandomState(3)
  examples = [(rng.randint(2, cfg.vocab_size, n), rng.randint(2, cfg.vocab_size, m))
              for n, m in ((13, 6), (22, 9))]
  enc_row, dec_row = np.zeros((1, 40), np.int64), np.zeros((1, 18), np.int64)
  enc_seg, dec_seg = np.zeros_like(enc_row), np.zeros_like(dec_row)
  e = d = 0
  for k, (inp, tgt) in enumerate(examples, start=1):
    enc_row[0, e:e + len(inp)], enc_seg[0, e:e + len(inp)] = inp, k
    dec_row[0, d:d + len(tgt)], dec_seg[0, d:d + len(tgt)] = tgt, k
    e, d = e + len(inp), d + len(tgt)
  model = build_model(cfg)
  ours = np.asarray(model.apply(
      {"params": params}, jnp.asarray(enc_row), jnp.asarray(dec_row),
      encoder_segments_BS=jnp.asarray(enc_seg), decoder_segments_BL=jnp.asarray(dec_seg)))
  d = 0
  for inp, tgt in examples:
    alone = hf_models.run(ref, input_ids=inp[None], decoder_input_ids=tgt[None]).logits.numpy()
    diff = np.abs(ours[0, d:d + len(tgt)] - alone[0]).max()
    assert diff <= 1e-5, diff
    d += len(tgt)


def test_the_decoder_is_causal(tmp_path):
  """Changing a later decoder token leaves every earlier position's logits unchanged."""
  _reference(tmp_path, "t5-1.1")
  params, cfg, _ = hf.import_hf(tmp_path)
  model = build_model(cfg)
  ids, mask = _batch(cfg.vocab_size, [20], 20, 0)
  dec, _ = _batch(cfg.vocab_size, [10], 10, 1)
  changed = dec.copy()
  changed[0, 6] = (dec[0, 6] + 1) % cfg.vocab_size
  a, b = (np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(x)))
          for x in (dec, changed))
  assert np.array_equal(a[0, :6], b[0, :6]) and not np.allclose(a[0, 6:], b[0, 6:])


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 20), (64, 256)])
def test_relative_buckets_equal_transformers_at_every_distance(bidirectional, buckets,
                                                               max_distance):
  relative = np.arange(-1100, 1100)[None, :]
  theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
      torch.tensor(relative), bidirectional=bidirectional, num_buckets=buckets,
      max_distance=max_distance).numpy()
  ours = np.asarray(relative_buckets(jnp.asarray(relative, jnp.int32), bidirectional, buckets,
                                     max_distance))
  assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_export_import_is_bit_identical_and_loads_in_transformers(tmp_path, layout):
  ref = _reference(tmp_path / "ref", layout)
  params, cfg, _ = hf.import_hf(tmp_path / "ref")
  hf.export_hf(params, cfg, tmp_path / "out")
  again, cfg2, report = hf.import_hf(tmp_path / "out")
  assert cfg2 == cfg and report.fresh == []
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
  ids, mask = _batch(cfg.vocab_size, [15, 9], 15, 4)
  dec, dec_mask = _batch(cfg.vocab_size, [7, 4], 7, 5)
  inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                decoder_attention_mask=dec_mask)
  want = hf_models.run(ref, **inputs).logits.numpy()
  got = hf_models.run(loaded, **inputs).logits.numpy()
  _close(got, want, [7, 4], tol=0.0)


def test_a_fresh_model_exports_and_loads(tmp_path):
  """bertjax's own T5 (head width not hidden / heads, as T5-3B's) -> transformers, equal
  logits; a different head width is its config, not an error."""
  cfg = ModelConfig(family="t5", vocab_size=64, hidden_size=24, num_layers=2, decoder_layers=1,
                    num_heads=4, head_size=8, mlp_dim=40, max_positions=32, type_vocab_size=0,
                    norm_position="pre", activation="relu", layer_norm_eps=1e-6,
                    attention_bias=False, mlp_bias=False, norm_bias=False,
                    initializer_range=1.0, activation_dropout=0.1, scan_layers=False)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(1))
  hf.export_hf(params, cfg, tmp_path)
  loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
  ids, mask = _batch(cfg.vocab_size, [11, 6], 11, 6)
  dec, dec_mask = _batch(cfg.vocab_size, [5, 3], 5, 7)
  theirs = hf_models.run(loaded, input_ids=ids, attention_mask=mask, decoder_input_ids=dec,
                         decoder_attention_mask=dec_mask).logits.numpy()
  ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(dec), jnp.asarray(mask),
                     jnp.asarray(dec_mask))
  _close(ours, theirs, [5, 3])


def test_an_untied_head_is_refused_by_name(tmp_path):
  """A checkpoint whose lm_head differs from the token table (T5 1.1 as Google released it)
  has no place in a model that ties them: the error names the tensor."""
  ref = _reference(tmp_path, "t5-1.1")
  from safetensors.torch import save_file
  state = {k: v.contiguous() for k, v in ref.state_dict().items()
           if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
  state["lm_head.weight"] = state["shared.weight"] + 1.0
  save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf.HFConversionError, match="lm_head.weight is not tied"):
    hf.import_hf(tmp_path)
