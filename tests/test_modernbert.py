"""ModernBERT (Warner et al. 2024) against Hugging Face's ModernBertForMaskedLM: random-init
parity with the local/global attention pattern, HF -> bertjax -> HF and bertjax -> HF ->
bertjax round trips, refusals; MosaicBERT's ALiBi slopes against the reference's. Packed
documents: tests/test_unpadding.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file

import hf_models
from bertjax import hf
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.models import positions

torch = hf_models.torch
transformers = hf_models.transformers

# 5 layers with a global layer every 3 (0 and 3 global) and a window of 8 (4 each side) over
# 24 positions: most query-key pairs of a local layer fall outside the window.
SMALL = dict(vocab_size=101, hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
             intermediate_size=96, max_position_embeddings=64, local_attention=8,
             global_attn_every_n_layers=3, global_rope_theta=160_000.0,
             local_rope_theta=10_000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             cls_token_id=1, sep_token_id=2, attn_implementation="eager")


def modernbert(tmp, seed=0, **config):
  torch.manual_seed(seed)
  model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{**SMALL,
                                                                              **config}))
  model = hf_models.perturbed(model, seed)
  model.save_pretrained(tmp)
  return model


def _batch(vocab, batch_size=3, length=24, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(3, vocab, (batch_size, length))
  lengths = [length, 17, 9][:batch_size]
  mask = (np.arange(length)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
  return ids, mask, lengths


def _max_diff_at(ours, theirs, lengths):
  return max(float(np.abs(np.asarray(ours[b, :n]) - theirs[b, :n]).max())
             for b, n in enumerate(lengths))


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("shape", [dict(), dict(norm_bias=True, attention_bias=True,
                                                mlp_bias=True, classifier_bias=True,
                                                num_hidden_layers=4,
                                                global_attn_every_n_layers=2)],
                         ids=["base-layout", "with-biases"])
def test_modernbert_parity(tmp_path, shape, scan):
  ref = modernbert(tmp_path, **shape)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == ["nsp/kernel", "nsp/bias"]
  assert cfg.position_embedding == "rotary" and cfg.local_window == 8
  ids, mask, lengths = _batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask, output_hidden_states=True)
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
  assert _max_diff_at(ours.mlm_logits, theirs.logits.numpy(), lengths) <= 1e-5
  assert _max_diff_at(ours.sequence, theirs.hidden_states[-1].numpy(), lengths) <= 1e-5


def test_parity_needs_the_window_and_both_thetas(tmp_path):
  """The same weights with every layer global, or one rope base for all layers, give other
  logits: the parity above exercises the local/global pattern."""
  ref = modernbert(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  ids, mask, lengths = _batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask).logits.numpy()
  for wrong in (dict(local_window=0), dict(local_rope_theta=cfg.rope_theta),
                dict(global_every=1 + cfg.global_every)):
    ours = build_model(cfg.replace(**wrong)).apply({"params": params}, jnp.asarray(ids), None,
                                                   jnp.asarray(mask))
    assert _max_diff_at(ours.mlm_logits, theirs, lengths) > 1e-3, wrong


def test_hf_bertjax_hf_is_bit_identical(tmp_path):
  ref = modernbert(tmp_path / "in", norm_bias=True)
  params, cfg, _ = hf.import_hf(tmp_path / "in")
  hf.export_hf(params, cfg, tmp_path / "out")
  original = load_file(str(tmp_path / "in" / "model.safetensors"))
  exported = load_file(str(tmp_path / "out" / "model.safetensors"))
  # transformers writes the tied decoder weight only when it is its own tensor.
  original.pop("decoder.weight", None)
  assert original.keys() == exported.keys()
  for name in original:
    np.testing.assert_array_equal(original[name], exported[name], err_msg=name)
  reloaded = transformers.ModernBertForMaskedLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").eval()
  ids, mask, lengths = _batch(cfg.vocab_size)
  a = hf_models.run(ref, input_ids=ids, attention_mask=mask).logits.numpy()
  b = hf_models.run(reloaded, input_ids=ids, attention_mask=mask).logits.numpy()
  assert _max_diff_at(a, b, lengths) == 0.0


def _modern_config(**overrides):
  values = dict(family="bert", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                mlp_dim=40, max_positions=32, type_vocab_size=0, norm_position="pre",
                layer_norm_eps=1e-5, position_embedding="rotary", rope_theta=160_000.0,
                local_rope_theta=10_000.0, mlp_gated=True, attention_bias=False,
                mlp_bias=False, norm_bias=False, head_bias=False, pooler=False,
                local_window=6, global_every=3, first_attention_norm=False,
                hidden_dropout=0.0, attention_dropout=0.0)
  values.update(overrides)
  return ModelConfig(**values)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_bertjax_hf_bertjax_is_bit_identical(tmp_path, scan):
  cfg = _modern_config(scan_layers=scan)
  params = jit_init(build_model(cfg))(jax.random.key(0))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                        .astype(np.float32), params)
  hf.export_hf(params, cfg, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["layer_types"] == ["full_attention", "sliding_attention",
                                   "sliding_attention", "full_attention"]
  back, cfg_back, _ = hf.import_hf(tmp_path, scan_layers=scan)
  ours = traverse_util.flatten_dict(jax.device_get(params))
  theirs = traverse_util.flatten_dict(jax.device_get(back))
  assert ours.keys() == theirs.keys()
  # NSP: no ModernBERT equivalent; layer 0's attention norm: none either (compared below).
  skipped = {k for k in ours if k[0] == "nsp" or "attention_norm" in k and (
      "layers_0" in k or scan)}
  for key in set(ours) - skipped:
    np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]),
                                  err_msg="/".join(key))
  if scan:  # the exported layers 1.. of the stacked norm; layer 0's is unused
    np.testing.assert_array_equal(
        ours[("bert", "encoder", "layers", "attention_norm", "scale")][1:],
        theirs[("bert", "encoder", "layers", "attention_norm", "scale")][1:])
  assert cfg_back == cfg.replace(initializer_range=cfg_back.initializer_range)
  # transformers reads the export: the same logits as bertjax.
  model = transformers.ModernBertForMaskedLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  ids, mask, lengths = _batch(cfg.vocab_size, length=20)
  theirs_logits = hf_models.run(model, input_ids=ids, attention_mask=mask).logits.numpy()
  ours_logits = build_model(cfg).apply({"params": params}, jnp.asarray(ids), None,
                                       jnp.asarray(mask)).mlm_logits
  assert _max_diff_at(ours_logits, theirs_logits, lengths) <= 1e-5


def test_non_modernbert_rotary_export_is_refused(tmp_path):
  cfg = _modern_config(pooler=True)
  params = jit_init(build_model(cfg))(jax.random.key(0))
  with pytest.raises(hf.HFConversionError, match="pooler=True"):
    hf.export_hf(params, cfg, tmp_path)


def test_alibi_slopes_are_the_reference_ones():
  """ALiBi's reference get_slopes (Press et al.; MosaicBERT's bert_layers.py): for 12 heads the
  8 slopes of 8 heads, then every other one of 16 heads', in that head order."""
  expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
  np.testing.assert_allclose(positions.alibi_slopes(12), expected, rtol=1e-6)
  np.testing.assert_allclose(positions.alibi_slopes(16), [2.0 ** -(k / 2) for k in range(1, 17)],
                             rtol=1e-6)
  np.testing.assert_allclose(positions.alibi_slopes(8), [2.0 ** -k for k in range(1, 9)],
                             rtol=1e-6)


@pytest.mark.parametrize("change,message", [
    (dict(prefix_length=2), "does not combine with sliding-window layers, ALiBi"),
    (dict(norm_position="post"), "first_attention_norm=False is a pre-LN option"),
    (dict(attention="splash", position_embedding="alibi", local_window=0,
          first_attention_norm=True), "alibi needs the XLA attention core"),
])
def test_contradictory_modern_options_are_refused(change, message):
  with pytest.raises(ValueError, match=message):
    _modern_config(**change)


def test_bias_free_classic_bert_export_is_refused_by_name(tmp_path):
  cfg = ModelConfig(family="bert", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    mlp_dim=48, max_positions=16, mlp_bias=False)
  params = jit_init(build_model(cfg))(jax.random.key(0))
  with pytest.raises(hf.HFConversionError, match="mlp_bias=False"):
    hf.export_hf(params, cfg, tmp_path)


def test_peft_export_of_a_modernbert_is_refused():
  """peft's adapter names are BERT's and GPT-2's; a ModernBERT's LoRA is exported merged."""
  from bertjax.hf import peft as hf_peft
  cfg = _modern_config(lora_rank=4, lora_targets="out,wo")
  with pytest.raises(ValueError, match="export the merged model with --format hf"):
    hf_peft.peft_config_dict(cfg, "base")
