"""GLUE's nine tasks in GLUE's own files, made from a corpus (`bertjax data glue`).

`bertjax eval glue` reads GLUE's directory layout; the real data is a download this project
does not ship. These tasks are built from the sentences of a corpus (the embedded Wikipedia
sample by default), each written in its GLUE task's exact file format (columns, header or
none, label spellings), so the suite runs end to end anywhere; a model's numbers on them are
comparable between runs, not with published GLUE scores.

The guide: docs/finetuning.md, 'GLUE and SQuAD as the papers report them'.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bertjax.data.sentences import split_sentences
from bertjax.data.sources import SkipCounts, parse_sources, read_source
from bertjax.finetune import suites

Articles = list[list[str]]


def _articles(source: str, min_words: int) -> Articles:
  found = []
  for spec in parse_sources(source):
    for doc in read_source(spec, SkipCounts()):
      sentences = [" ".join(s.split()) for p in doc.paragraphs
                   for s in ([p] if doc.sentences_given else split_sentences(p))
                   if len(s.split()) >= min_words and "\t" not in s and '"' not in s]
      if len(sentences) >= 4:
        found.append(sentences)
  return found


def _write(path: Path, header: list[str] | None, rows: list[list[str]]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  lines = (["\t".join(header)] if header else []) + ["\t".join(map(str, r)) for r in rows]
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _examples(task: str, articles: Articles, n: int, rng: random.Random) -> list[tuple]:
  """n examples of `task` from `articles` (each drawn afresh; balanced in expectation)."""
  out = []
  while len(out) < n:
    a = rng.randrange(len(articles))
    b = rng.choice([i for i in range(len(articles)) if i != a])
    i = rng.randrange(len(articles[a]) - 1)
    first, other = articles[a][i], rng.choice(articles[b])
    rest = [s for j, s in enumerate(articles[a]) if j not in (i, i + 1)]
    elsewhere = rng.choice(rest) if rest else other
    words = first.split()
    yes = rng.random() < 0.5
    if task == "cola":
      if len(set(words)) < 2:
        continue
      shuffled = words[:]
      while shuffled == words:
        rng.shuffle(shuffled)
      out.append((1, first) if yes else (0, " ".join(shuffled)))
    elif task == "sst2":  # `articles` are the two classes
      side = rng.randrange(2)
      out.append((rng.choice(articles[side]), side))
    elif task in ("mrpc", "qqp"):
      same = articles[a][i + 1] if task == "mrpc" else elsewhere
      out.append((first, same if yes else other, int(yes)))
    elif task == "stsb":
      pool, keep = other.split(), rng.random()
      kept = [w if rng.random() < keep else rng.choice(pool) for w in words]
      score = 5.0 * sum(x == y for x, y in zip(words, kept)) / len(words)
      out.append((first, " ".join(kept), round(score, 3)))
    elif task == "mnli":
      kind = rng.randrange(3)
      second = (articles[a][i + 1], elsewhere, other)[kind]
      out.append((first, second, ("entailment", "neutral", "contradiction")[kind]))
    elif task == "qnli":
      question = " ".join((words if yes else other.split())[:5]) + "?"
      out.append((question, first, "entailment" if yes else "not_entailment"))
    elif task in ("rte", "wnli"):
      prefix = " ".join((words if yes else other.split())[:max(3, len(words) // 2)])
      label = ("entailment" if yes else "not_entailment") if task == "rte" else int(yes)
      out.append((first, prefix, label))
  return out


def _rows(task: str, examples: list[tuple]) -> tuple[list[str] | None, list[list]]:
  """GLUE's header and columns for `task`."""
  if task == "cola":
    return None, [["gj04", label, "*" if not label else "", s] for label, s in examples]
  if task == "sst2":
    return ["sentence", "label"], [list(e) for e in examples]
  if task == "mrpc":
    return (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
            [[label, 2 * k, 2 * k + 1, a, b] for k, (a, b, label) in enumerate(examples)])
  if task == "stsb":
    return (["index", "genre", "filename", "year", "old_index", "source1", "source2",
             "sentence1", "sentence2", "score"],
            [[k, "main-wiki", "wiki", "2026", k, "wiki", "wiki", a, b, s]
             for k, (a, b, s) in enumerate(examples)])
  if task == "qqp":
    return (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            [[k, 2 * k, 2 * k + 1, a, b, label] for k, (a, b, label) in enumerate(examples)])
  if task == "mnli":
    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
              "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
              "sentence2", "label1", "gold_label"]
    return header, [[k, k, f"{k}e", "wiki", "()", "()", "()", "()", a, b, label, label]
                    for k, (a, b, label) in enumerate(examples)]
  if task == "qnli":
    return (["index", "question", "sentence", "label"],
            [[k, q, s, label] for k, (q, s, label) in enumerate(examples)])
  return (["index", "sentence1", "sentence2", "label"],
          [[k, a, b, label] for k, (a, b, label) in enumerate(examples)])


def make_glue_tasks(source: str, out_dir: str | Path, train_size: int = 400,
                    dev_size: int = 200, min_words: int = 6, seed: int = 0) -> dict:
  """Writes OUT/<GLUE directory>/train.tsv and dev.tsv (MNLI: dev_matched.tsv and
  dev_mismatched.tsv) for the nine tasks and OUT/glue_tasks.json; returns the summary."""
  articles = _articles(source, min_words)
  if len(articles) < 8:
    raise ValueError(f"{source}: {len(articles)} articles with 4+ sentences of {min_words}+ "
                     "words; the GLUE tasks need 8")
  rng = random.Random(seed)
  order = list(range(len(articles)))
  rng.shuffle(order)
  # Articles by split: train, dev (matched), and a held-out quarter for MNLI-mismatched.
  quarter = max(len(order) // 4, 2)
  splits = {"mismatched": [articles[i] for i in order[:quarter]],
            "dev": [articles[i] for i in order[quarter:2 * quarter]],
            "train": [articles[i] for i in order[2 * quarter:]]}
  out = Path(out_dir)
  counts = {}
  # Each file where `bertjax eval glue` reads it (bertjax.finetune.suites): its articles, size.
  sizes = {"train": ("train", train_size), "dev": ("dev", dev_size),
           "second_dev": ("mismatched", dev_size)}
  for task, suite_task in suites.GLUE.items():
    for kind, path in suite_task.files(out).items():
      split, size = sizes[kind]
      pool = splits[split]
      if task == "sst2":
        # The two classes are the two longest training articles: train draws from the first
        # half of their sentences, dev from the second.
        two = sorted(splits["train"], key=len, reverse=True)[:2]
        pool = [a[:len(a) // 2] if split == "train" else a[len(a) // 2:] for a in two]
      examples = _examples(task, pool, size, rng)
      header, rows = _rows(task, examples)
      _write(path, header, rows)
      counts[path.relative_to(out).as_posix()] = len(rows)
  summary = {"source": source, "articles": {k: len(v) for k, v in splits.items()},
             "files": counts, "seed": seed, "min_words": min_words}
  (out / "glue_tasks.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary
