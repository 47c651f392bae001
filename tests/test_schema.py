"""One batch schema (bertjax.data.schema): every loader's batches have exactly its fields, the
objectives read nothing else, `bertjax compile`'s abstract batch and `bertjax bench`'s example
batch are made from it, and a field a loader adds that the schema lacks fails where the step is
compiled."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

import train_helpers
from bertjax.data import make_batches, schema
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions, LoaderConfig
from bertjax.data.pipeline import CorpusBatches
from bertjax.data.sources import parse_source
from bertjax.data.tokenizers import load_tokenizer
from bertjax.data.sentencepiece_training import train_sentencepiece
from bertjax.finetune import completions, labeled, squad
from bertjax.models import ModelConfig, build_model, jit_init
from bertjax.training import objectives

WORDS = [f"w{i}" for i in range(120)]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  """A built BERT dataset (WordPiece) and a GPT one (SentencePiece with <|endoftext|>)."""
  root = tmp_path_factory.mktemp("schema")
  docs = train_helpers.word_documents(random.Random(0), WORDS, 60, (2, 8), (3, 10))
  corpus = train_helpers.write_bert_lines(root / "a.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  spm = train_sentencepiece([s for d in docs for s in d], root / "spm", vocab_size=300,
                            model_type="bpe", style="gpt")
  source = [parse_source(f"bert_lines:{corpus}?name=a")]
  options = BuildOptions(num_shards=2, eval_fraction=0.1)
  build_dataset(source, root / "vocab.txt", root / "bert", options)
  build_dataset(source, spm, root / "gpt", options)
  return root


@pytest.mark.parametrize("objective,instances", [
    ("mlm_nsp", "pairs"), ("mlm_sop", "pairs"), ("mlm", "full_sentences"), ("mlm", "packed"),
    ("causal_lm", "")])
def test_corpus_batches_have_the_schemas_fields(datasets, objective, instances):
  directory = datasets / ("gpt" if objective == "causal_lm" else "bert")
  cfg = LoaderConfig(dataset=str(directory), objective=objective, seq_length=32,
                     max_predictions=5, bert_instances=instances or "pairs")
  batches = CorpusBatches(cfg, "train", range(4), 4)
  try:
    batch = next(batches)
  finally:
    batches.close()
  schema.check(batch, objective)
  assert set(batch) == {f.name for f in schema.fields(objective, instances == "packed")}


@pytest.mark.parametrize("objective", ["mlm_nsp", "mlm_sop", "mlm", "causal_lm"])
def test_synthetic_batches_have_the_schemas_fields(objective):
  config = train_helpers.tiny_config("gpt" if objective == "causal_lm" else "bert",
                                     objective=objective)
  batch = next(make_batches(config, "train", range(4)))
  schema.check(batch, objective)


def test_finetuning_rows_have_the_schemas_fields(tmp_path):
  vocab = train_helpers.write_vocab(tmp_path / "vocab.txt", WORDS)
  tokenizer = load_tokenizer(vocab)
  (tmp_path / "c.tsv").write_text("sentence\tlabel\nw1 w2\ta\nw3\tb\n")
  (tmp_path / "r.tsv").write_text("sentence\tlabel\nw1 w2\t0.5\nw3\t2.0\n")
  (tmp_path / "t.jsonl").write_text('{"tokens": ["w1", "w2"], "tags": ["B-X", "O"]}\n')
  columns = labeled.Columns("sentence", None, "label", "tokens", "tags")
  for task, path in (("classification", "c.tsv"), ("regression", "r.tsv"),
                     ("token_classification", "t.jsonl")):
    examples = labeled.read_examples(tmp_path / path, task, columns)
    rows = labeled.encode(examples, tokenizer, 16, labeled.label_vocabulary(examples, task),
                          task)
    rows.pop("word_index", None)
    schema.check(rows, task, f"{task} rows")
  context = "w1 w2 w3 w4 w5 w6"
  (tmp_path / "qa.json").write_text(
      '{"data": [{"title": "t", "paragraphs": [{"context": "%s", "qas": [{"id": "q", '
      '"question": "w2", "answers": [{"text": "w3", "answer_start": 6}]}]}]}]}' % context)
  features = squad.build_features(squad.read_squad(tmp_path / "qa.json"), vocab,
                                  max_seq_length=16, doc_stride=4, max_query_length=4)
  schema.check(features.batch(), "question_answering", "question-answering windows")
  gpt = train_sentencepiece([f"w{i} w{i + 1} w{i + 2}." for i in range(100)] * 3,
                            tmp_path / "spm", vocab_size=400, model_type="bpe", style="gpt")
  (tmp_path / "c.jsonl").write_text('{"prompt": "w1 w2", "completion": " w3."}\n' * 3)
  packed = completions.load_completions(tmp_path / "c.jsonl", load_tokenizer(gpt), 16)
  schema.check(packed.rows, "causal_lm", "completion rows")


def test_a_field_the_schema_lacks_fails_where_the_step_compiles():
  config = train_helpers.tiny_config("bert")
  trainer = train_helpers.Trainer(config, train_helpers.mesh_for((8, 1, 1)))
  batch = next(make_batches(config, "train", range(16)))
  with pytest.raises(ValueError, match="segment_ids: not a field of a mlm_nsp batch"):
    trainer.compile_step({**batch, "segment_ids": batch["token_type_ids"]})
  with pytest.raises(ValueError, match="attention_mask: missing"):
    trainer.compile_step({k: v for k, v in batch.items() if k != "attention_mask"})
  with pytest.raises(ValueError, match="masked_lm_weights: int32 of rank 2, the schema says "
                                       "float32"):
    trainer.compile_step({**batch, "masked_lm_weights": batch["masked_lm_weights"].astype(
        np.int32)})
  trainer.compile_step(batch)


@pytest.mark.parametrize("objective", list(schema.BATCHES))
def test_objectives_read_the_schemas_fields_only(objective):
  """Each objective's loss runs on the schema's example batch of its objective, and fails
  without each field it reads."""
  family = {"causal_lm": "gpt", "span_corruption": "t5", "denoising": "bart",
            "text_to_text": "t5"}.get(objective, "bert")
  config = ModelConfig(family=family, vocab_size=64, hidden_size=16, num_layers=1,
                       num_heads=2, mlp_dim=32, max_positions=16,
                       type_vocab_size=0 if family == "gpt" else 2, num_labels=3)
  if objective == "rtd":  # replaced-token detection: ELECTRA's layout with a generator
    config = config.replace(architecture="electra", pooler=False, generator_hidden_size=8,
                            generator_num_heads=1)
  if objective == "mlm_sbo":  # SpanBERT: the span-boundary head
    config = config.replace(span_boundary_positions=10)
  head = {"classification": "sequence_classification", "regression": "sequence_classification",
          "token_classification": "token_classification",
          "question_answering": "question_answering"}.get(objective, "pretraining")
  model = build_model(config, head)
  params = jit_init(model)(jax.random.key(0))
  loss_fn = objectives.build_objective(objective, model)
  batch = schema.example_batch(objective, 4, 16, 5, vocab_size=64, decoder_length=6)
  if objective == "classification":
    batch["labels"] = batch["labels"] % 3
  loss, _ = loss_fn(params, batch, loss_fn.normalizers(batch), None)
  assert np.isfinite(float(loss))
  read = []
  for name in batch:
    try:
      without = {k: v for k, v in batch.items() if k != name}
      loss_fn(params, without, loss_fn.normalizers(without), None)
    except KeyError:
      read.append(name)
  assert read and set(read) <= set(batch)


def test_compile_and_bench_batches_come_from_the_schema():
  from bertjax.tools import aot, bench
  for name in ("bert_tiny", "gpt_tiny", "modernbert:size=tiny"):
    config = train_helpers.config_lib.load_config(name)
    packed = config.data.bert_instances == "packed"
    want = {f.name for f in schema.fields(config.objective, packed)}
    abstract = aot.abstract_batch(config)
    example = bench.synthetic_batch(config)
    assert set(abstract) == set(example) == want, name
    schema.check(example, config.objective)
    for key, value in example.items():
      assert abstract[key].shape == value.shape and abstract[key].dtype == value.dtype
