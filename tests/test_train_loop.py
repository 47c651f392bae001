"""`bertjax train` end to end: metrics files, falling loss, eval, profiler, NaN stop, export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bertjax import checkpoint, cli

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--config.data.source=synthetic_markov", "--config.model.vocab_size=128",
         "--config.model.hidden_size=64",
         "--config.model.num_heads=4", "--config.model.mlp_dim=128",
         "--config.model.max_positions=32", "--config.seq_length=32", "--config.batch_size=16",
         "--config.max_predictions=5", "--config.optimizer.warmup_steps=5",
         "--config.log_every=10"]


def _records(workdir: Path, split: str) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r for r in map(json.loads, lines) if r["split"] == split]


def test_gpt_train_writes_metrics_and_learns(tmp_path, capsys):
  assert cli.main(["train", "--config", "gpt_tiny", "--workdir", str(tmp_path), *SMALL,
                   "--config.num_train_steps=60", "--config.eval_every=30",
                   "--config.eval_steps=2", "--config.profile.start_step=3",
                   "--config.profile.num_steps=2"]) == 0
  out = capsys.readouterr().out
  assert "train step 60/60" in out and "tok/s" in out and "MFU" in out
  train = _records(tmp_path, "train")
  assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
  assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 0.5
  for key in ("loss", "lm_loss", "lm_accuracy", "perplexity", "learning_rate", "grad_norm",
              "tokens_per_sec", "step_time", "mfu"):
    assert key in train[-1], key
  assert len(_records(tmp_path, "eval")) == 2
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  # The run ends with params-only weights that export to Hugging Face.
  params, cfg = checkpoint.load_params(tmp_path / "params")
  assert cfg.hidden_size == 64
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--out",
                   str(tmp_path / "hf")]) == 0
  assert (tmp_path / "hf" / "model.safetensors").exists()


def test_bert_train_mlm_and_nsp_metrics(tmp_path):
  assert cli.main(["train", "--config", "bert_tiny", "--workdir", str(tmp_path), *SMALL,
                   "--config.num_train_steps=20", "--config.eval_every=0",
                   "--config.grad_accum_steps=2", "--config.mesh.fsdp=2",
                   "--config.mesh.tensor=2"]) == 0
  last = _records(tmp_path, "train")[-1]
  for key in ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
    assert key in last
  assert last["loss"] == pytest.approx(last["mlm_loss"] + last["nsp_loss"], rel=1e-5)


def test_nan_loss_stops_the_run_with_a_clear_message(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
       str(tmp_path), *SMALL, "--config.num_train_steps=30", "--config.eval_every=0",
       "--config.optimizer.learning_rate=1e30", "--config.optimizer.clip_norm=0",
       "--config.log_every=1"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
  assert "loss is nan" in result.stderr.lower() or "loss is inf" in result.stderr.lower()
  assert "stopping" in result.stderr


def test_rerun_of_a_finished_run_does_nothing(tmp_path, caplog):
  args = ["train", "--config", "gpt_tiny", "--workdir", str(tmp_path), *SMALL,
          "--config.num_train_steps=4", "--config.eval_every=0", "--config.log_every=1",
          "--config.optimizer.warmup_steps=1"]
  assert cli.main(args) == 0
  lines = (tmp_path / "metrics.jsonl").read_text()
  assert cli.main(args) == 0
  assert "the run already finished (step 4 of 4)" in caplog.text
  assert (tmp_path / "metrics.jsonl").read_text() == lines


def test_local_launcher_dry_run_prints_every_process():
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--processes", "4",
                        "--devices", "2", "--port", "1234", "--dry-run", "--", "bertjax",
                        "train", "--config", "gpt_tiny", "--workdir", "w"],
                       capture_output=True, text=True, check=True).stdout.splitlines()
  assert len(out) == 4
  for i, line in enumerate(out):
    assert f"BERTJAX_PROCESS_ID='{i}'" in line and "127.0.0.1:1234" in line
    assert "--xla_force_host_platform_device_count=2" in line
    assert line.endswith("bertjax train --config gpt_tiny --workdir w")


def test_bert_tiny_trains_on_the_embedded_wikipedia_sample(tmp_path):
  """The README's main job, shortened: with no data.dataset the run trains a SentencePiece
  tokenizer on the embedded sample, builds it into WORKDIR/data, trains and evaluates on it."""
  assert cli.main(["train", "--config", "bert_tiny", "--workdir", str(tmp_path),
                   "--config.model.vocab_size=2048", "--config.model.hidden_size=64",
                   "--config.model.num_heads=2", "--config.model.mlp_dim=128",
                   "--config.batch_size=16", "--config.num_train_steps=30",
                   "--config.log_every=10", "--config.eval_every=30",
                   "--config.eval_steps=2", "--config.optimizer.warmup_steps=5"]) == 0
  assert (tmp_path / "data" / "tokenizer" / "spm.model").is_file()
  counts = json.loads((tmp_path / "data" / "dataset" / "parts" / "process-0.json").read_text())
  assert counts["counts"]["embedded"]["train"]["documents"] > 80
  assert counts["skips"]["embedded"]["redirect"] == 99
  train = _records(tmp_path, "train")
  assert train[-1]["mlm_loss"] < train[0]["mlm_loss"]
  assert 0.2 < train[-1]["nsp_accuracy"] < 1.0
  assert len(_records(tmp_path, "eval")) == 1
  # The tokenizer the run used travels with the final parameters.
  assert (tmp_path / "params" / "tokenizer" / "spm.model").is_file()
