"""`bertjax data glue` and `bertjax eval glue|squad` (bertjax.finetune.suites, glue_task): the
nine GLUE tasks in GLUE's own file formats, each task's metrics against hand computations, the
selection rules, GLUE end to end on two tasks with two seeds (resumed, then re-ruled), and
SQuAD v1.1 and v2.0 by their file names."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from bertjax import cli
from bertjax.finetune import labeled, scores, suites
from bertjax.finetune.glue_task import make_glue_tasks


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("glue")
  make_glue_tasks("embedded", out, train_size=64, dev_size=32, seed=0)
  return out


# What each task's label column holds, as GLUE spells it.
LABELS = {"cola": {"0", "1"}, "sst2": {"0", "1"}, "mrpc": {"0", "1"}, "qqp": {"0", "1"},
          "mnli": {"entailment", "neutral", "contradiction"},
          "qnli": {"entailment", "not_entailment"}, "rte": {"entailment", "not_entailment"},
          "wnli": {"0", "1"}}


def test_the_suite_writes_every_task_in_glues_format(glue_dir):
  """Each task's files sit where GLUE puts them and read through the task's own columns (CoLA
  without a header: label in column 1, sentence in 3), with GLUE's label spellings."""
  assert [p.name for p in sorted(glue_dir.iterdir()) if p.is_dir()] == sorted(
      t.directory for t in suites.GLUE.values())
  cola = (glue_dir / "CoLA" / "train.tsv").read_text().splitlines()[0].split("\t")
  assert len(cola) == 4 and cola[0] == "gj04" and cola[1] in ("0", "1")  # no header row
  assert (glue_dir / "MRPC" / "train.tsv").read_text().startswith(
      "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
  for task in suites.GLUE.values():
    columns = labeled.Columns(task.text_a, task.text_b or None, task.label, "tokens", "tags")
    for split, path in task.files(glue_dir).items():
      examples = labeled.read_examples(path, task.kind, columns, header=task.header)
      assert len(examples) == (64 if split == "train" else 32), (task.name, split)
      if task.kind == "regression":
        assert all(0.0 <= e.label <= 5.0 for e in examples)
        assert len({e.label for e in examples}) > 10
      else:
        assert {str(e.label) for e in examples} == LABELS[task.name], (task.name, split)
  # Dev never shares an article with train: no dev sentence of MNLI occurs in its train file.
  train_text = (glue_dir / "MNLI" / "train.tsv").read_text()
  dev = labeled.read_examples(glue_dir / "MNLI" / "dev_mismatched.tsv", "classification",
                              labeled.Columns("sentence1", "sentence2", "gold_label"))
  assert not any(e.text_a in train_text for e in dev)


def _mcc(t, p):
  tp = np.sum((t == 1) & (p == 1)); tn = np.sum((t == 0) & (p == 0))  # noqa: E702
  fp = np.sum((t == 0) & (p == 1)); fn = np.sum((t == 1) & (p == 0))  # noqa: E702
  return (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))


def _f1(t, p):
  tp = np.sum((t == 1) & (p == 1))
  return 2 * tp / (2 * tp + np.sum((t == 0) & (p == 1)) + np.sum((t == 1) & (p == 0)))


@pytest.mark.parametrize("name", list(suites.GLUE))
def test_each_tasks_metrics_equal_a_hand_computation(name):
  task = suites.GLUE[name]
  rng = np.random.default_rng(len(name))
  if task.kind == "regression":
    gold = rng.uniform(0, 5, 50)
    pred = gold + rng.normal(0, 1, 50)
    got = scores.task_scores("regression", gold, pred)
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731 (no ties in continuous draws)
    want = {"pearson": np.corrcoef(gold, pred)[0, 1],
            "spearman": np.corrcoef(rank(gold), rank(pred))[0, 1]}
  else:
    classes = len(LABELS[name])
    gold = rng.integers(0, classes, 60)
    pred = np.where(rng.random(60) < 0.7, gold, rng.integers(0, classes, 60))
    got = scores.task_scores("classification", gold, pred, sorted(LABELS[name]))
    want = {"accuracy": np.mean(gold == pred)}
    if classes == 2:
      want.update(matthews=_mcc(gold, pred), f1=_f1(gold, pred))
  for metric in task.metrics:
    assert got[metric] == pytest.approx(float(want[metric]), rel=1e-9, abs=1e-12), metric


def test_the_rules_combine_each_metric_over_the_seeds():
  mrpc, mnli = suites.GLUE["mrpc"], suites.GLUE["mnli"]
  seeds = {0: {"f1": 0.8, "accuracy": 0.7}, 1: {"f1": 0.9, "accuracy": 0.6},
           2: {"f1": 0.85, "accuracy": 0.75}}
  median = suites.task_result(mrpc, seeds, "median")
  assert median["scores"] == {"f1": 0.85, "accuracy": 0.7}  # each metric on its own
  assert median["task_score"] == pytest.approx(0.775)
  assert suites.task_result(mrpc, seeds, "best")["scores"] == {"f1": 0.9, "accuracy": 0.75}
  assert suites.task_result(mrpc, seeds, "mean")["scores"]["f1"] == pytest.approx(0.85)
  two = {0: {"accuracy": 0.5, "second_accuracy": 0.4}, 1: {"accuracy": 0.7,
                                                          "second_accuracy": 0.6}}
  result = suites.task_result(mnli, two, "median")  # even count: the mean of the middle two
  assert result["scores"] == {"accuracy": pytest.approx(0.6), "second_accuracy":
                              pytest.approx(0.5)}
  lines = suites.table([median, result])
  assert any(line.startswith("mnli   mismatched accuracy") for line in lines)
  assert lines[-1].endswith(f"{statistics.fmean([0.775, 0.55]):.4f}")


def test_a_seeds_score_is_its_best_evaluation():
  summary = {"best_step": 20, "history": [
      {"step": 10, "dev_accuracy": 0.5, "dev_f1": 0.9},
      {"step": 20, "dev_accuracy": 0.8, "dev_f1": 0.7}, {"step": 30, "dev_accuracy": 0.6}]}
  assert suites.seed_scores(summary) == {"accuracy": 0.8, "f1": 0.7}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
  """A random 1-layer BERT (params checkpoint) and a SentencePiece of the embedded corpus."""
  from bertjax.data.prepare import corpus_sentences
  from bertjax.data.sources import parse_sources
  from bertjax.data.sentencepiece_training import train_sentencepiece
  root = tmp_path_factory.mktemp("tiny_bert")
  spm = train_sentencepiece(corpus_sentences(parse_sources("embedded")), root / "spm",
                            vocab_size=400, model_type="unigram", style="bert")
  params = root / "init"
  assert cli.main(["init", "--config", "bert_tiny", "--out", str(params),
                   "--config.model.vocab_size=400", "--config.model.hidden_size=32",
                   "--config.model.num_heads=2", "--config.model.mlp_dim=64",
                   "--config.model.num_layers=1", "--config.model.max_positions=64",
                   "--config.seq_length=64"]) == 0
  return params, spm


@pytest.mark.slow
def test_eval_glue_runs_the_tasks_and_seeds_and_follows_the_rule(glue_dir, tiny_bert, tmp_path,
                                                                 capsys):
  """STS-B and MNLI (regression; matched and mismatched), two seeds each, one epoch from a
  random tiny BERT: the table and JSON hold every seed's best-epoch dev scores (what each fine-tune's own summary says) and
  the median of them; the same command again finishes at once (the runs are done) and
  --rule best re-rules them."""
  params, spm = tiny_bert
  out = tmp_path / "eval"
  command = ["eval", "glue", "--init-from", str(params), "--data", str(glue_dir), "--out",
             str(out), "--tasks", "mnli,stsb", "--seeds", "3,7", "--epochs", "1",
             "--batch-size", "16", "--seq-length", "32", "--learning-rate", "1e-3",
             "--tokenizer", str(spm)]
  capsys.readouterr()
  assert cli.main(command) == 0
  printed = capsys.readouterr().out
  results = json.loads((out / "glue_results.json").read_text())
  assert [t["task"] for t in results["tasks"]] == ["stsb", "mnli"]  # GLUE's order
  for task in results["tasks"]:
    assert list(task["seeds"]) == ["3", "7"]
    for seed, values in task["seeds"].items():
      summary = json.loads((out / task["task"] / f"seed_{seed}" /
                            "finetune_summary.json").read_text())
      assert summary["metric"] == suites.GLUE[task["task"]].metrics[0]
      best = [h for h in summary["history"] if h["step"] == summary["best_step"]][0]
      for metric in task["metrics"]:
        assert values[metric] == best[f"dev_{metric}"]
    for metric in task["metrics"]:
      assert task["scores"][metric] == pytest.approx(
          statistics.median(v[metric] for v in task["seeds"].values()))
  assert results["tasks"][1]["metrics"] == ["accuracy", "second_accuracy"]
  assert results["tasks"][0]["metrics"] == ["pearson", "spearman"]
  assert "mnli   mismatched accuracy" in printed and "average of the 2 task score(s)" in printed

  # Again, ruled by the best seed: nothing trains again (each run is finished).
  logs = {p: p.read_text() for p in out.glob("*/seed_*/metrics.jsonl")}
  assert len(logs) == 4
  assert cli.main(command + ["--rule", "best"]) == 0
  assert {p: p.read_text() for p in logs} == logs
  best = json.loads((out / "glue_results.json").read_text())
  for task in best["tasks"]:
    for metric in task["metrics"]:
      assert task["scores"][metric] == max(v[metric] for v in task["seeds"].values())


@pytest.mark.slow
def test_eval_squad_runs_v1_and_v2_by_their_file_names(tiny_bert, tmp_path, capsys):
  """SQuAD v1.1 and v2.0 files as `bertjax data qa-task` (and SQuAD's site) name them, one seed:
  F1 and exact match of each seed's best epoch, as its fine-tune's summary has them."""
  from bertjax.finetune.qa_task import make_qa_task
  params, spm = tiny_bert
  data = tmp_path / "qa"
  make_qa_task("embedded", data, num_train=48, num_dev=24)
  out = tmp_path / "eval"
  assert cli.main(["eval", "squad", "--init-from", str(params), "--data", str(data), "--out",
                   str(out), "--seeds", "5", "--epochs", "1", "--batch-size", "16",
                   "--seq-length", "64", "--doc-stride", "32", "--max-query-length", "16",
                   "--learning-rate", "1e-3", "--tokenizer", str(spm)]) == 0
  results = json.loads((out / "squad_results.json").read_text())
  assert [t["task"] for t in results["tasks"]] == ["squad1.1", "squad2.0"]
  for task in results["tasks"]:
    assert task["metrics"] == ["f1", "exact_match"]
    summary = json.loads((out / task["task"] / "seed_5" / "finetune_summary.json").read_text())
    best = [h for h in summary["history"] if h["step"] == summary["best_step"]][0]
    assert task["seeds"]["5"]["f1"] == best["dev_f1"] == task["scores"]["f1"]
    assert task["scores"]["exact_match"] == best["dev_exact_match"]
  assert "NoAns_f1" in results["tasks"][1]["seeds"]["5"]  # v2.0's unanswerable split


def test_eval_glue_refuses_what_it_cannot_run(glue_dir, tmp_path, capsys):
  base = ["eval", "glue", "--init-from", str(tmp_path / "none"), "--out", str(tmp_path / "o")]
  assert cli.main(base + ["--data", str(glue_dir), "--text-a", "x"]) == 2
  assert "--text-a is set by each task" in capsys.readouterr().err
  assert cli.main(base + ["--data", str(glue_dir), "--tasks", "cola,squad"]) == 2
  assert "unknown glue task(s) squad" in capsys.readouterr().err
  assert cli.main(base + ["--data", str(tmp_path)]) == 2
  assert "no glue task's files found (cola:" in capsys.readouterr().err
  assert cli.main(base + ["--data", str(glue_dir), "--rule", "max"]) == 2
  assert "--rule must be one of median, best, mean" in capsys.readouterr().err
  assert cli.main(base + ["--data", str(glue_dir), "--seeds", "1,x"]) == 2
  assert "--seeds: expected seeds like 0,1,2" in capsys.readouterr().err
