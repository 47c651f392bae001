"""Records that cannot be read wrong: every record of a built dataset carries a CRC-32 checked on
every read. Bytes XOR-flipped inside a shard's records (tokens, sentence lengths, the checksum,
the magic) are caught for every byte of a record; the loader skips those records (one line each
naming the shard file and the record's index, counted) or stops with one line
(`data.corrupt_records=error`), and what it yields is exactly what it yields without them: the
batches equal those of the clean dataset with those documents taken out of the rows that read
them (and, where the document order does not depend on the dataset's size, the unshuffled
eval stream of one row, those of the dataset rewritten without the records), the same on any
number of hosts, after a resume and with loader workers. A dataset built before checksums
(format 4) still reads, with one line saying it is unchecked."""

import dataclasses
import json
import logging
import random
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import train_helpers
from conftest import BUCKET

from bertjax import cli
from bertjax.data import records
from bertjax.data.build import build_dataset
from bertjax.data.errors import CorpusError
from bertjax.data.options import BuildOptions, LoaderConfig
from bertjax.data.pipeline import CorpusBatches, RowStreams, merge_states
from bertjax.data.shards import ShardRecords
from bertjax.data.sources import parse_source
from bertjax.data.streams import RowStreamFactory
from bertjax.data.sentencepiece_training import train_sentencepiece

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(400)]
BATCH = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Clean datasets of one 120-document source: WordPiece (BERT) and SentencePiece with an
  end-of-text token (GPT), 4 shards each."""
  root = tmp_path_factory.mktemp("checksums")
  docs = train_helpers.word_documents(random.Random(7), WORDS, 120, (2, 12), (3, 12))
  text = train_helpers.write_bert_lines(root / "docs.txt", docs)
  train_helpers.write_vocab(root / "vocab.txt", WORDS)
  train_sentencepiece([" ".join(d) for d in docs], root / "spm", vocab_size=600,
                      model_type="bpe", style="gpt")
  spec = [parse_source(f"bert_lines:{text}?name=docs")]
  build_dataset(spec, root / "vocab.txt", root / "bert", BuildOptions(num_shards=4,
                                                                      eval_fraction=0.1))
  # A larger held-out share: the eval stream tests need several records per eval shard.
  build_dataset(spec, root / "spm", root / "gpt", BuildOptions(num_shards=4, eval_fraction=0.4))
  return root


# (split, shard, record, where in the record, XOR mask): flips in the tokens, the sentence
# lengths, the checksum itself and the magic, by XOR 0xFF and 0x01.
HITS = [("train", 0, 3, "token", 0xFF), ("train", 1, 0, "length", 0x01),
        ("train", 2, 5, "checksum", 0x01), ("train", 3, 2, "magic", 0xFF),
        ("train", 3, 4, "token", 0x01)]


def _shard(built: Path, split: str, shard: int) -> Path:
  dataset = records.BuiltDataset.open(built)
  return dataset.shard_paths(dataset.source_names[0], split)[shard]


def _byte(record: bytes, where: str) -> int:
  """Where in a (format 5) record a flip of `where` lands."""
  key_len = int.from_bytes(record[8:12], "little")
  return {"magic": 0, "checksum": 5, "length": 24 + key_len,
          "token": (len(record) + 24 + key_len) // 2}[where]


def damaged(built: Path, out: Path, hits=HITS) -> dict[tuple[str, int, int], str]:
  """A copy of `built` with bytes of the records `hits` XOR-flipped in place; returns
  (split, shard, record) -> the damaged document's key."""
  shutil.copytree(built, out)
  keys = {}
  for split, shard, index, where, mask in hits:
    path = _shard(out, split, shard)
    offsets = np.load(records.offsets_path(path))
    data = bytearray(path.read_bytes())
    record = bytes(data[offsets[index]:offsets[index + 1]])
    keys[split, shard, index] = records.decode_record(record).key
    data[int(offsets[index]) + _byte(record, where)] ^= mask
    path.write_bytes(bytes(data))
  return keys


def without(built: Path, out: Path, removed: set[tuple[str, int, int]]) -> Path:
  """A copy of `built` with the records `removed` (split, shard, record) taken out of their
  shards (offsets and token counts rewritten): the dataset as if they had never been built."""
  shutil.copytree(built, out)
  for split, shard in {(s, k) for s, k, _ in removed}:
    kept = [r for i, r in enumerate(ShardRecords([_shard(built, split, shard)]))
            if (split, shard, i) not in removed]
    writer = records.ShardWriter(_shard(out, split, shard))
    for record in kept:
      writer.write(record, records.record_token_count(record))
    writer.close()
  return out


def as_format_4(built: Path, out: Path) -> Path:
  """A copy of `built` as bertjax wrote it before checksums: format 4, records without CRC."""
  shutil.copytree(built, out)
  dataset = records.BuiltDataset.open(built)
  for split in records.SPLITS:
    for path in dataset.shard_paths(dataset.source_names[0], split):
      old = [b"BJD1" + r[8:] for r in ShardRecords([path])]
      writer = records.ShardWriter(out / path.relative_to(built))
      for record in old:
        writer.write(record, records.record_token_count(record))
      writer.close()
  meta = json.loads((out / "dataset.json").read_text())
  (out / "dataset.json").write_text(json.dumps({**meta, "format_version": 4}))
  return out


class _WithoutDocuments(RowStreamFactory):
  """The loader's row streams with the documents `removed` (keys) taken out by hand: never a
  row's document, never a BERT pair's random-next one; the rest of the order as it is."""

  def __init__(self, dataset, cfg, split, batch_size, removed: set[str]):
    super().__init__(dataset, cfg, split, batch_size)
    self.removed = removed
    if hasattr(self, "views"):
      self.views = [_ViewWithout(view, removed) for view in self.views]

  def documents_of(self, row):
    # A piece of a document cut for token-balanced rows carries its key with "#k/n".
    return super().documents_of(row).filter(
        lambda e: re.sub(r"#\d+/\d+$", "", e[1].doc.key) not in self.removed)


class _ViewWithout:
  def __init__(self, view, removed):
    self._view, self._removed = view, removed

  def __len__(self):
    return len(self._view)

  def __getitem__(self, index):
    key = records.decode_record(self._view._source[index]).key
    return None if key in self._removed else self._view[index]


def _loader(built: Path, objective: str = "mlm_nsp", mode: str = "pairs", **changes):
  values = dict(dataset=str(built), objective=objective, seq_length=32, max_predictions=5,
                shuffle_window=16, prefetch=0, bert_instances=mode)
  return LoaderConfig(**{**values, **changes})


def _take(batches, n):
  return [next(batches) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for step, (x, y) in enumerate(zip(a, b)):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=f"batch {step}: {k}")


def _reference(built: Path, cfg: LoaderConfig, removed: set[str], n: int, split="train",
               batch_size=BATCH):
  factory = _WithoutDocuments(records.BuiltDataset.open(built), cfg, split, batch_size, removed)
  iterator = iter(RowStreams(factory, range(batch_size)))
  return [next(iterator)["features"] for _ in range(n)]


def test_every_byte_flip_of_a_record_is_caught(corpus):
  """A CRC-32 fails for any change of up to 32 consecutive bits: every byte of a real record,
  XOR 0xFF and XOR 0x01, header and body."""
  record = ShardRecords([_shard(corpus / "bert", "train", 0)])[0]
  assert records.record_damage(record, checksummed=True) is None
  for i in range(len(record)):
    for mask in (0xFF, 0x01):
      flipped = bytearray(record)
      flipped[i] ^= mask
      assert records.record_damage(bytes(flipped), checksummed=True) is not None, (i, mask)


def test_a_corrupt_record_is_one_error_naming_its_shard_and_index(corpus, tmp_path):
  bad = tmp_path / "bad"
  damaged(corpus / "bert", bad)
  reader = ShardRecords([_shard(bad, "train", 0)])
  reader[2]  # its neighbours read
  with pytest.raises(CorpusError, match=r"train-00000-of-00004\.records: record 3 is corrupt "
                                        r"\(checksum mismatch\); rebuild the dataset, or set "
                                        r"data\.corrupt_records=skip"):
    reader[3]
  with pytest.raises(CorpusError, match=r"train-00003-of-00004\.records: record 2 is corrupt "
                                        r"\(damaged header: magic b'\\xbdJD2', not b'BJD2'\)"):
    ShardRecords([_shard(bad, "train", 3)])[2]
  with pytest.raises(CorpusError, match=r"train-0000\d-of-00004\.records: record \d+ is "
                                        r"corrupt"):
    _take(CorpusBatches(_loader(bad, corrupt_records="error"), "train", range(BATCH), BATCH),
          200)


@pytest.mark.parametrize("objective,mode,dataset,balance", [
    ("mlm_nsp", "pairs", "bert", "documents"), ("mlm", "full_sentences", "bert", "documents"),
    ("mlm", "packed", "bert", "documents"), ("causal_lm", "pairs", "gpt", "documents"),
    ("causal_lm", "pairs", "gpt", "tokens")])
def test_skipped_records_never_reach_a_batch(corpus, tmp_path, caplog, objective, mode,
                                             dataset, balance):
  """Over two epochs, the batches of the damaged dataset equal the clean dataset's with the
  damaged documents taken out of the rows (and random-next draws) that read them; each
  corrupt record is logged once, naming its shard file and index, and counted."""
  bad = tmp_path / "bad"
  keys = damaged(corpus / dataset, bad)
  cfg = _loader(bad, objective, mode, row_balance=balance, num_epochs=2 if balance == "tokens"
                else 0)
  loader = CorpusBatches(cfg, "train", range(BATCH), BATCH)
  steps = 40 if objective == "causal_lm" else 100
  with caplog.at_level(logging.WARNING, logger="bertjax.data.pipeline"):
    got = _take(loader, steps)
  clean = dataclasses.replace(cfg, dataset=str(corpus / dataset))
  _assert_same(got, _reference(corpus / dataset, clean, set(keys.values()), steps))
  # Not vacuous: the damaged documents were on the rows' way.
  plain = _take(CorpusBatches(clean, "train", range(BATCH), BATCH), steps)
  assert any(not np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, plain))
  assert loader.corrupt_records == len(HITS)
  lines = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
  assert len(lines) == len(HITS)
  for split, shard, index, where, _ in HITS:
    reason = {"magic": "damaged header"}.get(where, "checksum mismatch")
    name = f"{_shard(bad, split, shard)}: record {index} is corrupt ({reason}"
    assert sum(line.startswith(name) for line in lines) == 1, (name, lines)
  assert "skipped, never trained on" in lines[-1] and f"{len(HITS)} corrupt record(s)" in lines[-1]


def test_skipping_is_the_same_on_any_host_count_and_after_a_resume(corpus, tmp_path):
  bad = tmp_path / "bad"
  damaged(corpus / "bert", bad)
  cfg = _loader(bad)
  uninterrupted = _take(CorpusBatches(cfg, "train", range(BATCH), BATCH), 60)
  for k in (0, 7, 33):
    first = CorpusBatches(cfg, "train", range(BATCH), BATCH)
    head = _take(first, k)
    resumed = CorpusBatches(cfg, "train", range(BATCH), BATCH)
    resumed.set_state(json.loads(json.dumps(first.get_state())))
    _assert_same(head + _take(resumed, 60 - k), uninterrupted)
  # Two hosts holding interleaved rows, then one host from their merged state.
  hosts = [(0, 2, 4, 6), (1, 3, 5, 7)]
  loaders = [CorpusBatches(cfg, "train", rows, BATCH) for rows in hosts]
  got = []
  for _ in range(30):
    parts = [(rows, next(loader)) for rows, loader in zip(hosts, loaders)]
    got.append({key: np.concatenate([local[key] for _, local in parts])[
        np.argsort([r for rows, _ in parts for r in rows])] for key in parts[0][1]})
  one = CorpusBatches(cfg, "train", range(BATCH), BATCH)
  one.set_state(merge_states([loader.get_state() for loader in loaders]))
  _assert_same(got + _take(one, 30), uninterrupted)


def test_loader_workers_skip_and_count_the_same(corpus, tmp_path, caplog):
  bad = tmp_path / "bad"
  damaged(corpus / "bert", bad)
  plain = _take(CorpusBatches(_loader(bad), "train", range(BATCH), BATCH), 100)
  caplog.clear()  # the in-process loader's lines
  workers = CorpusBatches(_loader(bad, num_workers=2, prefetch=2), "train", range(BATCH), BATCH)
  try:
    with caplog.at_level(logging.WARNING, logger="bertjax.data.pipeline"):
      _assert_same(_take(workers, 100), plain)
    assert workers.corrupt_records == len(HITS)  # found in the workers, counted here
    assert sum("is corrupt" in r.getMessage() for r in caplog.records) == len(HITS)
  finally:
    workers.close()
  # Raised in a worker, the error reaches the training process as the same one line.
  stopping = CorpusBatches(_loader(bad, num_workers=2, prefetch=2, corrupt_records="error"),
                           "train", range(BATCH), BATCH)
  try:
    with pytest.raises(CorpusError) as raised:
      _take(stopping, 100)
    assert re.fullmatch(r"\S+/train-0000\d-of-00004\.records: record \d+ is corrupt \(.*\); "
                        r"rebuild the dataset, or set data\.corrupt_records=skip to train on "
                        r"without it", str(raised.value)), str(raised.value)
  finally:
    stopping.close()


def test_the_eval_stream_equals_the_dataset_rewritten_without_the_records(corpus, tmp_path):
  """The eval split is read in stored order: one row of GPT packing (no randomness) over the
  damaged dataset is, token for token, the run on the dataset rebuilt without those records."""
  eval_sizes = [len(ShardRecords([_shard(corpus / "gpt", "eval", s)])) for s in range(4)]
  assert min(eval_sizes) >= 3, eval_sizes
  hits = [("eval", 0, 1, "token", 0xFF), ("eval", 2, 0, "length", 0x01),
          ("eval", 3, 2, "magic", 0x01)]
  damaged(corpus / "gpt", tmp_path / "bad", hits)
  removed = without(corpus / "gpt", tmp_path / "removed", {h[:3] for h in hits})
  # Windows of 32 tokens past the eval split's tokens (and end-of-text tokens): it wraps round.
  counts = [np.load(records.token_counts_path(_shard(corpus / "gpt", "eval", s)))
            for s in range(4)]
  steps = sum(int(c.sum()) + len(c) for c in counts) // 32 + 10
  got = CorpusBatches(_loader(tmp_path / "bad", "causal_lm"), "eval", [0], 1)
  want = CorpusBatches(_loader(removed, "causal_lm"), "eval", [0], 1)
  _assert_same(_take(got, steps), _take(want, steps))
  assert got.corrupt_records == len(hits)


def test_a_dataset_built_before_checksums_reads_unchecked_with_one_line(corpus, tmp_path,
                                                                        caplog):
  old = as_format_4(corpus / "bert", tmp_path / "old")
  with caplog.at_level(logging.WARNING, logger="bertjax.data.records"):
    new_batches = _take(CorpusBatches(_loader(corpus / "bert"), "train", range(BATCH), BATCH),
                        12)
    loader = CorpusBatches(_loader(old), "train", range(BATCH), BATCH)
    _assert_same(_take(loader, 12), new_batches)
    records.BuiltDataset.open(old)
  lines = [r.getMessage() for r in caplog.records if "unchecked" in r.getMessage()]
  assert lines == [f"{old}: format 4, built before record checksums: its records are read "
                   "unchecked (a changed token id goes unnoticed); rebuild it to check every "
                   "record"]
  # What can still be checked is: a damaged header names its file and record.
  path = _shard(old, "train", 1)
  offsets = np.load(records.offsets_path(path))
  data = bytearray(path.read_bytes())
  data[int(offsets[2])] ^= 0x01
  data[int(offsets[4]) + 4] ^= 0x01  # the key length: the stated size no longer matches
  path.write_bytes(bytes(data))
  reader = ShardRecords([path], checksummed=False)
  with pytest.raises(CorpusError, match=r"train-00001-of-00004\.records: record 2 is corrupt "
                                        r"\(damaged header: magic b'CJD1', not b'BJD1'\)"):
    reader[2]
  with pytest.raises(CorpusError, match=r"record 4 is corrupt \(damaged header: it states"):
    reader[4]


def test_a_damaged_offsets_file_names_the_file(corpus, tmp_path):
  bad = tmp_path / "bad"
  shutil.copytree(corpus / "bert", bad)
  offsets = records.offsets_path(_shard(bad, "train", 1))
  offsets.write_bytes(b"\x93NUMPX" + offsets.read_bytes()[6:])
  with pytest.raises(CorpusError, match=rf"{offsets}: not a readable \.npy array"):
    ShardRecords([_shard(bad, "train", 1)])


def test_training_skips_and_names_them_or_stops_in_one_line(corpus, tmp_path, caplog, capsys):
  """`bertjax train` on a dataset whose first batch reads damaged records: the run trains on
  (exit 0), logging each by shard file and index; with data.corrupt_records=error it exits 2
  with one line naming the first."""
  cfg = _loader(corpus / "bert")
  factory = RowStreamFactory(records.BuiltDataset.open(cfg.dataset), cfg, "train", 16)
  sizes = [len(ShardRecords([_shard(corpus / "bert", "train", s)])) for s in range(4)]
  starts = np.cumsum([0] + sizes)
  firsts = [factory.documents[row][1].index for row in range(3)]  # rows 0-2's first documents
  hits = [("train", int(s), int(i - starts[s]), "token", 0xFF)
          for i in firsts for s in [int(np.searchsorted(starts, i, side="right") - 1)]]
  bad = tmp_path / "bad"
  damaged(corpus / "bert", bad, hits)
  train = ["train", "--config", "bert_tiny", f"--config.data.dataset={bad}",
           "--config.num_train_steps=2", *train_helpers.tiny_args(**{
               "model.vocab_size": 512, "model.num_layers": 1, "eval_every": 0,
               "checkpoint.every": 0, "log_every": 1})]
  with caplog.at_level(logging.WARNING, logger="bertjax.data.pipeline"):
    assert cli.main([*train, "--workdir", str(tmp_path / "skip")]) == 0
  lines = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
  for split, shard, index, _, _ in hits:
    assert any(line.startswith(f"{_shard(bad, split, shard)}: record {index} is corrupt "
                               "(checksum mismatch): skipped") for line in lines), lines
  # ... and counted in the run's metrics (this process's loader).
  metrics = (tmp_path / "skip" / "metrics.jsonl").read_text()
  logged = [json.loads(line) for line in metrics.splitlines()]
  assert max(r.get("data_corrupt_records", 0) for r in logged) >= len(hits)
  capsys.readouterr()
  assert cli.main([*train, "--workdir", str(tmp_path / "error"),
                   "--config.data.corrupt_records=error"]) == 2
  err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(err) == 1 and "record" in err[0] and "is corrupt (checksum mismatch)" in err[0]
  assert str(bad) in err[0]


# Reads 100 batches of the dataset named on the command line; prints a digest of them and the
# corrupt records skipped (run against the GCS emulator, in a process of its own environment).
_READ_BATCHES = """
import hashlib, json, sys
from bertjax.data.options import LoaderConfig
from bertjax.data.pipeline import CorpusBatches
cfg = LoaderConfig(dataset=sys.argv[1], objective="mlm_nsp", seq_length=32, max_predictions=5,
                   shuffle_window=16, prefetch=0)
loader = CorpusBatches(cfg, "train", range(8), 8)
digest = hashlib.sha256()
for _ in range(100):
  batch = next(loader)
  for key in sorted(batch):
    digest.update(batch[key].tobytes())
print(json.dumps({"digest": digest.hexdigest(), "corrupt": sorted(
    [c.shard.rsplit("/", 1)[1], c.index, c.reason] for c in loader.corrupt_found)}))
"""


def _upload_tree(url: str, local: Path, prefix: str) -> None:
  for f in sorted(p for p in local.rglob("*") if p.is_file()):
    query = urllib.parse.urlencode({"uploadType": "media",
                                    "name": f"{prefix}/{f.relative_to(local)}"})
    urllib.request.urlopen(urllib.request.Request(
        f"{url}/upload/storage/v1/b/{BUCKET}/o?{query}", data=f.read_bytes(), method="POST",
        headers={"Content-Type": "application/octet-stream"})).read()


def _read_batches(dataset: str, env: dict | None = None) -> dict:
  result = subprocess.run([sys.executable, "-c", _READ_BATCHES, dataset], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # against the GCS emulator
def test_records_streamed_from_an_object_store_are_checked_the_same(gcs, corpus, tmp_path):
  """A record read as one byte range of a `gs://` shard is checked as a local one: the same
  records skipped, the same batches."""
  url, env = gcs
  bad = tmp_path / "bad"
  damaged(corpus / "bert", bad)
  _upload_tree(url, bad, "checksums/bad")
  remote = _read_batches(f"gs://{BUCKET}/checksums/bad", env)
  local = _read_batches(str(bad), env)
  assert remote == local
  assert sorted((name, index) for name, index, _ in remote["corrupt"]) == sorted(
      (_shard(bad, split, shard).name, index) for split, shard, index, _, _ in HITS)
