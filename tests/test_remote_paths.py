"""Runs whose data, workdir and exports are all `gs://` paths: a pre-training run built, trained,
checkpointed, resumed exactly and exported; a fine-tune writing its metrics, best weights and
exports; against fake-gcs-server (a GCS emulator on 127.0.0.1, the `gcs` fixture) through the
same clients a TPU VM uses: gcsfs under etils.epath, TensorStore under Orbax. The bucket's
contents are checked through the emulator's own JSON API, not through bertjax's path layer."""

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import train_helpers
from conftest import BUCKET

pytestmark = pytest.mark.slow  # runs against a GCS emulator: the full suite's
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--config.model.vocab_size=512", "--config.model.hidden_size=32",
        "--config.model.num_layers=1", "--config.model.num_heads=2", "--config.model.mlp_dim=64",
        "--config.model.max_positions=64", "--config.seq_length=64", "--config.batch_size=8",
        "--config.max_predictions=8", "--config.optimizer.warmup_steps=1",
        "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint.every=2",
        # The step count changes between the first run and its continuation: a constant
        # schedule keeps the learning rates of both equal to the 6-step reference's.
        "--config.optimizer.schedule=constant"]


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


def _bertjax(env: dict, *args: str, stdout_only: bool = False) -> str:
  result = subprocess.run([sys.executable, "-m", "bertjax", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  return result.stdout if stdout_only else result.stdout + result.stderr


def test_a_run_on_gcs_builds_trains_resumes_and_exports(gcs, tmp_path):
  url, env = gcs
  gs = f"gs://{BUCKET}"
  _bertjax(env, "tokenizer", "train", "--source", "embedded", "--vocab-size", "512",
           "--out", f"{gs}/spm")
  assert {"spm/spm.model", "spm/bertjax_tokenizer.json"} <= set(_objects(url, "spm/"))
  _bertjax(env, "data", "build", "--source", "embedded", "--tokenizer", f"{gs}/spm",
           "--out", f"{gs}/wiki", "--num-shards", "2", "--eval-fraction", "0.05")
  shards = [n for n in _objects(url, "wiki/") if n.endswith(".records")]
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


def test_a_finetune_on_gcs_writes_metrics_best_weights_and_exports(gcs, tmp_path):
  """`bertjax finetune --out gs://...`: metrics, TensorBoard, checkpoints, OUT/best (params,
  finetune.json, tokenizer), the Hugging Face export and the summary all land in the bucket,
  and the exported classifier gives the best parameters' logits in transformers."""
  url, env = gcs
  from bertjax.checkpoints.params import save_params
  from bertjax.models import ModelConfig, build_model, jit_init
  import jax
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"])
                   + "\n")
  rows = ["sentence\tlabel"] + [f"{' '.join('abc'[(i + j) % 3] for j in range(4))}\t{i % 2}"
                                for i in range(24)]
  (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
  cfg = ModelConfig(family="bert", vocab_size=8, hidden_size=16, num_layers=1, num_heads=2,
                    mlp_dim=32, max_positions=16)
  save_params(tmp_path / "base", jit_init(build_model(cfg))(jax.random.key(0)), cfg)
  gs = f"gs://{BUCKET}/ft"
  out = _bertjax(env, "finetune", "--init-from", str(tmp_path / "base"), "--train",
                 str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "train.tsv"), "--out", gs,
                 "--tokenizer", str(vocab), "--seq-length", "8", "--batch-size", "8",
                 "--epochs", "2", "--learning-rate", "1e-3", "--export-hf", stdout_only=True)
  summary = json.loads(out)
  assert summary["best_dir"] == f"{gs}/best" and summary["hf_dir"] == f"{gs}/hf"
  objects = _objects(url, "ft/")
  assert {"ft/metrics.jsonl", "ft/config.json", "ft/finetune_summary.json",
          "ft/best/model.json", "ft/best/finetune.json", "ft/best/tokenizer/vocab.txt",
          "ft/hf/config.json", "ft/hf/model.safetensors"} <= set(objects), sorted(objects)
  assert any(n.startswith("ft/best/params/") for n in objects)
  assert any(n.startswith("ft/checkpoints/6/") for n in objects)
  assert any(n.startswith("ft/tensorboard/events.out") for n in objects)
  _download(url, "ft/", tmp_path / "ft")
  lines = (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
  dev = [r for r in map(json.loads, lines) if r["split"] == "dev"]
  history = json.loads((tmp_path / "ft" / "finetune_summary.json").read_text())["history"]
  assert [r["step"] for r in dev] == [r["step"] for r in history] == [3, 6]
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from bertjax.checkpoints.weights import load_finetuned
  params, config, _ = load_finetuned(tmp_path / "ft" / "best")
  ids = np.array([[2, 5, 6, 7, 3]], np.int32)
  ours = build_model(config, "sequence_classification").apply(
      {"params": params}, ids, np.zeros_like(ids), np.ones_like(ids))
  model = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "ft" / "hf")
  with torch.no_grad():
    theirs = model.eval()(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(ours), rtol=0, atol=1e-5)
