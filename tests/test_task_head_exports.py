"""Fine-tuned ELECTRA and DeBERTa encoders exported to their transformers task classes
(sequence classification, token classification, question answering): the class transformers
loads from the export computes bertjax's logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_models
from bertjax import hf
from bertjax.models import ModelConfig, build_model, init_params

transformers = hf_models.transformers

ARCHITECTURES = {
    "electra": dict(architecture="electra", embedding_size=24, type_vocab_size=2),
    "deberta": dict(architecture="deberta", position_embedding="relative", position_buckets=8,
                    max_relative_positions=16, type_vocab_size=0, layer_norm_eps=1e-7),
}
CLASSES = {("electra", "sequence_classification"): "ElectraForSequenceClassification",
           ("electra", "token_classification"): "ElectraForTokenClassification",
           ("electra", "question_answering"): "ElectraForQuestionAnswering",
           ("deberta", "sequence_classification"): "DebertaV2ForSequenceClassification",
           ("deberta", "token_classification"): "DebertaV2ForTokenClassification",
           ("deberta", "question_answering"): "DebertaV2ForQuestionAnswering"}


@pytest.mark.parametrize("architecture,head", list(CLASSES),
                         ids=[f"{a}-{h}" for a, h in CLASSES])
def test_a_fine_tuned_encoder_exports_to_its_task_class(tmp_path, architecture, head):
  cfg = ModelConfig(family="bert", vocab_size=101, hidden_size=64, num_layers=2, num_heads=4,
                    mlp_dim=96, max_positions=40, pooler=False, num_labels=3,
                    hidden_dropout=0.0, attention_dropout=0.0, **ARCHITECTURES[architecture])
  model = build_model(cfg, head)
  params = jax.device_get(jax.jit(lambda k: init_params(model, k, 1, 8))(jax.random.key(0)))
  params = jax.tree.map(lambda x: np.asarray(getattr(x, "value", x)), params,
                        is_leaf=lambda x: hasattr(x, "value"))
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype),
                        params)
  labels = ["a", "b", "c"] if head != "question_answering" else None
  out = hf.export_hf(params, cfg, tmp_path / "out", head=head, labels=labels)
  reference = getattr(transformers, CLASSES[architecture, head]).from_pretrained(out).eval()
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size)
  inputs = dict(input_ids=ids, attention_mask=mask)
  if cfg.type_vocab_size:
    inputs["token_type_ids"] = types
  theirs = hf_models.run(reference, **inputs)
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids),
                                jnp.asarray(types) if cfg.type_vocab_size else None,
                                jnp.asarray(mask)))
  if head == "sequence_classification":
    np.testing.assert_allclose(ours, theirs.logits.numpy(), atol=1e-5)
    assert reference.config.id2label == {0: "a", 1: "b", 2: "c"}
    return
  if head == "question_answering":
    theirs_BL2 = np.stack([theirs.start_logits.numpy(), theirs.end_logits.numpy()], -1)
  else:
    theirs_BL2 = theirs.logits.numpy()
  real = np.asarray(mask, bool)
  np.testing.assert_allclose(ours[real], theirs_BL2[real], atol=1e-5)
