"""MLM/NSP and causal-LM losses: only masked positions and real targets count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.training import objectives
from bertjax.data.synthetic import SyntheticMarkov
from bertjax.models import ModelConfig, build_model, jit_init

SHAPE = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64,
             max_positions=16, hidden_dropout=0.0, attention_dropout=0.0)


def _bert():
  model = build_model(ModelConfig(family="bert", **SHAPE))
  return model, jit_init(model)(jax.random.key(0))


def _bert_batch():
  data = SyntheticMarkov(vocab_size=64, seq_length=16, objective="mlm_nsp", max_predictions=4,
                         num_words=32)
  batch = {k: jnp.asarray(v) for k, v in data.batch(0, range(4)).items()}
  # Padded prediction slots: weight 0 and garbage ids/positions must not matter.
  batch["masked_lm_weights"] = batch["masked_lm_weights"].at[:, -1].set(0.0)
  return batch


@pytest.mark.slow
def test_mlm_loss_matches_hand_computation():
  model, params = _bert()
  batch = _bert_batch()
  loss_fn = objectives.build_objective("mlm_nsp", model)
  loss, metrics = loss_fn(params, batch, loss_fn.normalizers(batch), None)
  out = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                    batch["attention_mask"], batch["masked_lm_positions"])
  logp = jax.nn.log_softmax(np.asarray(out.mlm_logits), axis=-1)
  w = np.asarray(batch["masked_lm_weights"])
  nll = -np.take_along_axis(np.asarray(logp), np.asarray(batch["masked_lm_ids"])[..., None],
                            axis=-1)[..., 0]
  expected_mlm = (nll * w).sum() / w.sum()
  nsp_logp = jax.nn.log_softmax(np.asarray(out.nsp_logits), axis=-1)
  expected_nsp = -np.take_along_axis(np.asarray(nsp_logp),
                                     np.asarray(batch["next_sentence_labels"])[:, None],
                                     axis=1).mean()
  assert float(metrics["mlm_loss"]) == pytest.approx(expected_mlm, rel=1e-5)
  assert float(metrics["nsp_loss"]) == pytest.approx(expected_nsp, rel=1e-5)
  assert float(loss) == pytest.approx(expected_mlm + expected_nsp, rel=1e-5)


def test_padded_prediction_slots_do_not_contribute():
  model, params = _bert()
  batch = _bert_batch()
  loss_fn = objectives.build_objective("mlm", model)
  changed = dict(batch, masked_lm_ids=batch["masked_lm_ids"].at[:, -1].set(7),
                 masked_lm_positions=batch["masked_lm_positions"].at[:, -1].set(0))
  a, _ = loss_fn(params, batch, loss_fn.normalizers(batch), None)
  b, _ = loss_fn(params, changed, loss_fn.normalizers(changed), None)
  assert float(a) == float(b)


def test_mlm_only_objective_has_no_sentence_loss():
  model, params = _bert()
  batch = _bert_batch()
  loss_fn = objectives.build_objective("mlm", model)
  loss, metrics = loss_fn(params, batch, loss_fn.normalizers(batch), None)
  assert "nsp_loss" not in metrics and float(loss) == float(metrics["mlm_loss"])


def test_causal_lm_ignores_masked_targets():
  cfg = ModelConfig(family="gpt", norm_position="pre", type_vocab_size=0, **SHAPE)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  data = SyntheticMarkov(vocab_size=64, seq_length=16, objective="causal_lm", num_words=32)
  batch = {k: jnp.asarray(v) for k, v in data.batch(0, range(3)).items()}
  assert int(batch["loss_mask"].sum()) < batch["loss_mask"].size  # documents were packed
  loss_fn = objectives.build_objective("causal_lm", model)
  a, _ = loss_fn(params, batch, loss_fn.normalizers(batch), None)
  # Targets where loss_mask is 0 (across a document boundary) can be anything.
  scrambled = jnp.where(batch["loss_mask"] == 1, batch["target_ids"], 5)
  b, _ = loss_fn(params, dict(batch, target_ids=scrambled), loss_fn.normalizers(batch), None)
  assert float(a) == float(b)
  # And the loss of a masked target is not silently zero: unmasking it changes the loss.
  c, _ = loss_fn(params, dict(batch, loss_mask=jnp.ones_like(batch["loss_mask"])),
                 loss_fn.normalizers(batch), None)
  assert float(c) != float(a)


def test_objective_family_mismatch_is_an_error():
  model, _ = _bert()
  with pytest.raises(ValueError, match="causal_lm needs a gpt model"):
    objectives.build_objective("causal_lm", model)
  with pytest.raises(ValueError, match="unknown objective"):
    objectives.build_objective("electra", model)
