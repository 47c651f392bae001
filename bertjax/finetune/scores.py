"""Dev-set scores of fine-tuning tasks: accuracy, binary F1, Matthews correlation (CoLA), Pearson
and Spearman (STS-B), and entity-level F1 over BIO spans (NER), as GLUE and CoNLL score them;
SQuAD's exact match and F1."""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Sequence

import numpy as np

from bertjax.finetune.labeled import IGNORE


def accuracy(labels: np.ndarray, preds: np.ndarray) -> float:
  labels, preds = np.asarray(labels), np.asarray(preds)
  return float(np.mean(labels == preds)) if labels.size else 0.0


def f1_binary(labels: np.ndarray, preds: np.ndarray, positive: int = 1) -> float:
  """F1 of the positive class (GLUE's MRPC/QQP F1); 0 when it is never predicted nor true."""
  labels, preds = np.asarray(labels), np.asarray(preds)
  tp = np.sum((preds == positive) & (labels == positive))
  fp = np.sum((preds == positive) & (labels != positive))
  fn = np.sum((preds != positive) & (labels == positive))
  return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def matthews(labels: np.ndarray, preds: np.ndarray) -> float:
  """Matthews correlation (CoLA), the multi-class R_K form (= sklearn's matthews_corrcoef);
  0 when undefined (a constant prediction or label)."""
  labels, preds = np.asarray(labels), np.asarray(preds)
  classes = np.union1d(labels, preds)
  idx = {c: i for i, c in enumerate(classes)}
  conf = np.zeros((len(classes), len(classes)), np.float64)
  for t, p in zip(labels, preds):
    conf[idx[t], idx[p]] += 1
  t_sum, p_sum = conf.sum(1), conf.sum(0)
  n, correct = conf.sum(), np.trace(conf)
  cov_ytyp = correct * n - np.dot(t_sum, p_sum)
  cov_ypyp = n * n - np.dot(p_sum, p_sum)
  cov_ytyt = n * n - np.dot(t_sum, t_sum)
  denom = math.sqrt(cov_ytyt * cov_ypyp)
  return float(cov_ytyp / denom) if denom else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  x, y = x - x.mean(), y - y.mean()
  denom = math.sqrt(float(np.dot(x, x) * np.dot(y, y)))
  return float(np.dot(x, y) / denom) if denom else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n with ties given their average rank (scipy.stats.rankdata's default)."""
  x = np.asarray(x, np.float64)
  order = np.argsort(x, kind="mergesort")
  sorted_x = x[order]
  ranks = np.empty(len(x), np.float64)
  i = 0
  while i < len(x):
    j = i
    while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
      j += 1
    ranks[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
  """Spearman's rho: Pearson correlation of the (tie-averaged) ranks."""
  return pearson(_ranks(x), _ranks(y))


def bio_spans(tags: Sequence[str]) -> set[tuple[str, int, int]]:
  """(type, start, end) chunks of a BIO/IOB2 tag sequence, conlleval's rules: a chunk starts at
  B-X, or at I-X after anything but a chunk of type X; plain tags (no "-") are one-word
  chunks of their own type, "O" is outside."""
  spans = set()
  kind, start = None, 0
  for i, tag in enumerate(list(tags) + ["O"]):
    prefix, _, typ = tag.partition("-") if "-" in tag else ("B" if tag != "O" else "O", "", tag)
    begins = prefix == "B" or prefix == "S" or (prefix in ("I", "E") and kind != typ)
    if kind is not None and (tag == "O" or begins):
      spans.add((kind, start, i))
      kind = None
    if tag != "O" and begins:
      kind, start = typ, i
  return spans


def entity_f1(true_tags: Sequence[Sequence[str]], pred_tags: Sequence[Sequence[str]]
              ) -> dict[str, float]:
  """Micro entity precision/recall/F1 over all sentences (seqeval/conlleval style)."""
  tp = n_pred = n_true = 0
  for t, p in zip(true_tags, pred_tags):
    ts, ps = bio_spans(t), bio_spans(p)
    tp += len(ts & ps)
    n_pred += len(ps)
    n_true += len(ts)
  precision = tp / n_pred if n_pred else 0.0
  recall = tp / n_true if n_true else 0.0
  f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
  return {"precision": precision, "recall": recall, "f1": f1}


def task_scores(task: str, labels: np.ndarray, preds: np.ndarray,
                 label_names: Sequence[str] = ()) -> dict[str, float]:
  """The metrics a task reports, from gold labels and predictions (host numpy arrays).
  Token classification: [N, L] arrays with labeled.IGNORE where no word starts."""
  if task == "classification":
    out = {"accuracy": accuracy(labels, preds), "matthews": matthews(labels, preds)}
    if len(label_names) == 2:
      out["f1"] = f1_binary(labels, preds)
    return out
  if task == "regression":
    preds, labels = np.asarray(preds, np.float64), np.asarray(labels, np.float64)
    return {"pearson": pearson(preds, labels), "spearman": spearman(preds, labels),
            "mse": float(np.mean((preds - labels) ** 2))}
  keep = labels != IGNORE
  true_tags = [[label_names[t] for t in row[k]] for row, k in zip(labels, keep)]
  pred_tags = [[label_names[p] for p in row[k]] for row, k in zip(preds, keep)]
  return {**entity_f1(true_tags, pred_tags), "accuracy": accuracy(labels[keep], preds[keep])}


# --- SQuAD ------------------------------------------------------------------------------------
# The official evaluation scripts (evaluate-v1.1.py, evaluate-v2.0.py), with one difference: a
# question without a prediction scores 0 under both (v2.0's script cannot score that case).

def _squad_normalize(text: str) -> str:
  """Lower case, no punctuation, no articles (a, an, the), single spaces."""
  punctuation = set(string.punctuation)
  text = "".join(c for c in text.lower() if c not in punctuation)
  return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _squad_f1(prediction: str, gold: str, version_2: bool) -> float:
  pred, true = _squad_normalize(prediction).split(), _squad_normalize(gold).split()
  if version_2 and (not pred or not true):
    return float(pred == true)  # v2.0: an empty answer matches only an empty one
  same = sum((collections.Counter(pred) & collections.Counter(true)).values())
  if not same:
    return 0.0
  precision, recall = same / len(pred), same / len(true)
  return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], examples: Sequence,
                 version: str | None = None) -> dict[str, float]:
  """exact_match and f1 in percent (each the best over a question's gold answers), as the
  official SQuAD scripts score them; `examples` are bertjax.finetune.squad.QAExample. `version`
  "1.1" or "2.0" (default: "2.0" when any question is unanswerable). v2.0: gold answers that
  normalise to nothing are dropped and an unanswerable question's gold is [""]; adds the
  HasAns_ / NoAns_ splits (exact, f1, total)."""
  if version is None:
    version = "2.0" if any(ex.is_impossible for ex in examples) else "1.1"
  if version not in ("1.1", "2.0"):
    raise ValueError(f"SQuAD version must be '1.1' or '2.0', got {version!r}")
  v2 = version == "2.0"
  exact, f1, has_answer = [], [], []
  for ex in examples:
    golds = [text for text, _ in ex.answers]
    if v2:
      golds = [g for g in golds if _squad_normalize(g)] or [""]
    pred = predictions.get(ex.id)
    has_answer.append(bool(ex.answers))  # the script's split: answers listed, normalised or not
    if pred is None:
      exact.append(0.0)
      f1.append(0.0)
      continue
    exact.append(max(float(_squad_normalize(pred) == _squad_normalize(g)) for g in golds))
    f1.append(max(_squad_f1(pred, g, v2) for g in golds))
  def mean(values: list[float]) -> float:
    return 100.0 * sum(values) / len(values) if values else 0.0
  out = {"exact_match": mean(exact), "f1": mean(f1), "total": float(len(exact))}
  if v2:
    for name, keep in (("HasAns", True), ("NoAns", False)):
      picked = [i for i, h in enumerate(has_answer) if h == keep]
      out.update({f"{name}_exact": mean([exact[i] for i in picked]),
                  f"{name}_f1": mean([f1[i] for i in picked]), f"{name}_total": float(len(picked))})
  return out
