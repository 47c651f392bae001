"""Hugging Face parity: logits of imported random-init `transformers` models match bertjax.

Tolerances: max abs difference <= 1e-5 (<= 1e-4 for 12-layer shapes), fp32, eval mode.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from bertjax import hf
from bertjax.models import build_model

BERT_SHAPES = [
    pytest.param(dict(), 1e-5, id="2L-64w-4h-gelu"),
    pytest.param(dict(hidden_act="gelu_new", num_hidden_layers=3, hidden_size=48,
                      num_attention_heads=3, intermediate_size=80, type_vocab_size=3),
                 1e-5, id="3L-48w-3h-gelu_new"),
    pytest.param(dict(num_hidden_layers=12, hidden_size=32, num_attention_heads=2,
                      intermediate_size=64), 1e-4, id="12L-32w-2h"),
]


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("shape,tol", BERT_SHAPES)
def test_bert_pretraining_parity(tmp_path, shape, tol, scan):
  ref = hf_models.bert(tmp_path, **shape)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == []
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask,
                         output_hidden_states=True)
  model = build_model(cfg)
  ours = model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                     jnp.asarray(mask))
  assert hf_models.max_diff_at(ours.mlm_logits, theirs.prediction_logits.numpy(), lengths) <= tol
  assert np.abs(np.asarray(ours.nsp_logits) - theirs.seq_relationship_logits.numpy()).max() <= tol
  assert hf_models.max_diff_at(ours.sequence, theirs.hidden_states[-1].numpy(), lengths) <= tol
  # Pooled output against BertModel's pooler on the same weights.
  pooled = hf_models.run(ref.bert, input_ids=ids, token_type_ids=types,
                         attention_mask=mask).pooler_output.numpy()
  assert np.abs(np.asarray(ours.pooled) - pooled).max() <= tol


def test_bert_gathered_positions_match_reference(tmp_path):
  """The sparse MLM head (masked_lm_positions) equals the reference at those positions."""
  ref = hf_models.bert(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size)
  positions = np.stack([np.sort(np.random.RandomState(b).choice(n, 4, replace=False))
                        for b, n in enumerate(lengths)])
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types,
                         attention_mask=mask).prediction_logits.numpy()
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask), jnp.asarray(positions))
  expected = np.take_along_axis(theirs, positions[:, :, None], axis=1)
  assert ours.mlm_logits.shape == expected.shape
  assert np.abs(np.asarray(ours.mlm_logits) - expected).max() <= 1e-5


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("shape,tol", [
    pytest.param(dict(), 1e-5, id="2L-64w-4h"),
    pytest.param(dict(n_layer=3, n_embd=48, n_head=6, n_inner=100), 1e-5, id="3L-48w-6h"),
    pytest.param(dict(n_layer=12, n_embd=32, n_head=2), 1e-4, id="12L-32w-2h"),
])
def test_gpt2_parity(tmp_path, shape, tol, scan):
  ref = hf_models.gpt2(tmp_path, **shape)
  params, cfg, report = hf.import_hf(tmp_path, scan_layers=scan)
  assert report.fresh == [] and cfg.norm_position == "pre"
  ids, _, mask, lengths = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, attention_mask=mask).logits.numpy()
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids),
                                attention_mask_BL=jnp.asarray(mask))
  assert hf_models.max_diff_at(ours, theirs, lengths) <= tol


def test_gpt1_parity(tmp_path):
  ref = hf_models.openai_gpt(tmp_path)
  params, cfg, _ = hf.import_hf(tmp_path)
  assert cfg.norm_position == "post" and not cfg.final_layer_norm
  ids, _, _, _ = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids).logits.numpy()
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids))
  assert np.abs(np.asarray(ours) - theirs).max() <= 1e-5


def test_masked_lm_import_reports_fresh_heads(tmp_path):
  """BertForMaskedLM has no pooler or NSP head: they are initialised fresh and reported."""
  ref = hf_models.bert(tmp_path, cls=hf_models.transformers.BertForMaskedLM)
  params, cfg, report = hf.import_hf(tmp_path)
  assert set(report.fresh) == {"bert/pooler/kernel", "bert/pooler/bias", "nsp/kernel",
                               "nsp/bias"}
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask))
  assert hf_models.max_diff_at(ours.mlm_logits, theirs.logits.numpy(), lengths) <= 1e-5


def test_bare_bert_model_import(tmp_path):
  ref = hf_models.bert(tmp_path, cls=hf_models.transformers.BertModel)
  params, cfg, report = hf.import_hf(tmp_path)
  assert "mlm_bias" in report.fresh and "nsp/kernel" in report.fresh
  assert "bert/pooler/kernel" not in report.fresh
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size)
  theirs = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = build_model(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask))
  assert hf_models.max_diff_at(ours.sequence, theirs.last_hidden_state.numpy(), lengths) <= 1e-5
  assert np.abs(np.asarray(ours.pooled) - theirs.pooler_output.numpy()).max() <= 1e-5
