"""`bertjax data build` behaviour a user feeding real corpora meets: exact-duplicate removal,
builds that yield nothing (one line, exit status 2, the skip counts), per-source sentence
languages and the options recorded in dataset.json."""

from __future__ import annotations

import gzip
import json

import pytest

from bertjax import cli
from bertjax.data import multistream, records
from bertjax.data.shards import ShardRecords
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions
from bertjax.data.errors import CorpusError
from bertjax.data.sources import parse_sources

WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture
def vocab(tmp_path):
  path = tmp_path / "vocab.txt"
  path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "т", "г"]
                            + WORDS) + "\n")
  return path


def _story(n: int) -> str:
  return " ".join(WORDS[(n * 7 + k) % 60] for k in range(12)) + " ."


def _documents(built) -> list[tuple[str, int]]:
  """(key, tokens) of every record of every shard, in shard order."""
  dataset = records.BuiltDataset.open(built)
  out = []
  for name in dataset.source_names:
    for split in records.SPLITS:
      for path in dataset.shard_paths(name, split):
        for record in ShardRecords([path]):
          doc = records.decode_record(record)
          out.append((doc.key, sum(len(s) for s in doc.sentences())))
  return out


def test_exact_duplicates_are_dropped_and_counted(tmp_path, vocab):
  """A news corpus repeats stories verbatim: the first copy stays, later ones are counted;
  --keep-duplicates keeps them; duplicates across files of a source count too."""
  lines = [_story(n) for n in range(30)]
  lines += [lines[3], lines[7], lines[3], "  " + lines[9] + "  "]  # the last one once stripped
  (tmp_path / "news").mkdir()
  (tmp_path / "news" / "a.txt").write_text("\n".join(lines) + "\n")
  (tmp_path / "news" / "b.txt.gz").write_bytes(gzip.compress((lines[0] + "\n").encode()))
  source = parse_sources(f"lines:{tmp_path / 'news'}")
  summary = build_dataset(source, vocab, tmp_path / "dedup", BuildOptions(num_shards=2,
                                                                         eval_fraction=0.0))
  assert summary.counts["news"]["train"]["documents"] == 30
  assert summary.skips["news"] == {"duplicate document": 5}
  keys = [key for key, _ in _documents(tmp_path / "dedup")]
  assert "news:news/a.txt:4" in keys and "news:news/a.txt:31" not in keys
  assert "news:news/b.txt.gz:1" not in keys  # a copy of a.txt's first line
  kept = build_dataset(source, vocab, tmp_path / "kept",
                       BuildOptions(num_shards=2, eval_fraction=0.0, dedup=False))
  assert kept.counts["news"]["train"]["documents"] == 35 and not kept.skips["news"]
  assert json.loads((tmp_path / "kept" / "dataset.json").read_text())["dedup"] is False


def _zero_document_cases(tmp_path):
  (tmp_path / "empty.txt").write_bytes(b"")
  (tmp_path / "latin.txt").write_bytes("Café crème.\nNaïve.\n".encode("latin-1"))
  (tmp_path / "long.txt").write_text("x" * 5000 + "\n")
  (tmp_path / "bad.jsonl").write_text("\n".join("{not json" for _ in range(300)) + "\n")
  return {
      "empty file": (f"text:{tmp_path / 'empty.txt'}", r"empty file: 1"),
      "all latin-1": (f"text:{tmp_path / 'latin.txt'}",
                      r"empty document: 1, invalid UTF-8 line: 2"),
      "one over-long line": (f"lines:{tmp_path / 'long.txt'}?max_line_bytes=1000",
                             r"line too long: 1"),
      "malformed JSON": (f"jsonl:{tmp_path / 'bad.jsonl'}", r"malformed JSON line: 300"),
  }


@pytest.mark.parametrize("case", ["empty file", "all latin-1", "one over-long line",
                                  "malformed JSON"])
def test_a_build_that_yields_no_documents_exits_2_with_the_skips(tmp_path, vocab, capsys,
                                                                 case):
  """Each of these once exited 0 with an empty dataset; the failure surfaced at training."""
  spec, skips = _zero_document_cases(tmp_path)[case]
  with pytest.raises(CorpusError, match=rf"no documents \(skipped: {skips}\)"):
    build_dataset(parse_sources(spec), vocab, tmp_path / "api", BuildOptions(num_shards=1))
  status = cli.main(["data", "build", "--source", spec, "--tokenizer", str(vocab),
                     "--out", str(tmp_path / "cli"), "--num-shards", "1"])
  err = capsys.readouterr().err.strip()
  assert status == 2 and len(err.splitlines()) == 1, err
  assert "no documents (skipped: " in err and "Traceback" not in err


def test_a_build_of_pages_that_all_clean_away_exits_2(tmp_path, vocab):
  """Pages read but left without prose by the cleaner (the "read" count is not zero, the
  written one is) are no documents either."""
  page = ("<page><title>T{0}</title><ns>0</ns><id>{0}</id><revision><text>{{{{Infobox {0}}}}}"
          "\n[[Category:Y]]</text></revision></page>")
  (tmp_path / "dump.xml").write_text("<mediawiki>" + "".join(page.format(i) for i in (1, 2))
                                     + "</mediawiki>")
  with pytest.raises(CorpusError, match=r"no documents \(skipped: empty article: 2\)"):
    build_dataset(parse_sources(f"wikipedia:{tmp_path / 'dump.xml'}"), vocab, tmp_path / "o",
                  BuildOptions(num_shards=1))


def test_one_empty_source_of_several_is_named(tmp_path, vocab):
  (tmp_path / "good.txt").write_text("\n".join(_story(n) for n in range(5)) + "\n")
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(CorpusError, match=r"lines:.*empty\.txt: no documents \(skipped: empty "
                                        r"file: 1\)"):
    build_dataset(parse_sources(f"lines:{tmp_path / 'good.txt'},lines:{tmp_path / 'empty.txt'}"),
                  vocab, tmp_path / "o", BuildOptions(num_shards=1, eval_fraction=0.0))


def test_per_source_language_splits_sentences_and_is_recorded(tmp_path, vocab, monkeypatch):
  """Each source's paragraphs are split with its own language; the build's --language is the
  default of the sources that state none; dataset.json records each."""
  from bertjax.data import build
  seen = []
  real = build.split_sentences

  def spy(paragraph, language):
    seen.append((paragraph.split()[0], language))
    return real(paragraph, language)

  monkeypatch.setattr(build, "split_sentences", spy)
  (tmp_path / "en.txt").write_text("w1 w2 . w3 w4 .\n")
  (tmp_path / "bg.txt").write_text("w5 т . г w6 .\n")
  specs = parse_sources(f"text:{tmp_path / 'en.txt'},text:{tmp_path / 'bg.txt'}?language=bg")
  build_dataset(specs, vocab, tmp_path / "o", BuildOptions(num_shards=1, eval_fraction=0.0,
                                                           language="de"))
  assert seen == [("w1", "de"), ("w5", "bg")]
  meta = json.loads((tmp_path / "o" / "dataset.json").read_text())
  assert [(s["name"], s["language"], s["weight"]) for s in meta["sources"]] == [
      ("en.txt", "de", None), ("bg.txt", "bg", None)]


def _shard_bytes(built) -> dict[str, bytes]:
  return {str(p.relative_to(built)): p.read_bytes()
          for p in sorted(built.glob("*/*-of-*.*"))}


@pytest.mark.slow
@pytest.mark.parametrize("with_index", [True, False])
def test_a_multistream_dump_is_shared_out_by_bytes(tmp_path, vocab, with_index):
  """The embedded sample as a genuine multistream dump (10 pages per bz2 stream, index or
  none): 2 build processes x 2 workers each read only their shards' streams — the byte ranges
  they report are disjoint and together the whole file, each byte read once with the index —
  and write shards identical bit for bit to a serial build's; the pages are those of the
  single-stream dump."""
  from tests.multistream_dump import write_multistream_dump
  dump = write_multistream_dump(tmp_path / "dump", pages_per_stream=10, with_index=with_index)
  source = parse_sources(f"wikipedia:{dump}?name=wiki")
  options = BuildOptions(num_shards=4, eval_fraction=0.05)
  serial = build_dataset(source, vocab, tmp_path / "serial", options)
  for p in range(2):
    build_dataset(source, vocab, tmp_path / "parallel", BuildOptions(
        num_shards=4, eval_fraction=0.05, process_index=p, process_count=2, num_workers=2))
  assert _shard_bytes(tmp_path / "parallel") == _shard_bytes(tmp_path / "serial")
  assert len(_shard_bytes(tmp_path / "serial")) == 3 * 8  # records, offsets, token counts

  size = dump.stat().st_size
  reads = [json.loads((tmp_path / "parallel" / "parts" / f"process-{p}.json").read_text())
           ["read"]["wiki"] for p in range(2)]
  ranges = sorted(tuple(r) for read in reads for r in read["ranges"])
  assert ranges[0][0] == 0 and ranges[-1][1] == size
  assert all(a[1] >= b[0] for a, b in zip(ranges, ranges[1:]))  # no byte read by neither
  assert all(read["bytes"] < size * 0.75 for read in reads)  # each read its share only
  if with_index:  # each byte exactly once
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(read["bytes"] for read in reads) == size
  else:  # a scan for the next stream start reads past a slice's end, at most one chunk
    overlap = sum(max(0, a[1] - b[0]) for a, b in zip(ranges, ranges[1:]))
    assert overlap <= len(ranges) * multistream.SCAN_CHUNK

  whole = build_dataset(parse_sources("embedded?name=wiki"), vocab, tmp_path / "whole", options)
  assert sorted(k for k, _ in _documents(tmp_path / "serial")) == sorted(
      k for k, _ in _documents(tmp_path / "whole"))
  assert serial.counts == whole.counts
  assert serial.skips["wiki"] == whole.skips["wiki"]


def test_command_line_options_of_this_round(tmp_path, vocab, capsys):
  """--keep-duplicates reaches the build; tokenizer train's --language is checked before any
  reading and its --character-coverage reaches the trainer (recorded next to the model)."""
  (tmp_path / "news.txt").write_text("\n".join([_story(1), _story(2), _story(1)]) + "\n")
  assert cli.main(["data", "build", "--source", f"lines:{tmp_path / 'news.txt'}",
                   "--tokenizer", str(vocab), "--out", str(tmp_path / "kept"),
                   "--eval-fraction", "0", "--keep-duplicates"]) == 0
  assert "news.txt/train: 3 documents" in capsys.readouterr().out
  status = cli.main(["tokenizer", "train", "--source", f"lines:{tmp_path / 'news.txt'}",
                     "--language", "xx", "--vocab-size", "100", "--out", str(tmp_path / "t")])
  err = capsys.readouterr().err
  assert status == 2 and "language 'xx'" in err and len(err.strip().splitlines()) == 1
  sentences = "\n".join(f"{_story(n)} Ёж {n} „цитат“." for n in range(200)) + "\n"
  (tmp_path / "mixed.txt").write_text(sentences)
  assert cli.main(["tokenizer", "train", "--source", f"lines:{tmp_path / 'mixed.txt'}",
                   "--vocab-size", "45", "--character-coverage", "1.0",
                   "--out", str(tmp_path / "spm")]) == 0
  record = json.loads((tmp_path / "spm" / "bertjax_tokenizer.json").read_text())
  assert record["training"]["character_coverage"] == 1.0
  from bertjax.data.tokenizers import load_tokenizer
  assert 1 not in load_tokenizer(tmp_path / "spm").encode("Ёж „цитат“")  # no [UNK]
