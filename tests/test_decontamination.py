"""Decontamination at build time (bertjax.data.decontamination, `data build --decontaminate`):
the n-gram boundary cases, the hashed index against a plain set of word tuples, the evaluation
set formats and their errors, and builds — single-process, 2 processes x 2 workers, a
multistream dump — that drop and count exactly the documents holding an evaluation n-gram."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from bertjax import cli
from bertjax.data import records
from bertjax.data.shards import ShardRecords
from bertjax.data.build import build_dataset
from bertjax.data.decontamination import NgramIndex, eval_texts, words
from bertjax.data.errors import CorpusError
from bertjax.data.options import BuildOptions
from bertjax.data.sources import parse_sources

EVAL = ("alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike "
        "november oscar papa quebec romeo sierra tango")  # 20 words
W = EVAL.split()
SECOND = "uniform victor whiskey xray yankee zulu one two three four five six seven eight"


def _reference(eval_texts_: list[str], documents: list[str], n: int) -> list[bool]:
  """Whether each document shares an n-gram with an evaluation text: Python tuples, no hash."""
  grams = set()
  for t in eval_texts_:
    w = words(t)
    grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
  out = []
  for d in documents:
    w = words(d)
    out.append(any(tuple(w[i:i + n]) in grams for i in range(len(w) - n + 1)))
  return out


BOUNDARY_CASES = {
    # 13 consecutive words of the evaluation text, inside other words.
    "13 shared words": (f"some words first {' '.join(W[3:16])} and after", True),
    "12 shared words": (f"some words first {' '.join(W[3:15])} and after", False),
    "13 words with one missing": (f"{' '.join(W[3:15])} {W[16]} {W[17]}", False),
    "at the document's start": (f"{' '.join(W[0:13])} then other words", True),
    "at the document's end": (f"other words then {' '.join(W[7:20])}", True),
    "exactly the 13 words": (" ".join(W[0:13]), True),
    "case, punctuation and spacing": (
        "Alpha, BRAVO; charlie-delta  echo\tfoxtrot (golf) hotel: India's? juliett kilo lima "
        "MIKE!", False),  # "India's" is two words: india, s — the 13-gram is broken
    "case and punctuation": (
        "ALPHA, Bravo... charlie; delta - echo \"foxtrot\" golf, hotel, india, juliett. kilo! "
        "LIMA? mike", True),
    "across a paragraph": (f"{' '.join(W[2:9])}.\n\n{' '.join(W[9:15])} after", True),
    "across two evaluation texts": (f"{' '.join(W[13:20])} {' '.join(SECOND.split()[:6])}", False),
    "the second evaluation text": (f"x {SECOND} y", True),
}


@pytest.mark.parametrize("case", list(BOUNDARY_CASES))
def test_the_ngram_boundary_cases(case):
  """A document is dropped when it holds 13 consecutive words of one evaluation text, by
  words (case, punctuation, spacing and paragraphs do not count), and not for 12, a gap, or
  words running from one evaluation text into the next."""
  document, dropped = BOUNDARY_CASES[case]
  index = NgramIndex.from_texts([EVAL, SECOND], 13)
  assert index.contains(document) is dropped
  assert _reference([EVAL, SECOND], [document], 13) == [dropped]


def test_other_n_and_short_texts():
  index = NgramIndex.from_texts([EVAL], 5)
  assert index.contains(" ".join(W[10:15])) and not index.contains(" ".join(W[10:14]))
  short = NgramIndex.from_texts([" ".join(W[:12])], 13)  # under n words: no n-gram
  assert len(short) == 0 and not short.contains(EVAL)
  assert NgramIndex.from_texts([EVAL], 13).contains(EVAL.upper())


def test_the_hashed_index_decides_as_a_set_of_word_tuples():
  """Random texts over 8 words with n = 4, so most documents come near an evaluation
  n-gram: the index's decision equals the tuple set's for every document (no hash slip)."""
  rng = random.Random(0)
  vocab = [f"v{i}" for i in range(8)]
  evals = [" ".join(rng.choices(vocab, k=rng.randint(2, 12))) for _ in range(40)]
  docs = [" ".join(rng.choices(vocab, k=rng.randint(0, 30))) for _ in range(2000)]
  index = NgramIndex.from_texts(evals, 4)
  expected = _reference(evals, docs, 4)
  assert [index.contains(d) for d in docs] == expected
  assert 400 < sum(expected) < 1600  # both kinds of decision are exercised


def _eval_sets(tmp_path):
  """One evaluation set of each format; returns {name: path}."""
  from bertjax.finetune.squad import QAExample, write_squad
  sets = tmp_path / "evals"
  sets.mkdir()
  context = "The context says " + EVAL + " and more."
  write_squad([QAExample("q1", "What does it say after the first words of it all?", context,
                         [("alpha", context.index("alpha"))], title="T")], sets / "dev.json")
  glue = sets / "glue" / "MRPC"
  glue.mkdir(parents=True)
  (glue / "dev.tsv").write_text('Quality\t#1 ID\t#1 String\n1\t7\tHe said " one lone quote mark '
                                'and then nine more words to make it long\n')
  (sets / "prompts.jsonl").write_text(json.dumps({"prompt": "p " * 14, "meta": {"x": 1}})
                                      + "\n\n" + json.dumps(["list", "of", "strings"]) + "\n")
  (sets / "lambada.txt.gz").write_bytes(gzip.compress(
      b"line one\nthe second line of the plain text set has fifteen words in it as you see\n"))
  return {"squad": sets / "dev.json", "glue": sets / "glue", "jsonl": sets / "prompts.jsonl",
          "text": sets / "lambada.txt.gz"}


def test_evaluation_set_formats(tmp_path):
  sets = _eval_sets(tmp_path)
  squad = list(eval_texts(sets["squad"]))
  assert any(EVAL in t for t in squad) and "alpha" in squad and "T" in squad
  assert "What does it say after the first words of it all?" in squad
  glue = list(eval_texts(sets["glue"]))  # a task folder; a lone quote mark is text
  assert 'He said " one lone quote mark and then nine more words to make it long' in glue
  assert list(eval_texts(sets["jsonl"])) == ["p " * 14, "list", "of", "strings"]
  assert list(eval_texts(sets["text"])) == [
      "line one\n", "the second line of the plain text set has fifteen words in it as you see\n"]


def test_evaluation_set_errors(tmp_path):
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
  (tmp_path / "bad.json").write_text('{"data": [\n1,\n')
  (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
  (tmp_path / "short.txt").write_text("only a few words\nand a few more\n")
  (tmp_path / "empty").mkdir()
  cases = {"bad.jsonl": r"bad.jsonl:2: not a JSON line", "bad.json": r"bad.json: line 3: not JSON",
           "latin.txt": r"latin.txt: in its first lines: not UTF-8", "nothing": r"no such evaluation",
           "empty": r"no files", "short.txt": r"short.txt: no text of 13 or more words \(2 texts\)"}
  for name, message in cases.items():
    with pytest.raises(CorpusError, match=message):
      NgramIndex.from_eval_sets([tmp_path / name])


@pytest.fixture
def vocab(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + W
                            + [f"w{i}" for i in range(40)]) + "\n")
  return path


def _corpus(tmp_path):
  """60 JSONL documents of random filler; documents 3, 7 and 11 hold a 13-gram of the SQuAD,
  GLUE and JSONL evaluation sets, 15 holds only 12 words of one, 19 the 13 words split by a
  paragraph."""
  rng = random.Random(1)
  docs = [" ".join(f"w{rng.randrange(40)}" for _ in range(30)) + " ." for _ in range(60)]
  docs[3] += " " + " ".join(W[4:17]) + " ."
  docs[7] = "one lone quote mark and then nine more words to make it long , " + docs[7]
  docs[11] += " " + "p " * 13
  docs[15] += " " + " ".join(W[0:12]) + " ."
  docs[19] = " ".join(W[5:12]) + " .\n\n" + " ".join(W[12:18]) + " " + docs[19]
  (tmp_path / "corpus.jsonl").write_text(
      "".join(json.dumps({"text": d.replace("\n\n", "\n")}) + "\n" for d in docs))
  return docs


def _documents(built) -> dict[str, bytes]:
  dataset = records.BuiltDataset.open(built)
  out = {}
  for name in dataset.source_names:
    for split in records.SPLITS:
      for path in dataset.shard_paths(name, split):
        for record in ShardRecords([path]):
          out[records.decode_record(record).key] = record
  return out


def _shard_bytes(built) -> dict[str, bytes]:
  return {str(p.relative_to(built)): p.read_bytes()
          for p in sorted(built.glob("*/*-of-*.*"))}


def test_a_build_drops_and_counts_exactly_the_contaminated_documents(tmp_path, vocab, capsys):
  """Documents 3, 7, 11 and 19 are dropped and counted, the rest kept byte for byte as in a
  build without decontamination; 2 processes x 2 workers write the same shards; the command
  line prints each set's counts and records the index in dataset.json."""
  docs = _corpus(tmp_path)
  sets = _eval_sets(tmp_path)
  evals = [t for p in sets.values() for t in eval_texts(p)]
  expected = {f"corpus.jsonl:corpus.jsonl:{i + 1}"
              for i, hit in enumerate(_reference(evals, [d.replace("\n\n", "\n") for d in docs],
                                                 13)) if hit}
  assert expected == {f"corpus.jsonl:corpus.jsonl:{i}" for i in (4, 8, 12, 20)}
  source = parse_sources(f"jsonl:{tmp_path / 'corpus.jsonl'}")
  options = BuildOptions(num_shards=2, eval_fraction=0.1,
                         decontaminate=tuple(str(p) for p in sets.values()))
  summary = build_dataset(source, vocab, tmp_path / "clean", options)
  assert summary.skips["corpus.jsonl"] == {"contaminated document": 4}
  plain = build_dataset(source, vocab, tmp_path / "plain", BuildOptions(num_shards=2,
                                                                        eval_fraction=0.1))
  kept, everything = _documents(tmp_path / "clean"), _documents(tmp_path / "plain")
  assert set(everything) - set(kept) == expected
  assert all(kept[k] == everything[k] for k in kept)
  assert sum(c["documents"] for c in summary.counts["corpus.jsonl"].values()) == 56
  assert sum(c["documents"] for c in plain.counts["corpus.jsonl"].values()) == 60

  for p in range(2):
    build_dataset(source, vocab, tmp_path / "parallel", BuildOptions(
        num_shards=2, eval_fraction=0.1, process_index=p, process_count=2, num_workers=2,
        decontaminate=options.decontaminate))
  assert _shard_bytes(tmp_path / "parallel") == _shard_bytes(tmp_path / "clean")

  argv = ["data", "build", "--source", f"jsonl:{tmp_path / 'corpus.jsonl'}", "--tokenizer",
          str(vocab), "--out", str(tmp_path / "cli"), "--num-shards", "2"]
  for p in sets.values():
    argv += ["--decontaminate", str(p)]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "contaminated document: 4" in out
  _, stats = NgramIndex.from_eval_sets(sets.values())
  for s in stats:  # e.g. "dev.json: 7 texts, 8 13-grams (6 texts under 13 words give none)"
    assert "decontaminated against " + s.line(13) in out
  meta = json.loads((tmp_path / "cli" / "dataset.json").read_text())["decontamination"]
  assert meta["ngram"] == 13 and [e["path"] for e in meta["eval_sets"]] == [
      str(p) for p in sets.values()]
  assert meta["distinct_ngrams"] == len(NgramIndex.from_texts(evals, 13))
  assert "decontamination" not in json.loads((tmp_path / "plain" / "dataset.json").read_text())


def test_a_bad_evaluation_set_is_one_line_and_exit_2(tmp_path, vocab, capsys):
  _corpus(tmp_path)
  (tmp_path / "short.txt").write_text("too short to hold an n-gram\n")
  for eval_set, message in ((tmp_path / "short.txt", "no text of 13 or more words"),
                            (tmp_path / "missing.json", "no such evaluation set")):
    status = cli.main(["data", "build", "--source", f"jsonl:{tmp_path / 'corpus.jsonl'}",
                       "--tokenizer", str(vocab), "--out", str(tmp_path / "o"),
                       "--decontaminate", str(eval_set)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and message in err, err
    assert str(eval_set) in err and "Traceback" not in err


@pytest.mark.slow
def test_wikipedia_articles_holding_an_eval_paragraph_are_dropped(tmp_path, vocab):
  """The embedded dump, single-stream and as a multistream dump read by 2 processes x 2
  workers: an evaluation set of one article's sentence (as a SQuAD context would be) drops
  exactly the articles whose cleaned text shares a 13-gram with it, the same in both."""
  from bertjax.data.wikipedia import EMBEDDED_DUMP, clean_page, read_pages
  from bertjax.data.errors import SkipCounts
  from tests.multistream_dump import write_multistream_dump
  articles = {}
  for page in read_pages(EMBEDDED_DUMP, SkipCounts()):
    article = clean_page(page)
    if article is not None:
      articles[page.id] = "\n".join(article.paragraphs)
  long_paragraphs = [(pid, p) for pid, text in articles.items() for p in text.split("\n")
                     if len(words(p)) > 40]
  pid, paragraph = long_paragraphs[len(long_paragraphs) // 2]
  eval_text = " ".join(paragraph.split()[5:30])
  (tmp_path / "eval.txt").write_text(eval_text + "\n")
  hits = _reference([eval_text], list(articles.values()), 13)
  expected = {f"wiki:{i}" for i, hit in zip(articles, hits) if hit}
  assert f"wiki:{pid}" in expected

  options = dict(num_shards=4, eval_fraction=0.05, decontaminate=(str(tmp_path / "eval.txt"),))
  single = build_dataset(parse_sources("embedded?name=wiki"), vocab, tmp_path / "single",
                         BuildOptions(**options))
  plain = build_dataset(parse_sources("embedded?name=wiki"), vocab, tmp_path / "plain",
                        BuildOptions(num_shards=4, eval_fraction=0.05))
  assert set(_documents(tmp_path / "plain")) - set(_documents(tmp_path / "single")) == expected
  assert single.skips["wiki"]["contaminated document"] == len(expected)
  assert plain.skips["wiki"].get("contaminated document") is None

  dump = write_multistream_dump(tmp_path / "dump", pages_per_stream=10, with_index=True)
  source = parse_sources(f"wikipedia:{dump}?name=wiki")
  serial = build_dataset(source, vocab, tmp_path / "serial", BuildOptions(**options))
  for p in range(2):
    build_dataset(source, vocab, tmp_path / "parallel", BuildOptions(
        **options, process_index=p, process_count=2, num_workers=2))
  assert _shard_bytes(tmp_path / "parallel") == _shard_bytes(tmp_path / "serial")
  assert set(_documents(tmp_path / "serial")) == set(_documents(tmp_path / "single"))
  assert serial.skips["wiki"] == single.skips["wiki"]


@pytest.mark.slow
def test_the_qa_sets_articles_leave_a_build_decontaminated_against_its_dev_set(tmp_path, vocab,
                                                                                capsys):
  """`bertjax data qa-task` writes a SQuAD dev set from 15 articles of the embedded corpus:
  a build of that corpus decontaminated against it drops exactly those 15 articles (the
  train set's articles, and every other, stay)."""
  assert cli.main(["data", "qa-task", "--source", "embedded", "--out", str(tmp_path / "qa")]) == 0
  task = json.loads((tmp_path / "qa" / "task.json").read_text())
  capsys.readouterr()
  for out, extra in (("plain", []), ("clean", ["--decontaminate",
                                               str(tmp_path / "qa" / "dev-v1.1.json")])):
    assert cli.main(["data", "build", "--source", "embedded", "--tokenizer", str(vocab),
                     "--out", str(tmp_path / out)] + extra) == 0
  assert "contaminated document: 15," in capsys.readouterr().out
  dropped = set(_documents(tmp_path / "plain")) - set(_documents(tmp_path / "clean"))
  assert dropped == {f"embedded:{a}" for a in task["dev"]["articles"]}
  assert len(dropped) == 15 and not dropped & {f"embedded:{a}" for a in task["train"]["articles"]}
