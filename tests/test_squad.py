"""Extractive QA (bertjax.finetune.squad, bertjax.finetune.qa_task, scores.squad_scores): EM/F1
as the official SQuAD scripts define them, windows that cover the context and map answers back to
their characters, answers equal to transformers' question-answering pipeline on an exported
BertForQuestionAnswering, a deterministic article-split QA set, and errors naming file and
question."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import numpy as np
import pytest
from tokenizers import BertWordPieceTokenizer, Tokenizer

from bertjax import hf
from bertjax.data.errors import CorpusError
from bertjax.finetune.qa_task import make_qa_task
from bertjax.finetune.squad import (QAExample, build_features, postprocess, read_squad,
                                write_squad)
from bertjax.data.tokenizers import load_tokenizer
from bertjax.data.sentencepiece_training import train_sentencepiece
from bertjax.data.wordpiece import BERT_SPECIAL_TOKENS
from bertjax.hf.tokenizer import fast_tokenizer
from bertjax.models import ModelConfig, jit_init
from bertjax.models.bert import BertForQuestionAnswering
from bertjax.finetune.scores import squad_scores

SEQ, STRIDE, MAX_ANSWER = 64, 24, 8  # the parity test's windows and answer length


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  out = tmp_path_factory.mktemp("qa_task")
  summary = make_qa_task("embedded", out, num_train=60, num_dev=40, seed=0)
  return out, summary


@pytest.fixture(scope="module", params=["wordpiece", "sentencepiece"])
def tokenizer_dir(request, task, tmp_path_factory):
  """A tiny uncased WordPiece vocabulary (vocab.txt + the casing record bertjax reads) or a
  BERT-style SentencePiece unigram model, trained on the task's text."""
  text = [t for name in ("train", "dev") for e in read_squad(task[0] / f"{name}-v1.1.json")
          for t in (e.context, e.question)]
  out = tmp_path_factory.mktemp(request.param)
  if request.param == "sentencepiece":
    return train_sentencepiece(text, out, vocab_size=800, model_type="unigram", style="bert")
  trainer = BertWordPieceTokenizer(lowercase=True)
  trainer.train_from_iterator(text, vocab_size=1000, min_frequency=2,
                              special_tokens=list(BERT_SPECIAL_TOKENS), show_progress=False)
  trainer.save_model(str(out))
  (out / "bertjax_tokenizer.json").write_text(json.dumps({"type": "wordpiece",
                                                          "lowercase": True}) + "\n")
  return out


def _examples(*golds: list[str] | None) -> list[QAExample]:
  """One question per gold list; None is an unanswerable question."""
  return [QAExample(f"q{i}", "?", "", [(g, 0) for g in gold or []], gold is None)
          for i, gold in enumerate(golds)]


# --- scores -----------------------------------------------------------------------------------

def test_squad_scores_follow_the_official_definitions():
  cases = [  # (prediction, gold answers, exact match, F1), worked out by hand
      ("The Eiffel Tower!", ["eiffel tower"], 1, 1),  # case, article, punctuation
      ("  Eiffel \t Tower ", ["Eiffel Tower"], 1, 1),  # white space
      ("U.S.", ["US"], 1, 1),  # punctuation inside a word
      ("the atre", ["Theatre"], 0, 0),  # articles only as whole words
      ("the cat sat", ["cat sat on mat"], 0, 2 / 3),  # P 2/2, R 2/4
      ("Paris France", ["Paris", "Paris, France", "city of Paris"], 1, 1),  # max over golds
      ("in Paris", ["Lyon", "Paris"], 0, 2 / 3),  # F1 max: P 1/2, R 1/1 against "Paris"
      ("new york new york", ["new york"], 0, 2 / 3),  # counts clip: 2 common of 4 predicted
  ]
  for pred, gold, em, f1 in cases:
    one = squad_scores({"q0": pred}, _examples(gold))
    assert (one["exact_match"], one["f1"]) == pytest.approx((100 * em, 100 * f1)), pred
  # Means over questions; one without a prediction scores 0.
  got = squad_scores({f"q{i}": c[0] for i, c in enumerate(cases)},
                     _examples(*(c[1] for c in cases), ["missing"]))
  assert (got["exact_match"], got["f1"], got["total"]) == pytest.approx(
      (100 * sum(c[2] for c in cases) / 9, 100 * sum(c[3] for c in cases) / 9, 9))
  assert "HasAns_f1" not in got


def test_squad_v2_scores_unanswerable_and_splits():
  examples = _examples(None, None, ["Paris"], ["the"], ["cat sat on mat"])
  predictions = {"q0": "", "q1": "Paris", "q2": "", "q3": "", "q4": "the cat sat"}
  got = squad_scores(predictions, examples)
  # q0: "" for "" (1, 1); q1: an answer where none exists (0, 0); q2: nothing for "Paris"
  # (0, 0); q3: gold "the" normalises to nothing, so [""] (1, 1); q4: (0, 2/3).
  assert got["exact_match"] == pytest.approx(100 * 2 / 5)
  assert got["f1"] == pytest.approx(100 * (2 + 2 / 3) / 5)
  assert (got["NoAns_total"], got["NoAns_exact"], got["NoAns_f1"]) == (2, 50, 50)
  assert got["HasAns_total"] == 3  # q3 counts as answerable: it lists an answer
  assert got["HasAns_exact"] == pytest.approx(100 / 3)
  assert got["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)
  # v1.1's script has no empty-answer rule: "" for "the" matches exactly, with F1 0.
  v1 = squad_scores({"q0": ""}, _examples(["the"]), version="1.1")
  assert (v1["exact_match"], v1["f1"]) == (100, 0)


# --- reading and writing ----------------------------------------------------------------------

def test_read_write_round_trip(tmp_path):
  examples = [QAExample("a", "Where is Paris?", "Paris is in France.", [("France", 12)],
                        title="geo"),
              QAExample("b", "What is in France?", "Paris is in France.",
                        [("Paris", 0), ("Paris", 0)], title="geo"),
              QAExample("c", "Where is Lyon?", "Nice is in France.", [], True, "geo")]
  write_squad(examples, tmp_path / "v2.json", "2.0")
  assert read_squad(tmp_path / "v2.json") == examples
  with pytest.raises(ValueError, match="question c is unanswerable"):
    write_squad(examples, tmp_path / "v1.json", "1.1")
  write_squad(examples[:2], tmp_path / "v1.json", "1.1")
  assert "is_impossible" not in (tmp_path / "v1.json").read_text()
  assert read_squad(tmp_path / "v1.json") == examples[:2]


@pytest.mark.parametrize("qas,problem", [
    ([{"id": "q7", "question": "?", "answers": [{"text": "France", "answer_start": 3}]}],
     r"question q7: answer 'France' is not at answer_start 3"),
    ([{"id": "q7", "answers": [{"text": "Paris", "answer_start": 0}]}],
     r"question q7: field 'question' missing"),
    ([{"id": "q7", "question": "?", "answers": [{"text": "Paris"}]}],
     r"question q7: field 'answer_start' missing"),
    ([{"id": "q7", "question": "?", "answers": []}], r"question q7: no answers"),
    ([{"id": "q7", "question": "?", "answers": [], "is_impossible": True}] * 2,
     r"question q7: id used twice"),
    ([{"question": "?", "answers": []}], r"data\[0\]\.paragraphs\[0\]\.qas\[0\]: field 'id'"),
    (None, r"data\[0\]\.paragraphs\[0\]: field 'context' missing"),
    ("{", r"line 2: not JSON"),
])
def test_read_squad_errors_name_file_and_position(tmp_path, qas, problem):
  path = tmp_path / "bad.json"
  para = {"context": "Paris is in France.", "qas": qas} if qas is not None else {"qas": []}
  text = json.dumps({"data": [{"title": "t", "paragraphs": [para]}]})
  path.write_text('{"data": [\n  {"paragraphs": [}\n]}' if qas == "{" else text)
  with pytest.raises(CorpusError, match=re.escape(str(path)) + ": " + problem):
    read_squad(path)


# --- features -----------------------------------------------------------------------------------

def test_windows_cover_context_and_map_answers_back(task, tokenizer_dir):
  tok = fast_tokenizer(load_tokenizer(tokenizer_dir))
  examples = read_squad(task[0] / "dev-v2.0.json") + read_squad(task[0] / "train-v1.1.json")
  wordpiece = (tokenizer_dir / "vocab.txt").is_file()
  max_query, stride = 12, 16
  f = build_features(examples, tokenizer_dir, max_seq_length=SEQ, doc_stride=stride,
                     max_query_length=max_query)
  assert f.input_ids.shape == (len(f), SEQ) and f.input_ids.dtype == np.int32
  truncated = labelled = multi = 0
  for ei, ex in enumerate(examples):
    rows = np.flatnonzero(f.example_index == ei)
    multi += len(rows) > 1
    question = tok.encode(ex.question, add_special_tokens=False).ids
    context, q = tok.encode(ex.context, add_special_tokens=False), question[:max_query]
    truncated += len(question) > max_query
    covered = set()
    for r in rows:
      ids = f.input_ids[r, :f.attention_mask[r].sum()].tolist()
      n = len(ids) - len(q) - 3
      assert ids[:len(q) + 2] == [tok.token_to_id("[CLS]"), *q, tok.token_to_id("[SEP]")]
      index = f.token_index[r, len(q) + 2:len(q) + 2 + n]
      assert ids[len(q) + 2:-1] == [context.ids[i] for i in index]
      assert (f.token_type_ids[r, :len(ids)] == (np.arange(len(ids)) >= len(q) + 2)).all()
      covered |= set(index.tolist())
      s, e = f.start_positions[r], f.end_positions[r]
      if ex.is_impossible:
        assert s == e == 0
      elif s:
        labelled += 1
        # The answer, exactly its characters, through the offsets of its first/last token;
        # a SentencePiece piece "▁word" also spans the space before the word.
        text, start = ex.answers[0]
        span = ex.context[f.offsets[r, s, 0]:f.offsets[r, e, 1]]
        assert (span if wordpiece else span.lstrip()) == text
        assert f.offsets[r, e, 1] == start + len(text)
      else:  # 0/0 only where the window does not hold the whole answer
        text, start = ex.answers[0]
        inside = f.offsets[r][f.token_index[r] >= 0]
        assert not (inside[:, 0].min() <= start and start + len(text) <= inside[:, 1].max())
    assert covered == set(range(len(context.ids))), ex.id  # windows cover the context
    starts = [f.token_index[r, len(q) + 2] for r in rows]
    assert starts == list(range(0, stride * len(rows), stride))  # doc_stride: the step
  assert truncated and multi and labelled


# --- the question-answering pipeline --------------------------------------------------------------

def _reference(model, tokenizer, question, context, *, top_k, handle_impossible_answer,
               max_answer_len, max_seq_len, doc_stride):
  """transformers' QuestionAnsweringPipeline (4.x; the task left transformers 5) with a fast,
  right-padding tokenizer, `align_to_words`, step for step: its preprocess (overflowing
  windows, p_mask), _forward and postprocess around transformers' own select_starts_ends."""
  import torch
  from transformers.pipelines.document_question_answering import select_starts_ends
  enc = tokenizer(text=question, text_pair=context, padding="do_not_pad",
                  truncation="only_second", max_length=max_seq_len, stride=doc_stride,
                  return_token_type_ids=True, return_overflowing_tokens=True,
                  return_offsets_mapping=True, return_special_tokens_mask=True)
  min_null_score, answers = 1000000, []
  for i in range(len(enc["input_ids"])):
    p_mask = [tok != 1 for tok in enc.sequence_ids(i)]
    for cls_index in np.nonzero(np.array(enc["input_ids"][i]) == tokenizer.cls_token_id)[0]:
      p_mask[cls_index] = 0
    inputs = {k: torch.tensor([enc[k][i]]) for k in tokenizer.model_input_names}
    with torch.no_grad():
      out = model(**inputs)
    starts, ends, scores, min_null_score = select_starts_ends(
        out.start_logits, out.end_logits, torch.tensor(p_mask).unsqueeze(0),
        inputs["attention_mask"].numpy(), min_null_score, top_k * 2 + 10,
        handle_impossible_answer, max_answer_len)
    e = enc[i]
    for s, t, score in zip(starts, ends, scores):
      s, t = int(s), int(t)
      try:
        start = e.word_to_chars(e.token_to_word(s), sequence_index=1)[0]
        end = e.word_to_chars(e.token_to_word(t), sequence_index=1)[1]
      except Exception:
        start, end = e.offsets[s][0], e.offsets[t][1]
      same = [a for a in answers if a["answer"].lower() == context[start:end].lower()]
      if same:
        same[0]["score"] += score.item()
      else:
        answers.append({"score": score.item(), "start": start, "end": end,
                        "answer": context[start:end]})
  if handle_impossible_answer:
    answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
  return sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]


@pytest.fixture(scope="module")
def exported(task, tokenizer_dir, tmp_path_factory):
  """Dev questions of at most 24 tokens (the pipeline does not cut questions) per version,
  random BertForQuestionAnswering parameters (spread so that spans score apart), their
  Hugging Face export."""
  tok = fast_tokenizer(load_tokenizer(tokenizer_dir))
  picked = {v: [e for e in read_squad(task[0] / f"dev-v{v}.json")
                if len(tok.encode(e.question, add_special_tokens=False).ids) <= 24][:6]
            for v in ("1.1", "2.0")}
  cfg = ModelConfig(family="bert", vocab_size=len(load_tokenizer(tokenizer_dir)),
                    hidden_size=32, num_layers=2, num_heads=2, mlp_dim=64, max_positions=SEQ)
  model, rng = BertForQuestionAnswering(cfg), np.random.RandomState(0)
  params = jit_init(model)(jax.random.key(0))
  params = jax.tree.map(lambda x: np.asarray(x) + 0.3 * rng.standard_normal(x.shape)
                        .astype(np.float32), params)
  # With random weights the null answer (the smallest [CLS] product over the windows) never
  # wins. Token types set [CLS] apart from the context, and a direction added to both outputs
  # (least squares) raises type-0 logits, not the context's: just enough for v2 to go both ways.
  types = np.array(params["bert"]["token_type_embeddings"]["embedding"])
  shift = rng.standard_normal(types.shape[1]).astype(np.float32)
  params["bert"]["token_type_embeddings"]["embedding"] = types + np.stack([shift, -shift])
  examples, apply = picked["2.0"], jax.jit(model.apply)
  f = build_features(examples, tokenizer_dir, max_seq_length=SEQ, doc_stride=STRIDE)
  inputs = (f.input_ids, f.token_type_ids, f.attention_mask)
  _, state = jax.jit(functools.partial(model.apply, capture_intermediates=True,
                                       mutable=["intermediates"]))({"params": params}, *inputs)
  hidden = np.asarray(state["intermediates"]["bert"]["__call__"][0][0])
  first, context = hidden[f.token_type_ids == 0].mean(0), hidden[f.token_index >= 0]
  w = np.linalg.solve(context.T @ context / len(context) + 1e-3 * np.eye(len(first)), first)
  kernel = params["qa_outputs"]["kernel"]
  for raise_by in (1, 2, 3, 4, 6, 8):
    params["qa_outputs"]["kernel"] = kernel + (raise_by * w / (w @ first))[:, None]
    got = postprocess(examples, f, np.asarray(apply({"params": params}, *inputs)),
                      n_best=1, max_answer_length=MAX_ANSWER, version_2=True)
    if 0 < sum(not a["answer"] for a in got.values()) < len(examples):
      break
  out = tmp_path_factory.mktemp("hf_qa")
  hf.export_hf(params, cfg, out, tokenizer_dir=tokenizer_dir, head="question_answering")
  return picked, apply, params, out


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_postprocess_equals_transformers_pipeline(tokenizer_dir, exported, version):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  picked, apply, params, export = exported
  hf_model = transformers.AutoModelForQuestionAnswering.from_pretrained(export).eval()
  hf_tok = transformers.AutoTokenizer.from_pretrained(export)
  try:  # the pipeline itself where transformers still has it (4.x)
    pipe = transformers.pipeline("question-answering", model=hf_model, tokenizer=hf_tok)
  except KeyError:  # transformers 5 removed it: its 4.x steps, run on transformers' parts
    if os.environ.get("BERTJAX_REQUIRE_QA_PIPELINE"):
      raise
    pipe = None
  v2 = version == "2.0"
  examples = picked[version]
  f = build_features(examples, tokenizer_dir, max_seq_length=SEQ, doc_stride=STRIDE)
  logits = apply({"params": params}, f.input_ids, f.token_type_ids, f.attention_mask)
  windows = nulls = 0
  for n_best in (1, 3):
    ours = postprocess(examples, f, np.asarray(logits), n_best=n_best,
                       max_answer_length=MAX_ANSWER, version_2=v2)
    for ei, ex in enumerate(examples):
      rows = np.flatnonzero(f.example_index == ei)
      # run_squad's step between windows is the tokenizer's overlap window - step.
      q = len(hf_tok(ex.question, add_special_tokens=False)["input_ids"])
      args = dict(top_k=n_best, handle_impossible_answer=v2, max_answer_len=MAX_ANSWER,
                  max_seq_len=SEQ, doc_stride=SEQ - q - 3 - STRIDE)
      enc = hf_tok(ex.question, ex.context, truncation="only_second", max_length=SEQ,
                   stride=args["doc_stride"], return_overflowing_tokens=True)
      assert enc["input_ids"] == [f.input_ids[r, :f.attention_mask[r].sum()].tolist()
                                  for r in rows], ex.id
      if pipe is not None:
        theirs = pipe(question=ex.question, context=ex.context, **args)
        theirs = [theirs] if isinstance(theirs, dict) else theirs
      else:
        theirs = _reference(hf_model, hf_tok, ex.question, ex.context, **args)
      listed = ours[ex.id]["n_best"] if n_best > 1 else [ours[ex.id]]
      assert [(a["answer"], a["start"], a["end"]) for a in listed] == \
          [(a["answer"], a["start"], a["end"]) for a in theirs], ex.id
      np.testing.assert_allclose([a["score"] for a in listed], [a["score"] for a in theirs],
                                 atol=1e-4, err_msg=ex.id)
      windows += n_best == 1 and len(rows) > 1
      nulls += n_best == 1 and not ours[ex.id]["answer"]
  assert windows >= 4  # contexts over several windows
  assert 0 < nulls < len(examples) if v2 else not nulls  # v2: the null answer wins some


def test_decoding_rules_on_hand_made_logits():
  """The null answer against the best span under both scorings; the pipeline's merging of
  answers that differ only in case; run_squad's max-context rule."""
  ex = QAExample("q", "Who?", "Ada wrote it", [("Ada", 0)])
  words = [*BERT_SPECIAL_TOKENS, "who", "?", "ada", "wrote", "it", "met"]
  tiny = Tokenizer.from_str(BertWordPieceTokenizer({t: i for i, t in enumerate(words)},
                                                   lowercase=True).to_str())
  f = build_features([ex], tiny, max_seq_length=16)
  logits = np.full(f.input_ids.shape + (2,), -5.0)
  ada, it = 4, 6  # [CLS] who ? [SEP] ada wrote it [SEP]
  logits[0, ada, 0], logits[0, ada, 1] = 2.0, 2.0  # span "Ada": logit sum 4
  logits[0, 0] = 2.5  # [CLS]: null logit sum 5
  logits[0, it, 1] = 1.0
  for scoring in ("pipeline", "logits"):
    v1 = postprocess([ex], f, logits, scoring=scoring)["q"]
    assert (v1["answer"], v1["start"], v1["end"]) == ("Ada", 0, 3)
    v2 = postprocess([ex], f, logits, version_2=True, scoring=scoring)["q"]
    assert v2["answer"] == "" and v2["n_best"][0]["answer"] == ""
    # A threshold above the null's margin keeps the span.
    kept = postprocess([ex], f, logits, version_2=True, scoring=scoring,
                       null_threshold=0.5 if scoring == "pipeline" else 1.5)["q"]
    assert kept["answer"] == "Ada"
  ranked = postprocess([ex], f, logits, scoring="logits", n_best=3)["q"]["n_best"]
  assert [(a["answer"], a["logit"]) for a in ranked[:2]] == [("Ada", 4.0), ("Ada wrote it", 3.0)]
  assert sum(a["score"] for a in ranked) == pytest.approx(1.0)

  # "Ada" and "ada" are one answer to the pipeline: their probabilities add up.
  ex = QAExample("q", "Who?", "Ada met ada", [("Ada", 0)])
  f = build_features([ex], tiny, max_seq_length=16)
  logits = np.full(f.input_ids.shape + (2,), -5.0)
  logits[0, [4, 6]] = 2.0
  p = np.exp(2.0) / (2 * np.exp(2.0) + 2 * np.exp(-5.0))  # softmax over [CLS] + 3 tokens
  got = postprocess([ex], f, logits)["q"]
  assert (got["answer"], got["start"], got["score"]) == ("Ada", 0, pytest.approx(2 * p * p))

  # run_squad: a span counts only from the window where its first token has most context.
  ex = QAExample("q", "Who?", "ada wrote it ada wrote it", [("ada", 13)])
  f = build_features([ex], tiny, max_seq_length=9, doc_stride=2)
  assert f.token_index[:, 4].tolist() == [0, 2]  # windows: tokens 0-3 and 2-5
  logits = np.full(f.input_ids.shape + (2,), -5.0)
  logits[0, 7] = 5.0  # token 3 ("ada") at the end of window 0: sum 10, no context after it
  logits[1, 5] = 3.0  # the same token inside window 1: sum 6
  got = postprocess([ex], f, logits, scoring="logits")["q"]
  assert (got["answer"], got["start"], got["n_best"][0]["logit"]) == ("ada", 13, 6.0)


# --- the QA set ---------------------------------------------------------------------------------

def test_qa_task_is_deterministic_split_by_article_and_answerable(task, tmp_path):
  out, summary = task
  names = ["train-v1.1.json", "dev-v1.1.json", "train-v2.0.json", "dev-v2.0.json", "task.json"]
  make_qa_task("embedded", tmp_path / "again", num_train=60, num_dev=40, seed=0)
  for name in names:
    assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
  make_qa_task("embedded", tmp_path / "other", num_train=60, num_dev=40, seed=1)
  assert (tmp_path / "other" / names[0]).read_bytes() != (out / names[0]).read_bytes()
  split = {}
  for name in ("train", "dev"):
    v1 = read_squad(out / f"{name}-v1.1.json")  # raises unless every answer is at its start
    v2 = read_squad(out / f"{name}-v2.0.json")
    assert len(v1) == summary[name]["questions"] == {"train": 60, "dev": 40}[name]
    assert not any(e.is_impossible for e in v1)
    for e in v1:
      assert e.question.endswith("?") and e.answers[0][0].lower() not in e.question.lower()
    split[name] = {e.title for e in v1 + v2} | {e.context for e in v1 + v2}
    answered = {e.id: e for e in v1}
    impossible = [e for e in v2 if e.is_impossible]
    assert len(impossible) == round(len(v1) / 3) == summary[name]["unanswerable_v2"]
    for e in impossible:  # the same question on another paragraph that lacks its answer
      original = answered[e.id]
      assert e.question == original.question and e.context != original.context
      assert original.answers[0][0].lower() not in e.context.lower()
    assert all(e == answered[e.id] for e in v2 if not e.is_impossible)
  assert split["train"] and split["dev"] and not split["train"] & split["dev"]
