"""Training from a dataset on an object store, streamed: a 2-host GPT run reads its documents
from `gs://` (fake-gcs-server, the `gcs` fixture), each host through its own byte-counting
proxy, so what each host fetched is measured outside bertjax. Each host reads about its rows'
share of the records and never the whole dataset; training is bit-identical to the same run on
the local copy, also when killed and resumed; sources the run leaves out are never touched,
however many shards they hold."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import train_helpers
from conftest import BUCKET
from xla_env import xla_flags

pytestmark = pytest.mark.slow  # runs against a GCS emulator: the full suite's
ROOT = Path(__file__).resolve().parent.parent
STEPS = 1000  # more than one epoch: data.num_epochs=1 ends the runs
MODEL = ["--config.model.vocab_size=300", "--config.model.hidden_size=32",
         "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.mlp_dim=64",
         "--config.model.max_positions=64", "--config.seq_length=64", "--config.batch_size=8",
         "--config.optimizer.warmup_steps=1", "--config.log_every=1", "--config.eval_every=0",
         "--config.checkpoint.every=4", "--config.data.num_epochs=1",
         "--config.optimizer.schedule=constant"]


class CountingProxy:
  """A TCP proxy to the emulator for one host: counts the bytes the store sends back, records
  the object each request names and the bytes the ranged reads of record shards ask for."""

  def __init__(self, target: str):
    self._target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
    self.bytes_down, self.objects, self.ranged, self._lock = 0, [], 0, threading.Lock()
    self._server = socket.create_server(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self) -> None:
    while True:
      client, _ = self._server.accept()
      upstream = socket.create_connection(self._target)
      threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
      threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

  def _pipe(self, source: socket.socket, sink: socket.socket, down: bool) -> None:
    try:
      while data := source.recv(1 << 16):
        with self._lock:
          if down:
            self.bytes_down += len(data)
          else:
            for line in data.split(b"\r\n"):
              if line.startswith((b"GET ", b"HEAD ")):
                self.objects.append(urllib.parse.unquote(line.split()[1].decode()))
              elif (line.lower().startswith(b"range: bytes=")
                    and self.objects[-1].split("?")[0].endswith(".records")):
                first, last = line.split(b"=")[1].split(b"-")
                self.ranged += int(last) - int(first) + 1
        sink.sendall(data)
    except OSError:
      pass
    finally:
      for s in (source, sink):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass


def _upload(url: str, name: str, data: bytes) -> None:
  query = urllib.parse.urlencode({"uploadType": "media", "name": name})
  urllib.request.urlopen(urllib.request.Request(
      f"{url}/upload/storage/v1/b/{BUCKET}/o?{query}", data=data, method="POST",
      headers={"Content-Type": "application/octet-stream"})).read()


def _upload_tree(url: str, local: Path, prefix: str, rename: tuple[str, str] = ("", "")) -> None:
  for f in sorted(local.rglob("*")):
    if f.is_file():
      relative = str(f.relative_to(local))
      if rename[0] and relative.startswith(rename[0] + "/"):
        relative = rename[1] + relative[len(rename[0]):]
      _upload(url, f"{prefix}/{relative}", f.read_bytes())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """48 word documents of about the same length, 40-50 sentences (so a host's share of the
  bytes is about its share of the rows), built for GPT into 4 shards."""
  from bertjax.data.build import build_dataset
  from bertjax.data.options import BuildOptions
  from bertjax.data.sources import parse_sources
  from bertjax.data.sentencepiece_training import appended_pieces, train_sentencepiece
  root = tmp_path_factory.mktemp("stream")
  rng = random.Random(0)
  documents = train_helpers.word_documents(rng, train_helpers.RIVERS + train_helpers.TOWNS,
                                           48, (40, 50), (8, 10))
  text = train_helpers.write_bert_lines(root / "towns.txt", documents)
  tokenizer = train_sentencepiece([s for d in documents for s in d], root / "spm",
                                  vocab_size=300 - appended_pieces("gpt"),
                                  model_type="unigram", style="gpt")
  build_dataset(parse_sources(f"bert_lines:{text}?name=towns"), tokenizer, root / "dataset",
                BuildOptions(num_shards=4, eval_fraction=0.05))
  return root / "dataset"


def _launch(env: dict, proxies: list[CountingProxy] | None, workdir: Path, dataset: str,
            steps: int = STEPS) -> list[subprocess.Popen]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(2):
    host = {**env, "BERTJAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "BERTJAX_NUM_PROCESSES": "2", "BERTJAX_PROCESS_ID": str(i),
            "XLA_FLAGS": xla_flags(4), "PYTHONUNBUFFERED": "1",
            # Two hosts: each its own cache, each its own way to the store.
            "BERTJAX_CACHE": str(workdir.parent / f"{workdir.name}-cache-{i}")}
    if proxies:
      host["STORAGE_EMULATOR_HOST"] = proxies[i].url
    log = open(workdir.parent / f"{workdir.name}-{i}.log", "w")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
         str(workdir), f"--config.data.dataset={dataset}", f"--config.num_train_steps={steps}",
         *MODEL], cwd=ROOT, env=host, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True))
  return procs


def _wait(procs: list[subprocess.Popen], workdir: Path) -> None:
  for i, proc in enumerate(procs):
    code = proc.wait(timeout=600)
    assert code == 0, (workdir.parent / f"{workdir.name}-{i}.log").read_text()[-4000:]


def _same_training(reference: Path, other: Path) -> None:
  """Bit for bit: every step's loss and the final parameters."""
  assert train_helpers.step_losses(other) == train_helpers.step_losses(reference)
  a, b = train_helpers.final_params(reference), train_helpers.final_params(other)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_two_hosts_stream_their_share_of_a_gcs_dataset(gcs, corpus, tmp_path):
  url, env = gcs
  _upload_tree(url, corpus, "stream/plain")
  dataset = f"gs://{BUCKET}/stream/plain"
  proxies = [CountingProxy(url), CountingProxy(url)]

  local = tmp_path / "local"
  _wait(_launch(env, None, local, str(corpus)), local)
  steps = max(train_helpers.step_losses(local))
  assert 20 < steps < STEPS  # one epoch, then the end of the data

  remote = tmp_path / "remote"
  _wait(_launch(env, proxies, remote, dataset), remote)
  _same_training(local, remote)

  # What each host fetched, measured at its proxy. Its rows' half of the train records, as
  # byte ranges of exactly those records; besides them only what every host reads (dataset.json,
  # tokenizer, the train shards' offsets and token counts, a few listings) and each response's
  # headers. Never a shard's other bytes, never the eval split.
  size = {p: p.stat().st_size for p in corpus.rglob("*") if p.is_file()}
  train_records = sum(n for p, n in size.items() if p.name.startswith("train-")
                      and p.suffix == ".records")
  metadata = sum(n for p, n in size.items() if p.name == "dataset.json" or "tokenizer" in
                 p.parts or (p.name.startswith("train-") and p.suffix == ".npy"))
  whole = sum(size.values())
  for host, proxy in enumerate(proxies):
    print(f"host {host}: {proxy.bytes_down:,} bytes in {len(proxy.objects)} requests, "
          f"{proxy.ranged:,} of them record ranges, of {train_records:,} bytes of train "
          f"records; metadata {metadata:,}; the dataset {whole:,}")
    assert 0.4 * train_records < proxy.ranged < 0.6 * train_records, (proxy.ranged,
                                                                      train_records)
    # Headers and listings: under 2 KiB a request (about 0.7 measured).
    assert proxy.bytes_down - proxy.ranged - metadata < 2048 * len(proxy.objects), (
        proxy.bytes_down, proxy.ranged, metadata, len(proxy.objects))
    assert proxy.bytes_down < whole, (proxy.bytes_down, whole)
    assert not [o for o in proxy.objects if "/eval-" in o]
  # Nothing of the dataset was copied to a host's disk but its tokenizer.
  cached = [p.name for i in range(2) for p in (tmp_path / f"remote-cache-{i}").rglob("*")
            if p.is_file()]
  assert not [n for n in cached if n.endswith((".records", ".npy"))], cached

  # Killed (both hosts at once) after a checkpoint, resumed: the same training, bit for bit.
  killed = tmp_path / "killed"
  procs = _launch(env, proxies, killed, dataset)
  kill_after = random.Random(1).randint(6, steps - 6)
  try:
    deadline = time.monotonic() + 600
    while (not (killed / "metrics.jsonl").exists()
           or max(train_helpers.step_losses(killed), default=0) < kill_after
           or not train_helpers.committed_steps(killed)):
      assert all(p.poll() is None for p in procs), (tmp_path / "killed-0.log").read_text()[-3000:]
      assert time.monotonic() < deadline
      time.sleep(0.05)
  finally:
    for proc in procs:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  restored = train_helpers.committed_steps(killed)[-1]
  assert restored < steps
  _wait(_launch(env, proxies, killed, dataset), killed)
  assert f"resumed from {killed}/checkpoints step {restored}" in (
      tmp_path / "killed-0.log").read_text()
  _same_training(local, killed)


def test_sources_a_run_leaves_out_are_never_read(gcs, corpus, tmp_path):
  """The same dataset padded with 24 sources of weight 0 (192 shards, each with its offsets
  and token counts): a run fetches the same objects as on the unpadded dataset, and none of
  the padding."""
  url, env = gcs
  meta = json.loads((corpus / "dataset.json").read_text())
  padding = [f"pad{i:02d}" for i in range(24)]
  _upload_tree(url, corpus, "stream/lean")
  _upload_tree(url, corpus, "stream/padded")
  for name in padding:
    _upload_tree(url, corpus / "towns", f"stream/padded/{name}")
  _upload(url, "stream/padded/dataset.json", json.dumps({**meta, "sources": meta["sources"] + [
      {**meta["sources"][0], "name": name, "weight": 0} for name in padding]}).encode())
  fetched = {}
  for variant in ("lean", "padded"):
    proxies = [CountingProxy(url), CountingProxy(url)]
    workdir = tmp_path / variant
    _wait(_launch(env, proxies, workdir, f"gs://{BUCKET}/stream/{variant}", steps=3), workdir)
    objects = {o.split(f"/stream/{variant}/")[-1].split("?")[0] for p in proxies
               for o in p.objects if f"/stream/{variant}/" in o}
    fetched[variant] = objects
    assert train_helpers.step_losses(workdir).keys() == {1, 2, 3}
  assert fetched["padded"] == fetched["lean"]
  assert not [o for o in fetched["padded"] if o.startswith("pad")]
  assert any(o.startswith("towns/train-") and o.endswith(".records") for o in fetched["lean"])
