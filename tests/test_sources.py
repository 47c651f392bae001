"""Corpus readers (`bertjax.data.sources`): every kind on small real-format fixtures, the spec
syntax, and each kind of bad input (a clear CorpusError, or a counted and logged skip)."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import os
import re
import sys
import tracemalloc

import pytest

from bertjax.data import corpus_files, sources
from bertjax.data.errors import CorpusError, SkipCounts
from bertjax.data.sources import SourceSpec, TextDocument, format_source, parse_source, read_source


def _read(spec: str | SourceSpec, skips: SkipCounts | None = None) -> list[TextDocument]:
  spec = parse_source(spec) if isinstance(spec, str) else spec
  return list(read_source(spec, SkipCounts() if skips is None else skips))


def _write(path, data: str | bytes) -> str:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data.encode() if isinstance(data, str) else data)
  return str(path)


BOOK = "Chapter One\n\nIt was a dark\nand stormy night.\n\n\n  The end.  \n"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10" + bytes(range(256)) * 4
ELF = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 64 + os.urandom(512)


# --------------------------------------------------------------------------- kinds


def test_text_books_directory_tree(tmp_path):
  books = tmp_path / "books"
  _write(books / "b.txt", BOOK)
  _write(books / "a.txt", "Only one paragraph\nover two lines.\n")
  _write(books / "sub" / "c.txt.gz", gzip.compress(b"Compressed book.\n\nSecond part.\n"))
  _write(books / "notes.md", "not a book\n")
  _write(books / ".hidden.txt", "editor backup\n")
  docs = _read(f"text:{books}")
  assert [d.id for d in docs] == ["books/a.txt", "books/b.txt", "books/sub/c.txt.gz"]
  assert docs[0].paragraphs == ("Only one paragraph over two lines.",)
  assert docs[1].paragraphs == ("Chapter One", "It was a dark and stormy night.", "The end.")
  assert docs[2].paragraphs == ("Compressed book.", "Second part.")
  assert not any(d.sentences_given for d in docs)
  assert _read(f"text:{books}") == docs  # deterministic
  single = _read(f"text:{books / 'b.txt'}")
  assert [d.id for d in single] == ["b.txt"] and single[0].paragraphs == docs[1].paragraphs


def test_bert_lines_documents_and_many_files_in_order(tmp_path):
  corpus = tmp_path / "bert"
  _write(corpus / "part-000.txt",
         "First sentence of doc one.\nSecond sentence.\n\n\n  \nDoc two, sentence one.\n")
  for i in range(1, 30):  # written in reverse, read back sorted
    _write(corpus / f"part-{30 - i:03d}.txt", f"Sentence of file {30 - i}.\n")
  docs = _read(f"bert_lines:{corpus}")
  assert docs[0] == TextDocument("bert/part-000.txt:1", ("First sentence of doc one.",
                                                        "Second sentence."), True)
  assert docs[1] == TextDocument("bert/part-000.txt:6", ("Doc two, sentence one.",), True)
  assert [d.id for d in docs[2:]] == [f"bert/part-{i:03d}.txt:1" for i in range(1, 30)]
  assert [d.paragraphs for d in docs[2:]] == [(f"Sentence of file {i}.",) for i in range(1, 30)]
  assert all(d.sentences_given for d in docs)


def _doc_block(page_id: int, title: str, lines: list[str]) -> str:
  body = "".join(f"{line}\n" for line in lines)
  return (f'<doc id="{page_id}" url="https://en.wikipedia.org/wiki?curid={page_id}" '
          f'title="{title}">\n{title}\n\n{body}</doc>\n')


def test_wikiextractor_doc_form_tree_with_bz2(tmp_path):
  out = tmp_path / "extracted"
  _write(out / "AA" / "wiki_00",
         _doc_block(12, "Anarchism", ["Anarchism is a political philosophy.",
                                      "It is sceptical of authority &amp; hierarchy."])
         + _doc_block(25, "Autism", ["Autism is a condition."]))
  _write(out / "AA" / "wiki_01", _doc_block(39, "Albedo", []))  # a title-only page
  _write(out / "AB" / "wiki_00.bz2", bz2.compress(
      _doc_block(290, "A", ["A is the first letter."]).encode()))
  skips = SkipCounts()
  docs = _read(f"wikiextractor:{out}", skips)
  assert [d.id for d in docs] == ["12", "25", "290"]
  assert docs[0].paragraphs == ("Anarchism is a political philosophy.",
                                "It is sceptical of authority & hierarchy.")
  assert docs[2].paragraphs == ("A is the first letter.",)
  assert skips.counts == {"empty document": 1}


def test_wikiextractor_json_form(tmp_path):
  lines = [{"id": "12", "url": "u", "title": "Anarchism",
            "text": "Anarchism is a philosophy.\n\nIt rejects &lt;rulers&gt;."},
           {"id": "25", "url": "u", "title": "Autism", "text": "Autism\nAutism is a condition."},
           {"id": "39", "url": "u", "title": "Albedo", "text": ""}]
  path = _write(tmp_path / "wiki_00", "".join(json.dumps(r) + "\n" for r in lines))
  skips = SkipCounts()
  docs = _read(f"wikiextractor:{path}", skips)
  assert docs == [TextDocument("12", ("Anarchism is a philosophy.", "It rejects <rulers>.")),
                  TextDocument("25", ("Autism is a condition.",))]  # leading title dropped
  assert skips.counts == {"empty document": 1}


def test_wikiextractor_bad_structure_is_counted(tmp_path, caplog):
  path = _write(tmp_path / "wiki_00",
                _doc_block(1, "Kept", ["Kept text."]) + "stray line\n"
                + '<doc id="2" url="u" title="Cut">\nCut\nno end tag\n'
                + _doc_block(3, "Also kept", ["More text."])
                + '<doc id="4" url="u" title="Truncated">\nTruncated\ncut off\n')
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    docs = _read(f"wikiextractor:{path}", skips)
  assert [d.id for d in docs] == ["1", "3"]
  assert skips.counts == {"line outside <doc>": 1, "unterminated document": 2}
  assert f"{path}:6: line outside <doc>" in caplog.text
  assert f"{path}:7: unterminated document" in caplog.text
  not_wiki = _write(tmp_path / "other" / "wiki_00", "plain prose\n")
  with pytest.raises(CorpusError, match=r"wiki_00:1: not WikiExtractor output"):
    _read(f"wikiextractor:{not_wiki}")


def test_jsonl_fields_ids_compression_and_glob(tmp_path):
  rows = [{"content": "Para one.\nPara two.", "key": 7}, {"content": "Solo."}]
  data = "".join(json.dumps(r) + "\n" for r in rows) + "\n"
  _write(tmp_path / "x" / "a.jsonl", data)
  _write(tmp_path / "x" / "b.jsonl.gz", gzip.compress(data.encode()))
  _write(tmp_path / "x" / "c.jsonl.bz2", bz2.compress(data.encode()))
  skips = SkipCounts()
  docs = _read(f"jsonl:{tmp_path}/x/*.jsonl*?text_field=content", skips)
  assert [d.id for d in docs] == [f"x/{name}:{line}" for name in
                                  ("a.jsonl", "b.jsonl.gz", "c.jsonl.bz2") for line in (1, 2)]
  assert docs[0].paragraphs == ("Para one.", "Para two.") and docs[1].paragraphs == ("Solo.",)
  assert skips.counts == {}
  skips = SkipCounts()
  keyed = _read(f"jsonl:{tmp_path}/x/a.jsonl?text_field=content&id_field=key", skips)
  assert [d.id for d in keyed] == ["7", "a.jsonl:2"]
  assert skips.counts == {"missing id field": 1}


def test_jsonl_bad_lines_are_counted_with_positions(tmp_path, caplog):
  path = _write(tmp_path / "c.jsonl", '{"text": "good one"}\n{"text": "unclosed\n[1, 2]\n'
                '{"title": "no text"}\n{"text": null}\n{"text": "  \\n "}\n{"text": "good two"}\n')
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    docs = _read(f"jsonl:{path}", skips)
  assert [d.id for d in docs] == ["c.jsonl:1", "c.jsonl:7"]
  assert skips.counts == {"malformed JSON line": 2, "missing text field": 2, "empty document": 1}
  for line, reason in [(2, "malformed JSON line"), (3, "malformed JSON line"),
                       (4, "missing text field"), (6, "empty document")]:
    assert f"{path}:{line}: {reason}" in caplog.text


def test_parquet_batches_columns_and_ids(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  texts = [f"Row {i} first line.\nRow {i} second line." for i in range(2500)]  # > one batch
  texts[3], texts[4] = None, " \n "
  table = pa.table({"body": texts, "doc": [f"d{i}" for i in range(2500)],
                    "n": list(range(2500))})
  (tmp_path / "p").mkdir()
  pq.write_table(table, tmp_path / "p" / "a.parquet", row_group_size=700)
  pq.write_table(table.slice(0, 2), tmp_path / "p" / "b.parquet")
  skips = SkipCounts()
  docs = _read(f"parquet:{tmp_path}/p?text_field=body", skips)
  assert len(docs) == 2498 + 2
  assert docs[0] == TextDocument("p/a.parquet:0", ("Row 0 first line.", "Row 0 second line."))
  assert docs[3].id == "p/a.parquet:5" and docs[2497].id == "p/a.parquet:2499"
  assert [d.id for d in docs[-2:]] == ["p/b.parquet:0", "p/b.parquet:1"]
  assert skips.counts == {"missing text field": 1, "empty document": 1}
  keyed = _read(f"parquet:{tmp_path}/p/*.parquet?text_field=body&id_field=doc")
  assert [d.id for d in keyed[:3]] == ["d0", "d1", "d2"]
  with pytest.raises(CorpusError, match=r"a\.parquet: no column 'text'; columns: body, doc, n"):
    _read(f"parquet:{tmp_path}/p")
  with pytest.raises(CorpusError, match=r"column 'n' holds int64, not strings"):
    _read(f"parquet:{tmp_path}/p?text_field=n")
  whole = (tmp_path / "p" / "a.parquet").read_bytes()
  cut = _write(tmp_path / "cut" / "a.parquet", whole[:len(whole) // 2])
  with pytest.raises(CorpusError, match=r"cut/a\.parquet: not a readable Parquet file"):
    _read(f"parquet:{cut}?text_field=body")
  fake = _write(tmp_path / "fake.parquet", "just text, no footer\n")
  with pytest.raises(CorpusError, match=r"fake\.parquet: not a readable Parquet file"):
    _read(f"parquet:{fake}")


def _wiki_dump(pages: list[tuple[int, str, str]]) -> bytes:
  body = "".join(f"<page><title>{t}</title><ns>0</ns><id>{i}</id><revision><id>1</id>"
                 f"<text xml:space=\"preserve\">{text}</text></revision></page>\n"
                 for i, t, text in pages)
  return (f'<?xml version="1.0" encoding="utf-8"?>\n<mediawiki xmlns="http://www.mediawiki.org/'
          f'xml/export-0.10/" version="0.10">\n{body}</mediawiki>\n').encode()


def test_wikipedia_dump_files_and_directory(tmp_path):
  _write(tmp_path / "dumps" / "part1.xml.bz2", bz2.compress(_wiki_dump(
      [(10, "Foo", "'''Foo''' is a [[bar|thing]].\n\nMore about foo."),
       (11, "Redirect", "#REDIRECT [[Foo]]")])))
  _write(tmp_path / "dumps" / "part2.xml", _wiki_dump([(12, "Baz", "Baz is baz.")]))
  _write(tmp_path / "dumps" / "part3.xml", b"")
  skips = SkipCounts()
  docs = _read(f"wikipedia:{tmp_path / 'dumps'}", skips)
  assert docs == [TextDocument("10", ("Foo is a thing.", "More about foo.")),
                  TextDocument("12", ("Baz is baz.",))]
  assert skips.counts == {"redirect": 1, "empty file": 1}


@pytest.fixture(scope="module")
def embedded():
  skips = SkipCounts()
  return list(read_source(parse_source("embedded"), skips)), skips


def test_embedded_dump(embedded):
  docs, skips = embedded
  # 206 pages: 97 articles, the rest redirects, disambiguations and the like, all counted.
  assert len(docs) >= 90 and len(docs) + sum(skips.counts.values()) == 206
  assert len({d.id for d in docs}) == len(docs) and all(d.id.isdigit() for d in docs)
  assert all(d.paragraphs and all(p.strip() for p in d.paragraphs) for d in docs)
  assert skips.counts["redirect"] > 0
  assert parse_source("wikipedia:embedded") == parse_source("embedded")


# --------------------------------------------------------------------------- tfds


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """A tiny TFDS dataset prepared in array_record format, without TensorFlow."""
  tfds = pytest.importorskip("tensorflow_datasets")

  # skip_registration: the dataset is then found only from its prepared files, as a dataset
  # prepared elsewhere would be.
  class BertjaxTinyCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"text": tfds.features.Text(), "title": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(5), "test": self._generate_examples(2)}

    def _generate_examples(self, n):
      for i in range(n):
        text = f"Document {i}.\n\nIts second paragraph."
        if i == 3:
          text = b"broken \xff bytes"
        elif i == 4:
          text = "\n  \n"
        yield i, {"text": text, "title": f"title-{i}"}

  data_dir = tmp_path_factory.mktemp("tfds")
  BertjaxTinyCorpus(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
  return str(data_dir)


def test_tfds_data_source(tfds_dir, caplog):
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    docs = _read(f"tfds:bertjax_tiny_corpus?data_dir={tfds_dir}", skips)
  assert skips.counts == {"invalid UTF-8 record": 1, "empty document": 1}
  # TFDS stores records shuffled; ids are positions in the stored order.
  assert sorted(d.paragraphs for d in docs) == [(f"Document {i}.", "Its second paragraph.")
                                                for i in range(3)]
  indices = [int(d.id.removeprefix("bertjax_tiny_corpus:train:")) for d in docs]
  assert indices == sorted(indices) and set(indices) < set(range(5))
  assert re.search(r"record \d: invalid UTF-8 record \(feature 'text', byte 7\)", caplog.text)
  titled = _read(f"tfds:bertjax_tiny_corpus?data_dir={tfds_dir}&id_field=title")
  assert [d.paragraphs[0] for d in titled] == [f"Document {d.id[-1]}." for d in titled]
  assert _read(f"tfds:bertjax_tiny_corpus?data_dir={tfds_dir}") == docs  # deterministic
  test_split = _read(f"tfds:bertjax_tiny_corpus?split=test&data_dir={tfds_dir}&id_field=title")
  assert sorted(d.id for d in test_split) == ["title-0", "title-1"]
  assert "tensorflow" not in sys.modules  # read through array_record, no TensorFlow
  with pytest.raises(CorpusError, match=r"no feature 'body'; features: text, title"):
    _read(f"tfds:bertjax_tiny_corpus?data_dir={tfds_dir}&text_field=body")
  with pytest.raises(CorpusError, match=r"tfds:bertjax_tiny_corpus split 'dev'.*cannot be opened"):
    _read(f"tfds:bertjax_tiny_corpus?split=dev&data_dir={tfds_dir}")
  with pytest.raises(CorpusError, match=r"tfds:no_such_corpus_xyz .*cannot be opened"):
    _read(f"tfds:no_such_corpus_xyz?data_dir={tfds_dir}")


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize("text, expected", [
    ("wikipedia:/data/enwiki.xml.bz2", SourceSpec("wikipedia", "/data/enwiki.xml.bz2")),
    ("text:/books@0.25", SourceSpec("text", "/books", weight=0.25, name="books")),
    ("jsonl:/x/*.jsonl?text_field=content",
     SourceSpec("jsonl", "/x/*.jsonl", text_field="content", name="x/*.jsonl")),
    ("jsonl:/x/doc?.jsonl@2?id_field=uid&max_line_bytes=4096",
     SourceSpec("jsonl", "/x/doc?.jsonl", weight=2.0, id_field="uid", max_line_bytes=4096)),
    ("tfds:wikipedia/20230601.en?split=train[:10%]&data_dir=/d",
     SourceSpec("tfds", "wikipedia/20230601.en", split="train[:10%]", data_dir="/d",
                name="wikipedia/20230601.en")),
    ("embedded@0.5", SourceSpec("wikipedia", "embedded", weight=0.5, name="embedded")),
    ("bert_lines:corpus/?weight=3&name=google", SourceSpec("bert_lines", "corpus/", 3.0,
                                                           name="google")),
    ("lines:/news/*.tsv.gz?id_separator=tab&encoding=latin-1&language=de",
     SourceSpec("lines", "/news/*.tsv.gz", id_separator="\t", encoding="latin-1",
                language="de", name="news/*.tsv.gz")),
    ("embedded?keep_lists=true&language=en",
     SourceSpec("wikipedia", "embedded", keep_lists=True, language="en")),
    ("text:/data/books, 2nd ed/@0.5", SourceSpec("text", "/data/books, 2nd ed/", weight=0.5)),
])
def test_parse_source_and_round_trip(text, expected):
  spec = parse_source(text)
  assert spec == expected
  assert parse_source(format_source(spec)) == spec


def test_bad_specs():
  with pytest.raises(ValueError, match=r"unknown source kind 'csv'; kinds: wikipedia, "
                                       r"wikiextractor, text, bert_lines, lines, jsonl, "
                                       r"parquet, tfds"):
    SourceSpec("csv", "/x")
  with pytest.raises(ValueError, match=r"KIND one of wikipedia, wikiextractor"):
    parse_source("csv:/x.csv")
  with pytest.raises(ValueError, match=r"unknown option 'textfield'; options: weight"):
    parse_source("jsonl:/x?text_field=a&textfield=a")
  # An unknown first option once became part of the path ("no such file /b?encodng=...").
  with pytest.raises(ValueError, match=r"unknown option 'encodng'"):
    parse_source("text:/books?encodng=latin-1")
  with pytest.raises(ValueError, match=r"unknown encoding 'latin-9x'"):
    parse_source("text:/books?encoding=latin-9x")
  with pytest.raises(ValueError, match=r"option encoding does not apply to parquet sources"):
    parse_source("parquet:/x?encoding=latin-1")
  with pytest.raises(ValueError, match=r"option keep_lists does not apply to text sources"):
    parse_source("text:/x?keep_lists=true")
  with pytest.raises(ValueError, match=r"keep_lists must be true or false"):
    parse_source("embedded?keep_lists=maybe")
  with pytest.raises(ValueError, match=r"language 'xx': sentencex has no sentence rules"):
    parse_source("text:/books?language=xx")
  assert parse_source("text:/books?language=bg_BG").language == "bg"
  with pytest.raises(ValueError, match=r"option text_field does not apply to text sources"):
    parse_source("text:/books?text_field=body")
  with pytest.raises(ValueError, match=r"weight must be positive"):
    parse_source("text:/books@0")
  with pytest.raises(ValueError, match=r"weight given twice"):
    parse_source("text:/books@1?weight=2")


def test_parse_sources_splits_only_before_a_kind():
  """A comma inside a path (a directory named "books, 2nd ed") no longer splits the spec; a
  list (repeated --source flags) gives one spec per item, each item split the same way."""
  specs = sources.parse_sources("text:/d/books, 2nd ed/@0.25,jsonl:/x.jsonl, embedded@2")
  assert [(s.kind, s.path, s.weight) for s in specs] == [
      ("text", "/d/books, 2nd ed/", 0.25), ("jsonl", "/x.jsonl", None),
      ("wikipedia", "embedded", 2.0)]
  assert sources.parse_sources(["text:/a,b", "embedded"]) == [
      SourceSpec("text", "/a,b"), SourceSpec("wikipedia", "embedded")]
  with pytest.raises(ValueError, match=r"no sources given"):
    sources.parse_sources("  ")


# --------------------------------------------------------------------------- new kinds/options


def test_lines_one_document_per_line_with_and_without_ids(tmp_path, caplog):
  """News-crawl style: each line is a document (the text reader made the whole file one
  document of thousands of sentences); an id column when asked for."""
  plain = _write(tmp_path / "news" / "2024.txt",
                 "First story. It has two sentences.\n\nSecond story.\n  Third story.  \n")
  docs = _read(f"lines:{plain}")
  assert [(d.id, d.paragraphs) for d in docs] == [
      ("2024.txt:1", ("First story. It has two sentences.",)),
      ("2024.txt:3", ("Second story.",)), ("2024.txt:4", ("Third story.",))]
  assert not any(d.sentences_given for d in docs)
  tsv = _write(tmp_path / "ids.tsv.gz", gzip.compress(
      "n-17\tA story with an id.\nno separator here\nn-18\t\nn-19\tLast one.\n".encode()))
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    docs = _read(f"lines:{tsv}?id_separator=tab", skips)
  assert [(d.id, d.paragraphs) for d in docs] == [("n-17", ("A story with an id.",)),
                                                  ("n-19", ("Last one.",))]
  assert skips.counts == {"missing id field": 1, "empty document": 1}
  assert f"{tsv}:2: missing id field" in caplog.text


def test_encoding_option_reads_latin1_and_utf16(tmp_path):
  """Without ?encoding= a latin-1 file's accented lines are skipped as invalid UTF-8; with
  it they are read. UTF-16 (NUL bytes: otherwise taken for binary) reads line by line."""
  text = "Café au lait.\nNaïve façade.\nplain ascii\n"
  latin = _write(tmp_path / "latin.txt", text.encode("latin-1"))
  skips = SkipCounts()
  assert [d.paragraphs for d in _read(f"lines:{latin}", skips)] == [("plain ascii",)]
  assert skips.counts == {"invalid UTF-8 line": 2}
  assert [d.paragraphs[0] for d in _read(f"lines:{latin}?encoding=latin-1")] == [
      "Café au lait.", "Naïve façade.", "plain ascii"]
  assert _read(f"text:{latin}?encoding=cp1252")[0].paragraphs == (
      "Café au lait. Naïve façade. plain ascii",)
  wide = _write(tmp_path / "bg.txt", "Здравей, свят.\n\nВтори ред.\n".encode("utf-16"))
  docs = _read(f"lines:{wide}?encoding=utf-16")
  assert [(d.id, d.paragraphs) for d in docs] == [("bg.txt:1", ("Здравей, свят.",)),
                                                  ("bg.txt:3", ("Втори ред.",))]
  # Bytes a codec cannot decode: the line is skipped and counted, the rest read.
  broken = _write(tmp_path / "broken.txt", "ok\n".encode("utf-16-le") + b"\x00\xd8\n\x00"
                  + "fine\n".encode("utf-16-le"))
  skips = SkipCounts()
  assert [d.paragraphs for d in _read(f"lines:{broken}?encoding=utf-16-le", skips)] == [
      ("ok",), ("fine",)]
  assert skips.counts == {"undecodable line": 1}
  cyrillic = _write(tmp_path / "ru.txt", "Привет, мир.\n".encode("cp1251"))
  assert _read(f"lines:{cyrillic}?encoding=cp1251")[0].paragraphs == ("Привет, мир.",)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", ["wikipedia", "wikiextractor", "text", "bert_lines", "jsonl",
                                  "parquet"])
def test_missing_path_and_empty_directory(tmp_path, kind):
  with pytest.raises(CorpusError, match=rf"{tmp_path}/nope: no such file or directory"):
    _read(SourceSpec(kind, str(tmp_path / "nope")))
  _write(tmp_path / "empty" / "readme.rst", "nothing to read\n")
  wanted = {"wikiextractor": "holds no WikiExtractor output files"}.get(kind, "holds no")
  if kind != "wikiextractor":  # WikiExtractor files have no suffix: any file is a candidate
    with pytest.raises(CorpusError, match=rf"{tmp_path}/empty: directory {wanted}"):
      _read(SourceSpec(kind, str(tmp_path / "empty")))
  (tmp_path / "void").mkdir()
  os.mkfifo(tmp_path / "void" / "pipe.txt")  # opening it would block: never a candidate
  with pytest.raises(CorpusError, match=rf"{tmp_path}/void: directory holds no"):
    _read(SourceSpec(kind, str(tmp_path / "void")))
  with pytest.raises(CorpusError, match=r"no files match this pattern"):
    _read(SourceSpec(kind, str(tmp_path / "void" / "*.none")))


def test_unreadable_file_and_directory(tmp_path):
  if os.geteuid() == 0:
    pytest.skip("running as root: chmod 000 does not stop root from reading")
  secret = tmp_path / "secret.txt"
  _write(secret, "text\n")
  locked = tmp_path / "locked"
  _write(locked / "a.txt", "text\n")
  secret.chmod(0)
  locked.chmod(0)
  try:
    with pytest.raises(CorpusError, match=rf"{secret}: cannot be read \(Permission denied\)"):
      _read(f"text:{secret}")
    with pytest.raises(CorpusError, match=rf"{locked}: directory cannot be read"):
      _read(f"jsonl:{locked}")
  finally:
    locked.chmod(0o755)


def test_permission_errors_become_corpus_errors(tmp_path, monkeypatch):
  """What chmod 000 does for a non-root user, raised directly so that root runs check it too."""
  _write(tmp_path / "d" / "a.txt", "text\n")

  def denied(path, *args, **kwargs):
    raise PermissionError(13, "Permission denied", str(path))

  monkeypatch.setattr(corpus_files, "open", denied, raising=False)  # the module's builtin open
  with pytest.raises(CorpusError, match=rf"{tmp_path}/d/a.txt: cannot be read \(Permission "
                                        rf"denied\)"):
    _read(f"text:{tmp_path / 'd'}")
  monkeypatch.undo()
  monkeypatch.setattr(corpus_files.os, "scandir", denied)
  with pytest.raises(CorpusError, match=rf"{tmp_path}/d: directory cannot be read \(Permission "
                                        rf"denied\)"):
    _read(f"text:{tmp_path / 'd'}")


def test_empty_files_and_empty_documents_are_counted(tmp_path, caplog):
  _write(tmp_path / "t" / "empty.txt", b"")
  _write(tmp_path / "t" / "blank.txt", "  \n\n \t\n")
  _write(tmp_path / "t" / "empty-gz.txt.gz", gzip.compress(b""))
  _write(tmp_path / "t" / "good.txt", "Words.\n")
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    assert [d.id for d in _read(f"text:{tmp_path / 't'}", skips)] == ["t/good.txt"]
  assert skips.counts == {"empty file": 2, "empty document": 1}
  assert f"{tmp_path / 't' / 'empty.txt'}: empty file" in caplog.text
  skips = SkipCounts()
  assert _read(f"bert_lines:{tmp_path / 't'}", skips)[0].id == "t/good.txt:1"
  assert skips.counts == {"empty file": 2, "empty document": 1}
  skips = SkipCounts()
  _write(tmp_path / "j" / "e.jsonl", b"")
  assert _read(f"jsonl:{tmp_path / 'j'}", skips) == []
  assert skips.counts == {"empty file": 1}
  skips = SkipCounts()
  _write(tmp_path / "p" / "e.parquet", b"")
  assert _read(f"parquet:{tmp_path / 'p'}", skips) == []
  assert skips.counts == {"empty file": 1}


def test_invalid_utf8_lines_are_skipped_and_named(tmp_path, caplog):
  path = _write(tmp_path / "latin1.txt",
                "First good line.\n".encode() + "Caf\xe9 in Latin-1.\n".encode("latin-1")
                + "Second good line.\n\nNext paragraph, caf\u00e9.\n".encode())
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    docs = _read(f"text:{path}", skips)
  assert docs[0].paragraphs == ("First good line. Second good line.", "Next paragraph, café.")
  assert skips.counts == {"invalid UTF-8 line": 1}
  assert f"{path}:2: invalid UTF-8 line (byte 3), skipped" in caplog.text


def test_many_bad_lines_log_only_the_first_few(tmp_path, caplog):
  path = _write(tmp_path / "bad.jsonl", "{oops\n" * 50 + '{"text": "fine"}\n')
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    assert len(_read(f"jsonl:{path}", skips)) == 1
  assert skips.counts == {"malformed JSON line": 50}
  assert caplog.text.count("malformed JSON line (") == corpus_files.WARNINGS_PER_REASON


def test_enormous_lines_are_skipped_with_bounded_memory(tmp_path, caplog):
  huge = tmp_path / "huge.txt"
  with open(huge, "wb") as f:
    f.write(b"Before the flood.\n")
    f.write(b"x" * (20 << 20) + b"\n")  # 20 MiB, one line
    f.write(b"After the flood.\n")
  skips = SkipCounts()
  tracemalloc.start()
  try:
    with caplog.at_level(logging.WARNING):
      docs = _read(f"text:{huge}", skips)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert docs[0].paragraphs == ("Before the flood. After the flood.",)
  assert skips.counts == {"line too long": 1}
  assert f"{huge}:2: line too long (over 1048576 bytes), skipped" in caplog.text
  assert peak < 6 << 20, f"peak {peak} bytes while skipping a 20 MiB line"
  no_newline = _write(tmp_path / "one.jsonl", b'{"text": "' + b"y" * (5 << 20))  # 5 MB, no \n
  skips = SkipCounts()
  assert _read(f"jsonl:{no_newline}", skips) == []
  assert skips.counts == {"line too long": 1}
  short = _write(tmp_path / "short.jsonl", '{"text": "tiny"}\n{"text": "' + "z" * 100 + '"}\n')
  skips = SkipCounts()
  assert [d.id for d in _read(f"jsonl:{short}?max_line_bytes=64", skips)] == ["short.jsonl:1"]
  assert skips.counts == {"line too long": 1}


def test_binary_files_are_skipped_or_rejected(tmp_path, caplog):
  _write(tmp_path / "mixed" / "a.txt", "Real text.\n")
  _write(tmp_path / "mixed" / "image.txt", PNG)
  _write(tmp_path / "mixed" / "program.txt", ELF)
  _write(tmp_path / "mixed" / "packed.txt.gz", gzip.compress(os.urandom(4096) + b"\0"))
  _write(tmp_path / "mixed" / "utf16.txt", "Hello\n".encode("utf-16"))
  skips = SkipCounts()
  with caplog.at_level(logging.WARNING):
    assert [d.id for d in _read(f"text:{tmp_path / 'mixed'}", skips)] == ["mixed/a.txt"]
  assert skips.counts == {"binary file": 4}
  assert f"{tmp_path / 'mixed' / 'image.txt'}: binary file (NUL bytes" in caplog.text
  assert "utf16.txt: binary file (UTF-16 text? read it with ?encoding=utf-16)" in caplog.text
  only = _write(tmp_path / "photo.jsonl", PNG)
  with pytest.raises(CorpusError, match=r"photo\.jsonl: binary, not text"):
    _read(f"jsonl:{only}")
  # gzip-compressed text is text: compression is recognised by its magic bytes
  packed = _write(tmp_path / "book.txt", gzip.compress(b"Packed prose.\n"))
  assert _read(f"text:{packed}")[0].paragraphs == ("Packed prose.",)


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress])
@pytest.mark.parametrize("kind", ["jsonl", "text", "wikiextractor"])
def test_truncated_archives_name_file_and_line(tmp_path, compress, kind):
  if kind == "wikiextractor":
    data = "".join(_doc_block(i, f"T{i}", [f"Line {i} {'w' * (i % 50)}."]) for i in range(4000))
  else:
    data = "".join(json.dumps({"text": f"Line {i} {'w' * (i % 50)}."}) + "\n"
                   for i in range(20000))
  packed = compress(data.encode())
  path = _write(tmp_path / ("corpus.txt" if kind == "text" else "corpus"),
                packed[:len(packed) // 2])
  with pytest.raises(CorpusError, match=rf"{path}: compressed data ends early — the archive is "
                                        rf"truncated \(at line \d+\)"):
    _read(SourceSpec(kind, path))


def test_corrupt_gzip_names_file_and_line(tmp_path):
  good = gzip.compress(b"".join(b"Line %d of the book.\n" % i for i in range(50000)))
  middle = len(good) // 2
  path = _write(tmp_path / "bad.txt.gz", good[:middle] + bytes(64) + good[middle + 64:])
  with pytest.raises(CorpusError, match=rf"{path}: cannot be read at line [1-9]\d+ "):
    _read(f"text:{path}")


def test_oversized_documents_are_cut_into_parts(tmp_path):
  paragraphs = [f"Paragraph {i} of a very long book." for i in range(40)]
  path = _write(tmp_path / "long.txt", "\n\n".join(paragraphs) + "\n")
  skips = SkipCounts()
  parts = list(sources.read_text(path, skips, max_document_bytes=200))
  assert [p.id for p in parts][:3] == ["long.txt", "long.txt#2", "long.txt#3"]
  assert [q for p in parts for q in p.paragraphs] == paragraphs  # nothing lost
  assert all(sum(len(q) + 1 for q in p.paragraphs) <= 200 + 40 for p in parts)
  sentences = _write(tmp_path / "s.txt", "\n".join(paragraphs) + "\n")
  parts = list(sources.read_bert_lines(sentences, skips, max_document_bytes=200))
  assert parts[1].id == "s.txt:1#2" and all(p.sentences_given for p in parts)
  assert [q for p in parts for q in p.paragraphs] == paragraphs
  assert skips.counts == {}
