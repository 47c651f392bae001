"""A SQuAD-format question answering set made from a corpus the project ships.

The fine-tuning experiments need an extractive QA task whose data come with the project (SQuAD
itself must be downloaded). Questions are cloze-style and answerable by reading: one sentence
of a paragraph, a span of it replaced by a wh-phrase, the paragraph as the context. Articles
are split between train and dev; v2.0 files add unanswerable questions. A seed gives identical
files.

The guide: docs/finetuning.md, 'Extractive question answering (SQuAD)'.
"""

from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

from bertjax.data.sentences import split_sentences
from bertjax.data.sources import SkipCounts, parse_sources, read_source
from bertjax.finetune.squad import QAExample, read_squad, write_squad

_YEAR = re.compile(r"\b[Ii]n ((?:1[0-9]|20)[0-9]{2})\b(?![\d,.]\d),?")
_COUNT = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(?![\d,.]\d) ([a-z]{3,})\b")
_NAME = re.compile(r"\b[A-Z][a-zA-Z-]+(?: (?:(?:of|de|von|van|del|la) )?[A-Z][a-zA-Z-]+){0,3}")
_PHRASE = re.compile(r"\b(?:the|a|an) [a-z]{3,}(?: [a-z]{3,})? of (?:the )?(?!the\b)[a-z]{3,}\b")
# A name followed by one of these is asked for with "who".
_PERSON_VERB = re.compile(r" (?:was born|wrote|said|became|died|married|founded|led|won|"
                          r"published|argued|proposed|invented|discovered|described)\b")
# Words after a number that are not the things it counts ("3 and 4", "2 of them").
_NOT_COUNTED = {"and", "the", "or", "to", "of", "in", "on", "at", "by", "for", "was", "is"}


def _candidates(sentence: str) -> list[tuple[str, int, int, str]]:
  """(kind, answer start, answer end, question) for every answer span this sentence offers."""
  found = []

  def ask(kind: str, a: int, b: int, cut: tuple[int, int], wh: str) -> None:
    text = (sentence[:cut[0]] + wh + sentence[cut[1]:]).strip()
    text = re.sub(r"\s+", " ", re.sub(r"[\s.!?;:,]+$", "", text))
    if cut[0] == 0:
      text = text[0].upper() + text[1:]
    answer = sentence[a:b]
    if len(text.split()) >= 4 and answer.lower() not in text.lower():
      found.append((kind, a, b, text + "?"))

  for m in _YEAR.finditer(sentence):
    ask("when", m.start(1), m.end(1), (m.start(), m.end()), "when")
  for m in _COUNT.finditer(sentence):
    if m.group(2) not in _NOT_COUNTED and not re.fullmatch(r"1[5-9]\d\d|20\d\d", m.group(1)):
      ask("how many", m.start(1), m.end(1), (m.start(1), m.end(1)), "how many")
  for m in _NAME.finditer(sentence):
    a = m.start()
    if a == 0:  # a capitalised first word is mostly just a first word ("The", "Following")
      a = m.group().find(" ") + 1
      if not a or not sentence[a].isupper():
        continue
    who = " " in sentence[a:m.end()] and _PERSON_VERB.match(sentence, m.end())
    ask("who" if who else "what", a, m.end(), (a, m.end()), "who" if who else "what")
  for m in _PHRASE.finditer(sentence):
    ask("what", m.start(), m.end(), m.span(), "what")
  return found


def _article_questions(doc_id: str, paragraphs: list[str], rng: random.Random,
                       per_paragraph: int) -> list[tuple[QAExample, str]]:
  """Up to `per_paragraph` questions (with their kind) from each paragraph, one per sentence."""
  out = []
  for p, paragraph in enumerate(paragraphs):
    offered = []
    cursor = 0
    for s, sentence in enumerate(split_sentences(paragraph)):
      at = paragraph.find(sentence, cursor)
      if at < 0:
        continue
      cursor = at + len(sentence)
      words = len(sentence.split())
      options = _candidates(sentence) if 6 <= words <= 30 else []
      if options:
        # A kind first, then a span of it: names would otherwise make most questions "what".
        kind = rng.choice(sorted({o[0] for o in options}))
        _, a, b, question = rng.choice([o for o in options if o[0] == kind])
        answer = (sentence[a:b], at + a)
        offered.append((QAExample(f"{doc_id}-{p}-{s}", question, paragraph, [answer],
                                  title=doc_id), kind))
    rng.shuffle(offered)
    out += offered[:per_paragraph]
  return out


def _unanswerable(ex: QAExample, pool: list[str], fallback: list[str],
                  rng: random.Random) -> QAExample | None:
  """The question on another paragraph (of its article if one will do) lacking the answer."""
  answer = ex.answers[0][0].lower()
  for paragraphs in (pool, fallback):
    others = [p for p in paragraphs if p != ex.context and answer not in p.lower()]
    if others:
      return QAExample(ex.id, ex.question, rng.choice(others), [], True, ex.title)
  return None


def make_qa_task(source: str, out_dir: str | Path, num_train: int = 2000, num_dev: int = 300,
                 dev_fraction: float = 0.15, per_paragraph: int = 2,
                 unanswerable_fraction: float = 1 / 3, min_context_words: int = 20,
                 max_context_words: int = 250, seed: int = 0) -> dict:
  """Writes OUT/train-v1.1.json, dev-v1.1.json, train-v2.0.json, dev-v2.0.json and task.json
  (counts); returns task.json's summary. `dev_fraction` of the articles (at least one) are
  dev articles; contexts are paragraphs of `min_context_words`..`max_context_words` words."""
  paragraphs: dict[str, list[str]] = {}
  for spec in parse_sources(source):
    for doc in read_source(spec, SkipCounts()):
      kept = [p for p in doc.paragraphs
              if min_context_words <= len(p.split()) <= max_context_words]
      if kept:
        paragraphs[doc.id] = kept
  if len(paragraphs) < 2:
    raise ValueError(f"{source}: {len(paragraphs)} documents with paragraphs of "
                     f"{min_context_words}-{max_context_words} words; a train/dev split "
                     "needs at least 2")
  rng = random.Random(seed)
  order = sorted(paragraphs)
  rng.shuffle(order)
  num_dev_articles = min(len(order) - 1, max(1, round(dev_fraction * len(order))))
  splits = {"dev": (order[:num_dev_articles], num_dev),
            "train": (order[num_dev_articles:], num_train)}
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  summary: dict = {"source": source, "seed": seed, "dev_fraction": dev_fraction,
                   "per_paragraph": per_paragraph, "context_words": [min_context_words,
                                                                     max_context_words]}
  for name, (articles, wanted) in splits.items():
    asked = [q for a in articles for q in _article_questions(a, paragraphs[a], rng,
                                                             per_paragraph)]
    if len(asked) < wanted:
      raise ValueError(f"{source}: the {len(articles)} {name} articles give {len(asked)} "
                       f"questions, {wanted} asked for (lower the size or per_paragraph limit)")
    rng.shuffle(asked)
    asked = asked[:wanted]
    v1 = [ex for ex, _ in asked]
    every = [p for a in articles for p in paragraphs[a]]
    v2 = list(v1)
    for i in sorted(rng.sample(range(len(v1)), round(unanswerable_fraction * len(v1)))):
      v2[i] = _unanswerable(v1[i], paragraphs[v1[i].title], every, rng) or v1[i]
    write_squad(v1, out / f"{name}-v1.1.json", "1.1")
    write_squad(v2, out / f"{name}-v2.0.json", "2.0")
    read_squad(out / f"{name}-v2.0.json")  # every answer where answer_start says
    summary[name] = {"articles": sorted({ex.title for ex in v1}), "questions": len(v1),
                     "by_kind": dict(sorted(collections.Counter(k for _, k in asked).items())),
                     "unanswerable_v2": sum(ex.is_impossible for ex in v2)}
  (out / "task.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary
