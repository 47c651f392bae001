"""`bertjax data build --runner`: the build as an Apache Beam pipeline writes the local build's
bytes (shards, offsets, token counts, dataset.json, tokenizer) for a multistream dump read by
byte ranges, a JSONL source and a lines source, with repeats and skips counted the same; a
bundle that fails half-way through writing its shard is retried and the output is unchanged."""

import json
from pathlib import Path

import pytest

from bertjax import cli
from bertjax.data import beam_build
from bertjax.data.build import build_dataset
from bertjax.data.options import BuildOptions
from bertjax.data.sources import parse_sources

WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture
def corpus(tmp_path):
  """A WordPiece vocabulary, the embedded sample as a multistream dump with its index, and
  JSONL and lines sources with exact repeats and an empty record."""
  from tests.multistream_dump import write_multistream_dump
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS) + "\n")
  dump = write_multistream_dump(tmp_path / "dump", pages_per_stream=10, with_index=True)
  stories = [" ".join(WORDS[(n * 7 + k) % 60] for k in range(12)) + " ." for n in range(150)]
  with open(tmp_path / "news.jsonl", "w") as f:
    for n, story in enumerate(stories + stories[:5]):
      f.write(json.dumps({"id": f"n{n}", "text": f"{story} {stories[(n + 1) % 150]}"}) + "\n")
    f.write(json.dumps({"id": "empty", "text": ""}) + "\n")
  (tmp_path / "quotes.txt").write_text("\n".join(stories[::-1] + stories[:3]) + "\n")
  sources = [f"wikipedia:{dump}?name=wiki", f"jsonl:{tmp_path / 'news.jsonl'}?name=news",
             f"lines:{tmp_path / 'quotes.txt'}?name=quotes"]
  return vocab, sources


def _written(built: Path) -> dict[str, bytes]:
  """Every file of a built dataset but the build processes' reports (timings, bytes read)."""
  return {str(p.relative_to(built)): p.read_bytes() for p in sorted(built.rglob("*"))
          if p.is_file() and p.parent.name != "parts"}


def test_a_beam_build_writes_the_local_builds_bytes(tmp_path, corpus):
  vocab, sources = corpus
  options = BuildOptions(num_shards=4, eval_fraction=0.1)
  local = build_dataset(parse_sources(sources), vocab, tmp_path / "local", options)
  args = ["data", "build", "--tokenizer", str(vocab), "--num-shards", "4", "--eval-fraction",
          "0.1", "--out", str(tmp_path / "beam"), "--runner", "DirectRunner", "--workers", "2"]
  for source in sources:
    args += ["--source", source]
  assert cli.main(args) == 0  # multi-processing mode, 2 worker processes
  written = _written(tmp_path / "beam")
  assert written == _written(tmp_path / "local")
  assert len([n for n in written if n.endswith(".records")]) == 3 * 2 * 4
  part = json.loads((tmp_path / "beam" / "parts" / "process-0.json").read_text())
  assert part["counts"] == local.counts
  assert part["skips"] == {name: dict(s) for name, s in local.skips.items()}
  assert part["skips"]["news"]["duplicate document"] > 0
  assert part["skips"]["quotes"]["duplicate document"] > 0


def test_a_failed_bundle_is_retried_and_the_output_is_unchanged(tmp_path, corpus, monkeypatch):
  """Beam's bundle-based DirectRunner retries a failed bundle (the multi-processing one does
  not: it fails the pipeline). The bundle writing shard 1 of news/train dies once after
  writing half its file; the retry writes the whole shard again."""
  vocab, sources = corpus
  options = BuildOptions(num_shards=4, eval_fraction=0.1)
  build_dataset(parse_sources(sources), vocab, tmp_path / "local", options)
  write_shard = beam_build._write_shard
  # The runner runs copies of the pipeline's functions: the attempts are counted on disk.
  attempts = tmp_path / "attempts"
  attempts.mkdir()

  def dies_once(out, specs, num_shards, dedup, item):
    if item[0] == (1, "train", 1):
      (attempts / str(len(list(attempts.iterdir())))).touch()
      if len(list(attempts.iterdir())) == 1:
        target = Path(out) / "news" / "train-00001-of-00004.records"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"half a shard")
        raise RuntimeError("injected: the worker died writing its shard")
    yield from write_shard(out, specs, num_shards, dedup, item)

  monkeypatch.setattr(beam_build, "_write_shard", dies_once)
  beam_build.build_with_beam(parse_sources(sources), vocab, tmp_path / "beam", options,
                             beam_build.runner_args("BundleBasedDirectRunner", [], 1))
  assert len(list(attempts.iterdir())) == 2
  assert _written(tmp_path / "beam") == _written(tmp_path / "local")


def test_beam_build_user_errors(tmp_path, corpus, capsys):
  vocab, sources = corpus
  base = ["data", "build", "--tokenizer", str(vocab), "--source", sources[1], "--out",
          str(tmp_path / "x")]
  for extra, message in ((["--runner", "MyRunner"], "--runner 'MyRunner': choose from"),
                         (["--runner", "DirectRunner", "--process-count", "2"],
                          "a Beam runner shares out the work itself"),
                         (["--runner", "DirectRunner", "--decontaminate", str(vocab)],
                          "--decontaminate is not supported with --runner")):
    assert cli.main(base + extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # against the GCS emulator
def test_a_multistream_dump_on_gcs_is_read_by_byte_ranges(gcs, tmp_path, corpus, monkeypatch):
  """The dump and its index on `gs://` (fake-gcs-server): the local build and the Beam build
  (multi-processing DirectRunner) read its streams by ranged reads and write the bytes of the
  build from the local file."""
  import urllib.parse
  import urllib.request
  from conftest import BUCKET
  url, env = gcs
  for key in ("STORAGE_EMULATOR_HOST", "FSSPEC_GCS_TOKEN", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
              "BERTJAX_CACHE"):
    monkeypatch.setenv(key, env[key])
  vocab, sources = corpus
  dump = Path(sources[0].split(":", 1)[1].split("?")[0])
  for f in (dump, dump.with_name(dump.name.replace(".xml.bz2", "-index.txt.bz2"))):
    query = urllib.parse.urlencode({"uploadType": "media", "name": f"dumps/{f.name}"})
    urllib.request.urlopen(urllib.request.Request(
        f"{url}/upload/storage/v1/b/{BUCKET}/o?{query}", data=f.read_bytes(), method="POST",
        headers={"Content-Type": "application/octet-stream"})).read()
  remote = [f"wikipedia:gs://{BUCKET}/dumps/{dump.name}?name=wiki"]
  options = BuildOptions(num_shards=4, eval_fraction=0.1)
  build_dataset(parse_sources(sources[:1]), vocab, tmp_path / "local", options)
  from_gcs = build_dataset(parse_sources(remote), vocab, tmp_path / "from_gcs", options)

  def same_as_local(built: Path) -> None:  # dataset.json names the source's own path
    ours, theirs = _written(built), _written(tmp_path / "local")
    assert ours.pop("dataset.json").replace(f"gs://{BUCKET}/dumps".encode(), str(
        dump.parent).encode()) == theirs.pop("dataset.json")
    assert ours == theirs

  same_as_local(tmp_path / "from_gcs")
  read = json.loads((tmp_path / "from_gcs" / "parts" / "process-0.json").read_text())["read"]
  assert read["wiki"]["index"] and read["wiki"]["bytes"] == dump.stat().st_size
  beam_build.build_with_beam(parse_sources(remote), vocab, tmp_path / "beam", options,
                             beam_build.runner_args("DirectRunner", [], 2))
  same_as_local(tmp_path / "beam")
  assert from_gcs.counts["wiki"]["train"]["documents"] > 50
