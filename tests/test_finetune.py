"""Fine-tuning (bertjax.training.finetuning, bertjax.finetune.labeled): a tiny synthetic
pair-classification task learnt to high dev accuracy from random init; frozen parameters
bit-identical after training; metrics against hand-computed values and scipy; readers' errors
name file and line; the fine-tuned model exported to Hugging Face gives our logits."""

from __future__ import annotations

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from bertjax.checkpoints import weights as weights_lib
from bertjax.checkpoints.weights import load_finetuned
from bertjax.checkpoints import params as checkpoint

from bertjax.models import groups
from bertjax.training import finetuning as ft, objectives
from bertjax.finetune import scores as dev_scores
from bertjax.finetune import labeled
from bertjax.data.errors import CorpusError
from bertjax.data.tokenizers import load_tokenizer
from bertjax.finetune.registry import TASKS
from bertjax.models import ModelConfig, build_model, jit_init
from train_helpers import finetune

# Two topics: "same topic" is an XOR of the two sentences' topics, a genuine pair task.
TOPICS, WORDS = 2, 6
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _word(t: int, j: int) -> str:
  return f"w{t}x{j}"


def _vocab(tmp_path):
  path = tmp_path / "vocab.txt"
  words = [_word(t, j) for t in range(TOPICS) for j in range(WORDS)] + ["new", "york", "##s"]
  path.write_text("\n".join(SPECIALS + words) + "\n")
  return path


def _tiny(vocab_size: int, **changes) -> ModelConfig:
  return ModelConfig(family="bert", vocab_size=vocab_size, hidden_size=32, num_layers=2,
                     num_heads=2, mlp_dim=64, max_positions=32, hidden_dropout=0.0,
                     attention_dropout=0.0, **changes)


def _sentence(rng: random.Random, topic: int) -> str:
  return " ".join(_word(topic, rng.randrange(WORDS)) for _ in range(rng.randint(3, 6)))


def _pair_task(path, n: int, seed: int) -> None:
  """TSV with a header: label "same" when both sentences are drawn from the same topic."""
  rng = random.Random(seed)
  lines = ["id\tsentence1\tsentence2\tlabel"]
  for i in range(n):
    a = rng.randrange(TOPICS)
    same = rng.random() < 0.5
    b = a if same else rng.choice([t for t in range(TOPICS) if t != a])
    lines.append(f"{i}\t{_sentence(rng, a)}\t{_sentence(rng, b)}\t"
                 f"{'same' if same else 'different'}")
  path.write_text("\n".join(lines) + "\n")


def _spec(**changes) -> dict:
  """Fine-tuning settings by their friendly names (the `bertjax finetune` flags)."""
  base = dict(task="classification", text_a="sentence1", text_b="sentence2", label="label",
              learning_rate=1e-3, batch_size=32, epochs=8, seq_length=16, seed=0,
              log_every=50)
  base.update(changes)
  return base


def _finetune(spec: dict, init_from, train, dev, out, **more) -> dict:
  return finetune(out, init_from, train, dev, **spec, **more)


def _flat(tree):
  return {"/".join(k): np.asarray(v) for k, v in
          traverse_util.flatten_dict(jax.device_get(tree)).items()}


# --- learning a task ------------------------------------------------------------------------

@pytest.mark.slow
def test_pair_classification_learns_from_random_init(tmp_path):
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 512, seed=1)
  _pair_task(tmp_path / "dev.tsv", 128, seed=2)
  # A wide initialisation (0.2) shortens the plateau an XOR task starts on (~200 steps at
  # 0.02) to a few dozen steps.
  cfg = _tiny(len(vocab.read_text().split()), initializer_range=0.2)
  spec = _spec(model=cfg, tokenizer=str(vocab), export_hf=True, patience=4, epochs=10,
               learning_rate=3e-3)
  result = _finetune(spec, None, tmp_path / "train.tsv", tmp_path / "dev.tsv",
                       tmp_path / "out")
  assert result["labels"] == ["different", "same"]
  assert result["metric"] == "accuracy"
  assert result["best_value"] >= 0.9, result["history"]
  lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
  dev = [x for x in lines if x["split"] == "dev"]
  assert dev and {"accuracy", "f1", "matthews", "step", "epoch"} <= set(dev[0])
  assert max(x["accuracy"] for x in dev) == result["best_value"]
  assert [x["step"] for x in dev] == [h["step"] for h in result["history"]]
  # The best checkpoint reloads and scores the same; it exports to HF with id2label.
  params, config, info = load_finetuned(result["best_dir"])
  assert info["labels"] == ["different", "same"] and config.num_labels == 2
  hf_config = json.loads((tmp_path / "out" / "hf" / "config.json").read_text())
  assert hf_config["architectures"] == ["BertForSequenceClassification"]
  assert hf_config["id2label"] == {"0": "different", "1": "same"}


@pytest.mark.parametrize("freeze", ["embeddings", "bottom:1", "all_but_head"])
@pytest.mark.slow
def test_frozen_parameters_bit_identical(tmp_path, freeze):
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 64, seed=1)
  _pair_task(tmp_path / "dev.tsv", 32, seed=2)
  cfg = _tiny(len(vocab.read_text().split()))
  start = jit_init(build_model(cfg))(jax.random.key(3))  # a "pre-trained" BertForPreTraining
  pretrained = tmp_path / "pretrained"
  checkpoint.save_params(pretrained, start, cfg)
  spec = _spec(tokenizer=str(vocab), freeze=freeze, epochs=2, weight_decay=0.1)
  result = _finetune(spec, pretrained, tmp_path / "train.tsv", tmp_path / "dev.tsv",
                       tmp_path / "out")
  tuned, _, _ = load_finetuned(result["best_dir"])
  before, after = _flat(start["bert"]), _flat(tuned["bert"])
  frozen, trained = [], []
  for name, old in before.items():
    new = after[name]
    if name.startswith("encoder/layers/") and freeze == "bottom:1":
      np.testing.assert_array_equal(new[0], old[0], err_msg=f"{name} layer 0")
      assert not np.array_equal(new[1], old[1]), f"{name} layer 1 did not train"
      continue
    is_frozen = (freeze == "all_but_head" or name.split("/")[0] in groups.EMBEDDINGS)
    (frozen if is_frozen else trained).append(name)
    if is_frozen:
      np.testing.assert_array_equal(new, old, err_msg=name)
    elif not name.startswith("pooler"):
      assert not np.array_equal(new, old), f"{name} did not train"
  assert frozen
  # The head trains whatever is frozen.
  assert np.abs(np.asarray(tuned["classifier"]["kernel"])).max() > 0


def test_frozen_rows_unscanned_layers():
  cfg = _tiny(40, scan_layers=False)
  params = jit_init(build_model(cfg, "sequence_classification"))(jax.random.key(0))
  frozen = _flat(groups.frozen_rows(params, "bottom:1"))
  assert frozen["bert/encoder/layers_0/mlp/wi/kernel"] is True or \
      bool(frozen["bert/encoder/layers_0/mlp/wi/kernel"])
  assert not bool(frozen["bert/encoder/layers_1/mlp/wi/kernel"])
  assert bool(frozen["bert/word_embeddings/embedding"])
  assert not bool(frozen["classifier/kernel"])
  with pytest.raises(ValueError, match="freeze"):
    groups.parse_freeze("top:2")
  with pytest.raises(ValueError, match="3 layers|has 2 layers"):
    groups.frozen_rows(params, "bottom:3")


# --- regression and token classification -------------------------------------------------

@pytest.mark.slow
def test_regression_learns_a_synthetic_score(tmp_path):
  """STS-B-like: the score is 5 x the fraction of topic-0 words over both sentences."""
  vocab = _vocab(tmp_path)
  for name, n, seed in (("train", 384, 1), ("dev", 96, 2)):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
      words = [[_word(rng.randrange(TOPICS), rng.randrange(WORDS))
                for _ in range(rng.randint(3, 6))] for _ in range(2)]
      score = 5 * sum(w.startswith("w0") for s in words for w in s) / sum(map(len, words))
      rows.append({"s1": " ".join(words[0]), "s2": " ".join(words[1]), "score": score})
    (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  cfg = _tiny(len(vocab.read_text().split()), initializer_range=0.2)
  spec = _spec(task="regression", text_a="s1", text_b="s2", label="score", model=cfg,
               tokenizer=str(vocab), epochs=6, learning_rate=3e-3)
  result = _finetune(spec, None, tmp_path / "train.jsonl", tmp_path / "dev.jsonl",
                       tmp_path / "out")
  assert result["metric"] == "pearson" and result["labels"] == []
  assert result["best_value"] > 0.8, result["history"]
  assert {"dev_spearman", "dev_mse"} <= set(result["history"][-1])
  _, config, _ = load_finetuned(result["best_dir"])
  assert config.num_labels == 1


def _tagged(path, n: int, seed: int) -> None:
  """NER-like: maximal runs of topic-0 words are entities (B-ENT, I-ENT), topic 1 is O."""
  rng = random.Random(seed)
  with path.open("w") as f:
    for _ in range(n):
      topics = [rng.randrange(TOPICS) for _ in range(rng.randint(3, 7))]
      tokens = [_word(t, rng.randrange(WORDS)) for t in topics]
      tags = ["O" if t else ("I-ENT" if i and topics[i - 1] == 0 else "B-ENT")
              for i, t in enumerate(topics)]
      f.write(json.dumps({"tokens": tokens, "tags": tags}) + "\n")


@pytest.mark.slow
def test_token_classification_runs_and_learns(tmp_path):
  vocab = _vocab(tmp_path)
  _tagged(tmp_path / "train.jsonl", 256, 1)
  _tagged(tmp_path / "dev.jsonl", 64, 2)
  cfg = _tiny(len(vocab.read_text().split()), initializer_range=0.2)
  spec = _spec(task="token_classification", model=cfg, tokenizer=str(vocab), epochs=10,
               learning_rate=3e-3, export_hf=True)
  result = _finetune(spec, None, tmp_path / "train.jsonl", tmp_path / "dev.jsonl",
                       tmp_path / "out")
  assert result["labels"] == ["O", "B-ENT", "I-ENT"]
  assert result["metric"] == "f1" and result["best_value"] > 0.9, result["history"]
  hf_config = json.loads((tmp_path / "out" / "hf" / "config.json").read_text())
  assert hf_config["architectures"] == ["BertForTokenClassification"]


def test_word_tags_go_to_the_first_piece(tmp_path):
  tokenizer = load_tokenizer(_vocab(tmp_path))
  example = labeled.Example("x:1", tokens=["new", "yorks", "w0x1"], tags=["B-LOC", "I-LOC", "O"])
  enc = labeled.encode([example], tokenizer, 8, ["O", "B-LOC", "I-LOC"],
                       "token_classification")
  vocab = tokenizer.vocab
  assert enc["input_ids"][0].tolist() == [vocab["[CLS]"], vocab["new"], vocab["york"],
                                          vocab["##s"], vocab["w0x1"], vocab["[SEP]"], 0, 0]
  assert enc["labels"][0].tolist() == [-100, 1, 2, -100, 0, -100, -100, -100]
  assert enc["word_index"][0].tolist() == [-1, 0, 1, -1, 2, -1, -1, -1]
  assert enc["attention_mask"][0].tolist() == [1] * 6 + [0] * 2
  # Truncation drops whole words that do not fit.
  short = labeled.encode([example], tokenizer, 5, ["O", "B-LOC", "I-LOC"],
                         "token_classification")
  assert short["labels"][0].tolist() == [-100, 1, 2, -100, -100]


def test_pair_encoding_truncates_the_longer_side(tmp_path):
  tokenizer = load_tokenizer(_vocab(tmp_path))
  a, b = "w0x0 w0x1 w0x2 w0x3 w0x4 w0x5", "w1x0 w1x1"
  enc = labeled.encode([labeled.Example("x:1", a, b, "0")], tokenizer, 9, ["0", "1"],
                       "classification")
  v = tokenizer.vocab
  # 9 - 3 = 6 tokens for the pair: A (6) is cut to 4, B (2) kept.
  assert enc["input_ids"][0].tolist() == [v["[CLS]"], v["w0x0"], v["w0x1"], v["w0x2"],
                                          v["w0x3"], v["[SEP]"], v["w1x0"], v["w1x1"],
                                          v["[SEP]"]]
  assert enc["token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
  assert labeled.truncate_pair([1, 2, 3], [4, 5, 6, 7, 8], 4) == ([1, 2], [4, 5])


# --- metrics -----------------------------------------------------------------------------

def test_metrics_hand_computed():
  labels = np.array([1, 1, 1, 0, 0, 0, 0, 1])
  preds = np.array([1, 1, 0, 0, 0, 1, 0, 1])
  # tp=3 fp=1 fn=1 tn=3
  assert dev_scores.accuracy(labels, preds) == 0.75
  assert dev_scores.f1_binary(labels, preds) == pytest.approx(2 * 3 / (2 * 3 + 1 + 1))
  assert dev_scores.matthews(labels, preds) == pytest.approx((3 * 3 - 1 * 1) / np.sqrt(4 * 4 * 4 * 4))
  assert dev_scores.matthews(labels, np.ones_like(labels)) == 0.0  # constant prediction: undefined
  assert dev_scores.f1_binary(np.zeros(3), np.zeros(3)) == 0.0
  assert dev_scores.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
  assert dev_scores.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
  assert dev_scores.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
  assert dev_scores._ranks([10, 20, 20, 30]).tolist() == [1, 2.5, 2.5, 4]
  assert dev_scores.bio_spans(["B-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "PER"]) == {
      ("PER", 0, 2), ("LOC", 3, 4), ("LOC", 4, 6), ("PER", 6, 7)}
  scores = dev_scores.entity_f1([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "O"]])
  assert scores == {"precision": 1.0, "recall": 0.5, "f1": pytest.approx(2 / 3)}
  tok = dev_scores.task_scores("token_classification", np.array([[-100, 1, 2, 0, -100]]),
                        np.array([[0, 1, 2, 1, 1]]), ["O", "B-X", "I-X"])
  assert tok["accuracy"] == pytest.approx(2 / 3) and tok["precision"] == 0.5


def test_metrics_match_scipy():
  stats = pytest.importorskip("scipy.stats")
  rng = np.random.RandomState(0)
  x = rng.randint(0, 5, 50).astype(float)  # ties
  y = x + rng.standard_normal(50)
  assert dev_scores.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
  assert dev_scores.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
  # Multi-class Matthews against its definition via the confusion matrix (sklearn's formula).
  t, p = rng.randint(0, 3, 200), rng.randint(0, 3, 200)
  c = np.zeros((3, 3))
  np.add.at(c, (t, p), 1)
  s, n = c.trace(), c.sum()
  ts, ps = c.sum(1), c.sum(0)
  expected = (s * n - ts @ ps) / np.sqrt((n * n - ps @ ps) * (n * n - ts @ ts))
  assert dev_scores.matthews(t, p) == pytest.approx(expected)


# --- readers -----------------------------------------------------------------------------

def test_readers_tsv_csv_jsonl_conll(tmp_path):
  (tmp_path / "a.tsv").write_text('q\tsentence\tlabel\n1\the said "hi\t1\n2\tok\t0\n')
  ex = labeled.read_examples(tmp_path / "a.tsv", "classification")
  assert [(e.text_a, e.label) for e in ex] == [('he said "hi', "1"), ("ok", "0")]
  assert ex[1].where.endswith("a.tsv:3")
  (tmp_path / "b.csv").write_text('s1,s2,y\n"a, b",c,1.5\nd,e,2\n')
  ex = labeled.read_examples(tmp_path / "b.csv", "regression", labeled.Columns("s1", "s2", "y"))
  assert [(e.text_a, e.text_b, e.label) for e in ex] == [("a, b", "c", 1.5), ("d", "e", 2.0)]
  # CoLA: no header; columns by number.
  (tmp_path / "cola.tsv").write_text("src\t1\t\tGood one .\nsrc\t0\t*\tbad one\n")
  ex = labeled.read_examples(tmp_path / "cola.tsv", "classification",
                             labeled.Columns("3", None, "1"), header=False)
  assert [(e.text_a, e.label) for e in ex] == [("Good one .", "1"), ("bad one", "0")]
  (tmp_path / "c.conll").write_text("-DOCSTART- O\n\nEU NNP B-ORG\nrejects VBZ O\n\nPeter B-PER\n")
  ex = labeled.read_examples(tmp_path / "c.conll", "token_classification")
  assert [(e.tokens, e.tags) for e in ex] == [(["EU", "rejects"], ["B-ORG", "O"]),
                                              (["Peter"], ["B-PER"])]
  assert labeled.label_vocabulary(ex, "token_classification") == ["O", "B-ORG", "B-PER"]
  assert labeled.label_vocabulary([labeled.Example("", label=x) for x in "10 2 1".split()],
                                  "classification") == ["1", "2", "10"]


def test_reader_errors_name_file_and_line(tmp_path):
  bad_tsv = tmp_path / "bad.tsv"
  bad_tsv.write_text("sentence1\tsentence2\tlabel\na\tb\t1\nonly one field\n")
  with pytest.raises(CorpusError, match=r"bad\.tsv:3: .*label"):
    labeled.read_examples(bad_tsv, "classification", labeled.Columns("sentence1", "sentence2"))
  with pytest.raises(CorpusError, match=r"bad\.tsv:1: no column 'premise'.*sentence1"):
    labeled.read_examples(bad_tsv, "classification", labeled.Columns("premise"))
  bad_csv = tmp_path / "bad.csv"
  bad_csv.write_text("s,label\nx,0.5\ny,high\n")
  with pytest.raises(CorpusError, match=r"bad\.csv:3: regression label 'high'"):
    labeled.read_examples(bad_csv, "regression", labeled.Columns("s"))
  bad_json = tmp_path / "bad.jsonl"
  bad_json.write_text('{"sentence": "a", "label": "x"}\n{"sentence": "b", "label": \n')
  with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not valid JSON"):
    labeled.read_examples(bad_json, "classification")
  bad_json.write_text('{"sentence": "a", "label": "x"}\n\n{"text": "b", "label": "y"}\n')
  with pytest.raises(CorpusError, match=r"bad\.jsonl:3: no field 'sentence'"):
    labeled.read_examples(bad_json, "classification")
  bad_tags = tmp_path / "tags.jsonl"
  bad_tags.write_text('{"tokens": ["a", "b"], "tags": ["O"]}\n')
  with pytest.raises(CorpusError, match=r"tags\.jsonl:1: .*one tag per token"):
    labeled.read_examples(bad_tags, "token_classification")
  # A dev label absent from the training labels.
  dev = tmp_path / "dev.tsv"
  dev.write_text("sentence\tlabel\nfine\t1\nodd\tmaybe\n")
  examples = labeled.read_examples(dev, "classification")
  with pytest.raises(CorpusError, match=r"dev\.tsv:3: label 'maybe' does not occur"):
    labeled.label_ids(examples, ["0", "1"], "classification")


# --- initial weights and Hugging Face export ---------------------------------------------

def _perturbed(tree, seed=0):
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                      .astype(np.float32), tree)


@pytest.mark.parametrize("task,num_labels", [("classification", 3), ("regression", 1),
                                             ("token_classification", 5)])
def test_hf_export_logits_equal(tmp_path, task, num_labels):
  import hf_models
  from bertjax import hf
  transformers = hf_models.transformers
  cfg = ModelConfig(family="bert", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    mlp_dim=48, max_positions=16, num_labels=num_labels)
  model = build_model(cfg, TASKS[task].head)
  params = _perturbed(jit_init(model)(jax.random.key(0)))
  head = "token_classification" if task == "token_classification" else "sequence_classification"
  labels = [f"L{i}" for i in range(num_labels)]
  hf.export_hf(params, cfg, tmp_path, head=head, labels=labels)
  cls = (transformers.BertForTokenClassification if head == "token_classification"
         else transformers.BertForSequenceClassification)
  theirs_model = cls.from_pretrained(tmp_path).eval()
  assert theirs_model.config.id2label == dict(enumerate(labels))
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size, length=10)
  theirs = hf_models.run(theirs_model, input_ids=ids, token_type_ids=types,
                         attention_mask=mask).logits.numpy()
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask)))
  if task == "token_classification":
    for b, n in enumerate(lengths):
      assert np.abs(ours[b, :n] - theirs[b, :n]).max() <= 1e-5
  else:
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1e-5


def test_hf_export_question_answering_logits_equal(tmp_path):
  """The span head exports as BertForQuestionAnswering (no pooler, `qa_outputs`): start and
  end logits equal ours, and the directory imports back with the span head left out."""
  import hf_models
  from bertjax import hf
  cfg = ModelConfig(family="bert", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                    mlp_dim=48, max_positions=16)
  model = build_model(cfg, "question_answering")
  params = _perturbed(jit_init(model)(jax.random.key(0)))
  hf.export_hf(params, cfg, tmp_path, head="question_answering")
  theirs_model = hf_models.transformers.BertForQuestionAnswering.from_pretrained(tmp_path).eval()
  ids, types, mask, lengths = hf_models.batch(cfg.vocab_size, length=10)
  out = hf_models.run(theirs_model, input_ids=ids, token_type_ids=types, attention_mask=mask)
  ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids), jnp.asarray(types),
                                jnp.asarray(mask)))
  for b, n in enumerate(lengths):
    assert np.abs(ours[b, :n, 0] - out.start_logits.numpy()[b, :n]).max() <= 1e-5
    assert np.abs(ours[b, :n, 1] - out.end_logits.numpy()[b, :n]).max() <= 1e-5
  encoder = weights_lib.load_weights(tmp_path)
  assert set(encoder.params) == {"bert"}
  np.testing.assert_array_equal(
      np.asarray(encoder.params["bert"]["word_embeddings"]["embedding"]),
      np.asarray(params["bert"]["word_embeddings"]["embedding"]))


def test_question_answering_loss_is_the_mean_of_start_and_end_cross_entropy():
  """objectives.Finetuning's span loss against a hand computation from the logits:
  (CE(start) + CE(end)) / 2 averaged over the batch, as Hugging Face's model."""
  cfg = ModelConfig(family="bert", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                    mlp_dim=48, max_positions=16, hidden_dropout=0.0, attention_dropout=0.0)
  model = build_model(cfg, "question_answering")
  objective = objectives.build_objective("question_answering", model)
  params = _perturbed(jit_init(model)(jax.random.key(1)))
  rng = np.random.RandomState(0)
  batch = {"input_ids": rng.randint(5, 64, (3, 12)).astype(np.int32),
           "token_type_ids": np.zeros((3, 12), np.int32),
           "attention_mask": np.ones((3, 12), np.int32),
           "start_positions": np.array([0, 4, 7], np.int32),
           "end_positions": np.array([0, 6, 7], np.int32)}
  loss, _ = objective(params, batch, objective.normalizers(batch), None)
  logits = np.asarray(objective.predict(params, batch), np.float64)
  log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  rows = np.arange(3)
  expected = -0.5 * (log_p[rows, batch["start_positions"], 0]
                     + log_p[rows, batch["end_positions"], 1]).mean()
  assert abs(float(loss) - expected) <= 1e-5


@pytest.mark.slow
def test_init_from_hf_directory_keeps_the_encoder(tmp_path):
  import hf_models
  ref = hf_models.bert(tmp_path / "ref", cls=hf_models.transformers.BertForSequenceClassification,
                       vocab_size=40, hidden_size=32, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=32)
  (tmp_path / "ref" / "vocab.txt").write_text(_vocab(tmp_path).read_text())
  encoder = weights_lib.load_weights(tmp_path / "ref")  # the checkpoint's classifier is dropped
  assert encoder.tokenizer == tmp_path / "ref" and "classifier" not in encoder.params
  hf_word = ref.bert.embeddings.word_embeddings.weight.detach().numpy()
  np.testing.assert_array_equal(encoder.params["bert"]["word_embeddings"]["embedding"], hf_word)
  _pair_task(tmp_path / "train.tsv", 32, seed=1)
  spec = _spec(epochs=1, freeze="all_but_head")
  result = _finetune(spec, tmp_path / "ref", tmp_path / "train.tsv", tmp_path / "train.tsv",
                       tmp_path / "out")
  tuned, _, _ = load_finetuned(result["best_dir"])
  np.testing.assert_array_equal(np.asarray(tuned["bert"]["word_embeddings"]["embedding"]),
                                hf_word)
  # A fine-tuned directory is itself a valid starting point.
  again = weights_lib.load_weights(result["best_dir"])
  assert again.source.startswith("fine-tuned") and again.tokenizer is not None


@pytest.mark.slow
def test_init_from_a_training_workdir(tmp_path):
  import train_helpers
  from bertjax.training import loop
  config = train_helpers.tiny_config("bert", num_train_steps=2, **{"checkpoint.every": 2})
  loop.train_and_evaluate(config, tmp_path / "run")
  encoder = weights_lib.load_weights(tmp_path / "run")
  assert encoder.source.endswith("step 2")
  final, _ = checkpoint.load_params(tmp_path / "run" / "params")
  for name, value in _flat(final).items():
    np.testing.assert_array_equal(_flat(encoder.params)[name], value, err_msg=name)
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 32, seed=1)
  result = _finetune(_spec(epochs=1, tokenizer=str(vocab), freeze="bottom:2"),
                       tmp_path / "run", tmp_path / "train.tsv", tmp_path / "train.tsv",
                       tmp_path / "out")
  assert result["steps"] == 1


@pytest.mark.slow
def test_same_result_on_a_3d_mesh(tmp_path):
  """Data parallel (8,1,1) vs data x fsdp x tensor (2,2,2): the same parameters after training."""
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 64, seed=1)
  cfg = _tiny(len(vocab.read_text().split()))
  tuned = []
  for axes in ((8, 1, 1), (2, 2, 2)):
    out = tmp_path / "x".join(map(str, axes))
    result = _finetune(_spec(model=cfg, tokenizer=str(vocab), epochs=1), None,
                         tmp_path / "train.tsv", tmp_path / "train.tsv", out,
                         mesh=dict(zip(("data", "fsdp", "tensor"), axes)))
    tuned.append(_flat(load_finetuned(result["best_dir"])[0]))
  assert tuned[0].keys() == tuned[1].keys()
  for name in tuned[0]:
    np.testing.assert_allclose(tuned[0][name], tuned[1][name], atol=2e-5, err_msg=name)


@pytest.mark.slow
def test_gradient_accumulation_in_a_finetune_is_the_same_update(tmp_path):
  """A fine-tune is a run of the one loop, micro-batches included: 4 micro-batches per step
  give the parameters of whole batches (dropout off; the objectives normalise over the global
  batch)."""
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 64, seed=1)
  cfg = _tiny(len(vocab.read_text().split()))
  tuned = []
  for accum in (1, 4):
    result = _finetune(_spec(model=cfg, tokenizer=str(vocab), epochs=1), None,
                       tmp_path / "train.tsv", tmp_path / "train.tsv", tmp_path / f"a{accum}",
                       grad_accum_steps=accum)
    tuned.append(_flat(load_finetuned(result["best_dir"])[0]))
    assert json.loads((tmp_path / f"a{accum}" / "config.json").read_text())[
        "grad_accum_steps"] == accum
  for name in tuned[0]:
    np.testing.assert_allclose(tuned[0][name], tuned[1][name], atol=2e-5, err_msg=name)


@pytest.mark.slow
def test_a_finished_finetune_started_again_or_continued(tmp_path, capsys):
  """The same command again: the summary, nothing trained. More epochs: refused as a change of
  what the run computes (the schedule), unless asked; then it continues from its last
  checkpoint and its outputs are written again for the longer run."""
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 32, seed=1)
  cfg = _tiny(len(vocab.read_text().split()))
  spec = _spec(model=cfg, tokenizer=str(vocab), epochs=1, batch_size=16)
  data = (None, tmp_path / "train.tsv", tmp_path / "train.tsv", tmp_path / "out")
  first = _finetune(spec, *data)
  assert first["steps"] == 2 and len(first["history"]) == 1
  assert _finetune(spec, *data) == first
  with pytest.raises(ValueError, match="in what the run computes: finetune.epochs: 1.0 -> 2.0"):
    _finetune({**spec, "epochs": 2}, *data)
  longer = _finetune({**spec, "epochs": 2}, *data, resume_with_changes=True)
  assert longer["steps"] == 4 and [h["step"] for h in longer["history"]] == [2, 4]
  saved = json.loads((tmp_path / "out" / "finetune_summary.json").read_text())
  assert saved["steps"] == 4 and saved["history"] == longer["history"]
  assert "dev step 4/4 | epoch 2.0000 | accuracy" in capsys.readouterr().out  # scores shown
  # Exports asked for after the end: written, nothing trained again.
  exported = _finetune({**spec, "epochs": 2, "export_hf": True}, *data)
  assert exported["hf_dir"] and (tmp_path / "out" / "hf" / "config.json").exists()
  assert exported["history"] == longer["history"]
  # The fine-tune's directory holds its task's head: weights to start from, not to export.
  assert "classifier" in weights_lib.load_weights(tmp_path / "out").params
  from bertjax import cli
  assert cli.main(["export", "--workdir", str(tmp_path / "out"), "--out",
                   str(tmp_path / "x")]) == 2
  assert "export its best parameters, --params" in capsys.readouterr().err


def test_finetune_settings_that_cannot_work_are_refused_before_training(tmp_path):
  """A dev batch the mesh cannot split, and an OUT holding another run's outputs but no
  checkpoint: one-line errors at start-up (the old runner found the first at the first
  evaluation and overwrote nothing)."""
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 16, seed=1)
  spec = _spec(model=_tiny(len(vocab.read_text().split())), tokenizer=str(vocab), epochs=1,
               batch_size=16)
  data = (None, tmp_path / "train.tsv", tmp_path / "train.tsv")
  with pytest.raises(ValueError, match="finetune.eval_batch_size: batch_size=3"):
    _finetune({**spec, "eval_batch_size": 3}, *data, tmp_path / "a")
  (tmp_path / "b" / "best").mkdir(parents=True)
  with pytest.raises(FileExistsError, match="holds no checkpoint to resume"):
    _finetune(spec, *data, tmp_path / "b")


@pytest.mark.slow
def test_finetune_command_from_a_params_checkpoint(tmp_path, capsys):
  from bertjax import cli
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 64, seed=1)
  _pair_task(tmp_path / "dev.tsv", 32, seed=2)
  cfg = _tiny(len(vocab.read_text().split()))
  checkpoint.save_params(tmp_path / "pre", jit_init(build_model(cfg))(jax.random.key(0)), cfg)
  assert cli.main(["finetune", "--init-from", str(tmp_path / "pre"), "--train",
                   str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"), "--out",
                   str(tmp_path / "out"), "--text-a", "sentence1", "--text-b", "sentence2",
                   "--tokenizer", str(vocab), "--epochs", "1", "--batch-size", "16",
                   "--seq-length", "16", "--freeze", "embeddings", "--mesh", "data=4,fsdp=2",
                   "--lowercase"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["metric"] == "accuracy" and result["steps"] == 4
  assert (tmp_path / "out" / "best" / "model.json").exists()
  assert cli.main(["finetune", "--init-from", str(tmp_path / "pre"), "--train", "x", "--dev",
                   "y", "--out", str(tmp_path / "o2"), "--freeze", "top:3"]) == 2
  assert "freeze" in capsys.readouterr().err


@pytest.mark.slow
def test_bertjax_train_with_a_finetune_config_is_the_same_run(tmp_path, capsys):
  """`bertjax finetune` is a front of the training loop: `bertjax train --config
  configs/finetune.py:recipe=glue` with the same keys as `--config.*` gives the same best
  parameters and evaluations."""
  from bertjax import cli
  vocab = _vocab(tmp_path)
  _pair_task(tmp_path / "train.tsv", 48, seed=1)
  cfg = _tiny(len(vocab.read_text().split()))
  checkpoint.save_params(tmp_path / "pre", jit_init(build_model(cfg))(jax.random.key(0)), cfg)
  data = [str(tmp_path / "pre"), str(tmp_path / "train.tsv"), str(tmp_path / "train.tsv")]
  assert cli.main(["finetune", "--recipe", "glue", "--init-from", data[0], "--train", data[1],
                   "--dev", data[2], "--out", str(tmp_path / "front"), "--text-a", "sentence1",
                   "--text-b", "sentence2", "--tokenizer", str(vocab), "--epochs", "2",
                   "--batch-size", "16", "--seq-length", "16", "--learning-rate", "1e-3"]) == 0
  assert cli.main(["train", "--config", "finetune:recipe=glue", "--workdir",
                   str(tmp_path / "train"), f"--config.init_from={data[0]}",
                   f"--config.finetune.train={data[1]}", f"--config.finetune.dev={data[2]}",
                   "--config.finetune.text_a=sentence1", "--config.finetune.text_b=sentence2",
                   f"--config.finetune.tokenizer={vocab}", "--config.finetune.epochs=2",
                   "--config.batch_size=16", "--config.seq_length=16",
                   "--config.optimizer.learning_rate=1e-3"]) == 0
  out = capsys.readouterr().out
  assert "best dev accuracy" in out and f"best parameters {tmp_path / 'train' / 'best'}" in out
  summaries = [json.loads((tmp_path / d / "finetune_summary.json").read_text())
               for d in ("front", "train")]
  for s in summaries:
    s["history"] = [{k: v for k, v in h.items() if k != "elapsed_s"} for h in s["history"]]
    s.pop("best_dir")
  assert summaries[0] == summaries[1]
  front = _flat(load_finetuned(tmp_path / "front" / "best")[0])
  train = _flat(load_finetuned(tmp_path / "train" / "best")[0])
  for name, value in front.items():
    np.testing.assert_array_equal(train[name], value, err_msg=name)


def test_article_task_from_the_embedded_corpus(tmp_path, capsys):
  from bertjax import cli
  assert cli.main(["data", "task", "--out", str(tmp_path), "--train-sizes", "40", "200",
                   "--dev-per-article", "20"]) == 0
  summary = json.loads(capsys.readouterr().out)
  assert len(summary["articles"]) == 4
  dev = labeled.read_examples(tmp_path / "dev.tsv", "classification")
  small = labeled.read_examples(tmp_path / "train_40.tsv", "classification")
  large = labeled.read_examples(tmp_path / "train_200.tsv", "classification")
  assert len(dev) == 80 and len(small) == 40 and len(large) == 200
  for examples, per in ((dev, 20), (small, 10), (large, 50)):
    counts = {}
    for e in examples:
      counts[e.label] = counts.get(e.label, 0) + 1
    assert sorted(counts) == ["0", "1", "2", "3"] and set(counts.values()) == {per}
  texts = lambda xs: {e.text_a for e in xs}  # noqa: E731
  assert texts(small) <= texts(large) and not texts(large) & texts(dev)


def test_recipe_note_for_small_models_at_the_paper_rate():
  """BERT-base's 2e-5 leaves the README's tiny BERT at chance: the run says what to try."""
  note = ft.recipe_note(2e-5, hidden_size=128)
  assert note and "--learning-rate 1e-3" in note and "128-wide" in note
  assert ft.recipe_note(1e-3, hidden_size=128) is None
  assert ft.recipe_note(2e-5, hidden_size=768) is None
