"""Extractive question answering (SQuAD v1.1 / v2.0): the JSON (`read_squad`), windowed features
(`build_features`) and answers (`postprocess`); guide: docs/finetuning.md, 'Extractive question
answering (SQuAD)'.

Features are google-research/bert run_squad.py's, `doc_stride` with its meaning: the step between
window starts (Hugging Face passes the same name as the tokenizer's `stride`, the overlap, window
length - doc_stride). Tokens come from the bertjax tokenizer's `tokenizers` pipeline
(`hf.tokenizer.fast_tokenizer`: bertjax's ids), whose character offsets map spans back to text.
`postprocess` decodes as transformers' (4.x) question-answering pipeline, except that spans of
probability 0 are dropped (the pipeline can list some when a window has fewer context tokens
than it asks for); `scoring="logits"` is run_squad's rule instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bertjax.data.errors import CorpusError
from bertjax.data.tokenizers import load_tokenizer
from bertjax.hf.tokenizer import fast_tokenizer


@dataclasses.dataclass
class QAExample:
  """One question on one context; answers are (text, character start in the context)."""

  id: str
  question: str
  context: str
  answers: list[tuple[str, int]] = dataclasses.field(default_factory=list)
  is_impossible: bool = False
  title: str = ""


def _field(record: Any, key: str, kind: type, where: str) -> Any:
  value = record.get(key) if isinstance(record, dict) else None
  if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
    problem = "missing" if value is None else f"not a {kind.__name__}: {value!r:.40}"
    raise CorpusError(f"{where}: field {key!r} {problem}")
  return value


def read_squad(path: str | Path) -> list[QAExample]:
  """The questions of a SQuAD v1.1 or v2.0 JSON file. CorpusError naming the file and the
  question id (or data[i].paragraphs[j]) for a missing field, an answer whose text is not at
  its answer_start, an answerable question without answers or a duplicate id."""
  path = Path(path)
  try:
    root = json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise CorpusError(f"{path}: line {e.lineno}: not JSON ({e.msg})") from None
  data = _field(root, "data", list, f"{path}")
  examples, seen = [], set()
  for i, article in enumerate(data):
    title = article.get("title", "") if isinstance(article, dict) else ""
    for j, para in enumerate(_field(article, "paragraphs", list, f"{path}: data[{i}]")):
      where = f"{path}: data[{i}].paragraphs[{j}]"
      context = _field(para, "context", str, where)
      for k, qa in enumerate(_field(para, "qas", list, where)):
        qid = _field(qa, "id", str, f"{where}.qas[{k}]")
        at = f"{path}: question {qid}"
        if qid in seen:
          raise CorpusError(f"{at}: id used twice")
        seen.add(qid)
        impossible = qa.get("is_impossible", False)
        if not isinstance(impossible, bool):
          raise CorpusError(f"{at}: field 'is_impossible' not a bool: {impossible!r:.40}")
        answers = []
        for a in _field(qa, "answers", list, at):
          text, start = _field(a, "text", str, at), _field(a, "answer_start", int, at)
          found = context[start:start + len(text)] if start >= 0 else ""
          if found != text:
            raise CorpusError(f"{at}: answer {text!r:.60} is not at answer_start {start} of "
                              f"the context (which has {found!r:.60} there)")
          answers.append((text, start))
        if impossible == bool(answers):
          raise CorpusError(f"{at}: " + ("is_impossible but has answers" if impossible else
                                         "no answers (and not is_impossible)"))
        examples.append(QAExample(qid, _field(qa, "question", str, at), context, answers,
                                  impossible, str(title)))
  return examples


def write_squad(examples: Sequence[QAExample], path: str | Path, version: str = "1.1") -> None:
  """SQuAD JSON: articles by title, paragraphs by context (in first-seen order). v1.1 has no
  is_impossible field and no room for unanswerable questions (ValueError)."""
  if version not in ("1.1", "2.0"):
    raise ValueError(f"SQuAD version must be '1.1' or '2.0', got {version!r}")
  articles: dict[str, dict[str, list]] = {}
  for ex in examples:
    if version == "1.1" and ex.is_impossible:
      raise ValueError(f"question {ex.id} is unanswerable: SQuAD v1.1 has no such questions")
    qa: dict[str, Any] = {"id": ex.id, "question": ex.question,
                          "answers": [{"text": t, "answer_start": s} for t, s in ex.answers]}
    if version == "2.0":
      qa["is_impossible"] = ex.is_impossible
    articles.setdefault(ex.title, {}).setdefault(ex.context, []).append(qa)
  data = [{"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paras.items()]}
          for title, paras in articles.items()]
  Path(path).write_text(json.dumps({"version": version, "data": data}, ensure_ascii=False,
                                   indent=1) + "\n", encoding="utf-8")


# --- features ---------------------------------------------------------------------------------

@dataclasses.dataclass
class QAFeatures:
  """Windows of examples, padded to one length L: model inputs and, per position, what
  decoding needs. Positions outside the context window hold -1 in the per-token arrays."""

  input_ids: np.ndarray  # [N, L] int32
  token_type_ids: np.ndarray  # [N, L] int32: 0 for [CLS] question [SEP], 1 after
  attention_mask: np.ndarray  # [N, L] int32
  start_positions: np.ndarray  # [N] int32: the answer's first token; 0 ([CLS]) if not inside
  end_positions: np.ndarray  # [N] int32
  example_index: np.ndarray  # [N] int32: which example a window belongs to
  token_index: np.ndarray  # [N, L] int32: index of the token in its context's tokens
  # [N, L, 2] int32: the token's characters [start, end) in the context (as the tokenizer
  # gives them: a SentencePiece "▁word" piece includes the space before the word).
  offsets: np.ndarray
  # [N, L, 2] int32: from its word's first to last token in this window (a word cut by the
  # window's edge aligns to its part inside, as the pipeline's word_to_chars does).
  word_chars: np.ndarray
  max_context: np.ndarray  # [N, L] bool: no other window gives the token more context

  def batch(self) -> dict[str, np.ndarray]:
    """The arrays the question_answering objective trains on."""
    return {k: getattr(self, k) for k in ("input_ids", "token_type_ids", "attention_mask",
                                          "start_positions", "end_positions")}

  def __len__(self) -> int:
    return len(self.input_ids)


def _fast_tokenizer(tokenizer: Any) -> Any:
  """A `tokenizers.Tokenizer` from one, from a loaded bertjax tokenizer or from its dir."""
  if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id"):
    return tokenizer
  if isinstance(tokenizer, (str, Path)):
    tokenizer = load_tokenizer(tokenizer)
  return fast_tokenizer(tokenizer)


def window_starts(num_tokens: int, window: int, doc_stride: int) -> list[int]:
  """First context token of each window (run_squad): `doc_stride` apart, the last one ending
  at the end of the context; one window for a context that fits."""
  starts = [0]
  while starts[-1] + window < num_tokens:
    starts.append(starts[-1] + min(window, doc_stride))
  return starts


def _answer_tokens(offsets: np.ndarray, ex: QAExample) -> tuple[int, int]:
  """First and last context token overlapping the first answer's characters; (-1, -1) for
  none (unanswerable, or an answer of white space only)."""
  if ex.is_impossible or not ex.answers or not len(offsets):
    return -1, -1
  text, start = ex.answers[0]
  inside = np.flatnonzero((offsets[:, 1] > start) & (offsets[:, 0] < start + len(text)))
  return (int(inside[0]), int(inside[-1])) if len(inside) else (-1, -1)


def _word_chars(offsets: np.ndarray, words: np.ndarray) -> np.ndarray:
  """Per token, the characters from its word's first to last token among these (contiguous)
  tokens: what the pipeline's token_to_word / word_to_chars give inside one window."""
  if not len(words):
    return np.zeros((0, 2), np.int32)
  change = np.flatnonzero(np.diff(words)) + 1
  first = np.concatenate([[0], change])
  last = np.concatenate([change, [len(words)]]) - 1
  run = np.repeat(np.arange(len(first)), last - first + 1)
  chars = np.stack([offsets[first[run], 0], offsets[last[run], 1]], -1)
  return np.where((words >= 0)[:, None], chars, -1).astype(np.int32)


def build_features(examples: Sequence[QAExample], tokenizer: Any, max_seq_length: int = 384,
                   doc_stride: int = 128, max_query_length: int = 64) -> QAFeatures:
  """Windows of every example (see the module docstring for `doc_stride`). `tokenizer`: a
  `tokenizers.Tokenizer`, a loaded bertjax tokenizer or its directory. Training targets: the
  first answer's token span when the window holds all of it, else 0/0 ([CLS])."""
  if doc_stride < 1:
    raise ValueError(f"doc_stride must be at least 1, got {doc_stride}")
  tok = _fast_tokenizer(tokenizer)
  cls, sep, pad = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
  if cls is None or sep is None:
    raise ValueError("question answering needs a tokenizer with [CLS] and [SEP]")
  pad = 0 if pad is None else pad
  questions = tok.encode_batch([e.question for e in examples], add_special_tokens=False)
  unique = list(dict.fromkeys(e.context for e in examples))
  contexts = dict(zip(unique, tok.encode_batch(unique, add_special_tokens=False)))
  rows: list[dict[str, Any]] = []
  for ei, ex in enumerate(examples):
    q = questions[ei].ids[:max_query_length]
    window = max_seq_length - len(q) - 3
    if window < 1:
      raise ValueError(f"question {ex.id}: max_seq_length {max_seq_length} leaves no room for "
                       f"context after its {len(q)} question tokens")
    enc = contexts[ex.context]
    ids = np.asarray(enc.ids, np.int32)
    offsets = np.asarray(enc.offsets, np.int32).reshape(-1, 2)
    words = np.asarray([-1 if w is None else w for w in enc.word_ids], np.int64)
    answer = _answer_tokens(offsets, ex)
    starts = window_starts(len(ids), window, doc_stride)
    lengths = [min(window, len(ids) - s) for s in starts]
    # run_squad's max context: min(left, right) context + 0.01 * window length, first best.
    pos = np.arange(len(ids))[None, :]
    first, length = np.asarray(starts)[:, None], np.asarray(lengths)[:, None]
    score = np.minimum(pos - first, first + length - 1 - pos) + 0.01 * length
    score = np.where((pos >= first) & (pos < first + length), score, -np.inf)
    best = np.argmax(score, 0) if len(ids) else np.zeros(0, np.int64)
    for w, (s, n) in enumerate(zip(starts, lengths)):
      head = len(q) + 2
      span = (0, 0)
      if answer[0] >= s and 0 <= answer[1] < s + n:
        span = (head + answer[0] - s, head + answer[1] - s)
      rows.append(dict(ids=[cls, *q, sep, *ids[s:s + n].tolist(), sep], head=head, span=span,
                       example=ei, index=np.arange(s, s + n), offsets=offsets[s:s + n],
                       words=_word_chars(offsets[s:s + n], words[s:s + n]),
                       max_context=best[s:s + n] == w))
  return _pad(rows, max_seq_length, pad)


def _pad(rows: list[dict[str, Any]], length: int, pad: int) -> QAFeatures:
  n = len(rows)
  f = QAFeatures(
      input_ids=np.full((n, length), pad, np.int32),
      token_type_ids=np.zeros((n, length), np.int32),
      attention_mask=np.zeros((n, length), np.int32),
      start_positions=np.asarray([r["span"][0] for r in rows], np.int32).reshape(n),
      end_positions=np.asarray([r["span"][1] for r in rows], np.int32).reshape(n),
      example_index=np.asarray([r["example"] for r in rows], np.int32).reshape(n),
      token_index=np.full((n, length), -1, np.int32),
      offsets=np.full((n, length, 2), -1, np.int32),
      word_chars=np.full((n, length, 2), -1, np.int32),
      max_context=np.zeros((n, length), bool))
  for i, r in enumerate(rows):
    size, head, ctx = len(r["ids"]), r["head"], len(r["index"])
    f.input_ids[i, :size] = r["ids"]
    f.attention_mask[i, :size] = 1
    f.token_type_ids[i, head:size] = 1
    part = slice(head, head + ctx)
    f.token_index[i, part], f.offsets[i, part] = r["index"], r["offsets"]
    f.word_chars[i, part], f.max_context[i, part] = r["words"], r["max_context"]
  return f


# --- answers ----------------------------------------------------------------------------------

def _softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(0, keepdims=True))
  return e / e.sum(0, keepdims=True)


def _pipeline_answers(ex: QAExample, f: QAFeatures, rows: np.ndarray, logits: np.ndarray,
                      top_k: int, max_answer_length: int, align_to_words: bool
                      ) -> tuple[list[dict[str, Any]], float]:
  """The pipeline's answers (text-merged, best first) and its null score, for one example."""
  answers: list[dict[str, Any]] = []
  null = 1e6  # the pipeline's "large and positive" start
  pre_topk = 2 * top_k + 10 if align_to_words else top_k
  for r in rows:
    context = f.token_index[r] >= 0
    keep = context.copy()
    keep[0] = True  # [CLS] stays in the softmax (the pipeline unmasks it for the null answer)
    probs = _softmax(np.where(keep[:, None], logits[r], -10000.0))
    null = min(null, float(probs[0, 0] * probs[0, 1]))
    p_start, p_end = (np.where(context, probs[:, i], 0.0) for i in (0, 1))
    length = len(p_start)
    # Band of spans: start s, end s + d for d < max_answer_length.
    ends = np.arange(length)[:, None] + np.arange(max_answer_length)[None, :]
    scores = p_start[:, None] * np.concatenate([p_end, np.zeros(max_answer_length)])[ends]
    flat = scores.ravel()
    best = np.argsort(-flat, kind="stable")[:pre_topk]
    for i in best[flat[best] > 0]:
      s, e = divmod(int(i), max_answer_length)
      e += s
      start, end = f.offsets[r, s, 0], f.offsets[r, e, 1]
      if align_to_words and f.word_chars[r, s, 0] >= 0 and f.word_chars[r, e, 0] >= 0:
        start, end = f.word_chars[r, s, 0], f.word_chars[r, e, 1]
      text = ex.context[start:end]
      same = next((a for a in answers if a["answer"].lower() == text.lower()), None)
      if same is not None:
        same["score"] += float(flat[i])
      else:
        answers.append({"answer": text, "score": float(flat[i]), "start": int(start),
                        "end": int(end)})
  return sorted(answers, key=lambda a: a["score"], reverse=True), null


def _logit_answers(ex: QAExample, f: QAFeatures, rows: np.ndarray, logits: np.ndarray,
                   n_best: int, max_answer_length: int) -> tuple[list[dict[str, Any]], float]:
  """run_squad's n best by start + end logit (deduplicated by text) and its null logit sum."""
  candidates, null = [], np.inf
  for r in rows:
    start_logits, end_logits = logits[r, :, 0], logits[r, :, 1]
    null = min(null, float(start_logits[0] + end_logits[0]))
    context = f.token_index[r] >= 0
    for s in np.argsort(-start_logits, kind="stable")[:n_best]:
      for e in np.argsort(-end_logits, kind="stable")[:n_best]:
        if (context[s] and context[e] and f.max_context[r, s] and s <= e
            and e - s < max_answer_length):
          candidates.append((float(start_logits[s] + end_logits[e]), int(r), int(s), int(e)))
  answers, seen = [], set()
  for logit, r, s, e in sorted(candidates, key=lambda c: -c[0]):
    start, end = int(f.offsets[r, s, 0]), int(f.offsets[r, e, 1])
    text = ex.context[start:end]
    if text not in seen and len(answers) < n_best:
      seen.add(text)
      answers.append({"answer": text, "logit": logit, "start": start, "end": end})
  return answers, null


def postprocess(examples: Sequence[QAExample], features: QAFeatures, logits: np.ndarray, *,
                n_best: int = 20, max_answer_length: int = 30, version_2: bool = False,
                null_threshold: float = 0.0, scoring: str = "pipeline",
                align_to_words: bool = True) -> dict[str, dict[str, Any]]:
  """Answers from span logits [N, L, 2] (start, end) of `features`' windows: per example id
  {"answer", "score", "start", "end", "n_best": [...]} (characters of the context; the null
  answer is "" at 0..0). With scoring="pipeline" the answer is transformers' pipeline(top_k=1)
  and n_best its top_k=n_best list (handle_impossible_answer=version_2). `version_2`: the null
  answer is predicted when its score exceeds the best span's by more than `null_threshold`
  (0: the pipeline's choice; run_squad's null_score_diff_threshold under scoring="logits")."""
  if scoring not in ("pipeline", "logits"):
    raise ValueError(f"scoring must be 'pipeline' or 'logits', got {scoring!r}")
  logits = np.asarray(logits, np.float64)
  if logits.shape != features.input_ids.shape + (2,):
    raise ValueError(f"logits of shape {logits.shape} for features of shape "
                     f"{features.input_ids.shape}: expected [N, L, 2]")
  out = {}
  for ei, ex in enumerate(examples):
    rows = np.flatnonzero(features.example_index == ei)
    if scoring == "pipeline":
      listed, null = _pipeline_answers(ex, features, rows, logits, n_best, max_answer_length,
                                       align_to_words)
      top = listed if n_best == 1 else _pipeline_answers(
          ex, features, rows, logits, 1, max_answer_length, align_to_words)[0]
      empty = {"answer": "", "score": null if version_2 else 0.0, "start": 0, "end": 0}
      if version_2:  # appended last: a span scoring the same stays ahead (stable sort)
        listed = sorted(listed + [empty], key=lambda a: a["score"], reverse=True)
      listed, best = listed[:n_best], (top[0] if top else None)
      if best is None or (version_2 and null - best["score"] > null_threshold):
        best = empty
    else:
      listed, null = _logit_answers(ex, features, rows, logits, n_best, max_answer_length)
      empty = {"answer": "", "logit": null if version_2 else 0.0, "start": 0, "end": 0}
      best = listed[0] if listed else None
      if version_2:  # run_squad: the n best spans and the null answer share the softmax
        listed = sorted(listed + [empty], key=lambda a: a["logit"], reverse=True)
      if best is None or (version_2 and null - best["logit"] > null_threshold):
        best = empty
      probs = _softmax(np.asarray([a["logit"] for a in listed])) if listed else []
      where = next((i for i, a in enumerate(listed) if a is best), None)
      listed = [{**a, "score": float(p)} for a, p in zip(listed, probs)]
      best = listed[where] if where is not None else {**best, "score": 0.0}
    out[ex.id] = {"answer": best["answer"], "score": float(best["score"]),
                  "start": int(best["start"]), "end": int(best["end"]), "n_best": listed}
  return out
