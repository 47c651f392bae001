"""A labelled task made from a corpus: which of K articles does a sentence come from?

The transfer experiment (docs/finetuning.md) needs a small supervised task built from data the
project ships: the K articles of the corpus with the most sentences (of at least `min_words` words)
become the classes, each contributes the same number of sentences, shuffled with a seed; the dev set
takes `dev_per_article` sentences of each, and training sets of the requested sizes are nested
prefixes of the rest (train_100 is inside train_1000), balanced across classes. Written as
GLUE-style TSV (`sentence`, `label`) that `bertjax finetune` reads as it is.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from bertjax.data.sentences import split_sentences
from bertjax.data.sources import SkipCounts, parse_sources, read_source


def make_article_task(source: str, out_dir: str | Path, num_articles: int = 4,
                      train_sizes: Sequence[int] = (100, 1000), dev_per_article: int = 100,
                      min_words: int = 5, seed: int = 0) -> dict:
  """Writes OUT/train_<n>.tsv for each n, OUT/dev.tsv and OUT/task.json; returns the summary."""
  sentences: dict[str, list[str]] = {}
  for spec in parse_sources(source):
    for doc in read_source(spec, SkipCounts()):
      found = [s for p in doc.paragraphs
               for s in ([p] if doc.sentences_given else split_sentences(p))
               if len(s.split()) >= min_words and "\t" not in s]
      sentences[doc.id] = found
  largest = sorted(sentences, key=lambda k: (-len(sentences[k]), k))[:num_articles]
  if len(largest) < num_articles:
    raise ValueError(f"{source}: {len(largest)} documents, {num_articles} articles asked for")
  per_article = max(train_sizes) // num_articles + dev_per_article
  short = [k for k in largest if len(sentences[k]) < per_article]
  if max(train_sizes) % num_articles or any(n % num_articles for n in train_sizes):
    raise ValueError(f"train sizes {list(train_sizes)} must divide by {num_articles} articles")
  if short:
    raise ValueError(f"{source}: articles {short} have fewer than the {per_article} sentences "
                     "a balanced split needs")
  rng = random.Random(seed)
  picked = {}
  for label, key in enumerate(largest):
    chosen = list(sentences[key])
    rng.shuffle(chosen)
    picked[label] = chosen[:per_article]
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)

  def write(name: str, rows: list[tuple[str, int]]) -> None:
    rng.shuffle(rows)
    lines = ["sentence\tlabel"] + [f"{s}\t{label}" for s, label in rows]
    (out / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

  write("dev.tsv", [(s, label) for label, ss in picked.items() for s in ss[:dev_per_article]])
  for n in train_sizes:
    k = n // num_articles
    write(f"train_{n}.tsv", [(s, label) for label, ss in picked.items()
                             for s in ss[dev_per_article:dev_per_article + k]])
  summary = {"source": source, "articles": {str(i): k for i, k in enumerate(largest)},
             "sentences_per_article": {k: len(sentences[k]) for k in largest},
             "train_sizes": list(train_sizes), "dev": dev_per_article * num_articles,
             "min_words": min_words, "seed": seed}
  (out / "task.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary
