"""`bertjax train` end to end: metrics files, falling loss, eval, profiler, NaN stop, export,
the end-of-run summary and plot, MFU against a cached CPU peak."""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bertjax import checkpoint, cli, flops, plot

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--config.data.source=synthetic_markov", "--config.model.vocab_size=128",
         "--config.model.hidden_size=64",
         "--config.model.num_heads=4", "--config.model.mlp_dim=128",
         "--config.model.max_positions=32", "--config.seq_length=32", "--config.batch_size=16",
         "--config.max_predictions=5", "--config.optimizer.warmup_steps=5",
         "--config.log_every=10"]


@pytest.fixture(autouse=True)
def _peak_cache(tmp_path_factory, monkeypatch) -> Path:
  """The measured CPU peak is cached for these tests alone: the user's cache is neither read
  nor written (BERTJAX_CACHE holds nothing else these runs use)."""
  cache = tmp_path_factory.getbasetemp() / "bertjax-cache"
  monkeypatch.setenv("BERTJAX_CACHE", str(cache))
  return cache


def _is_png(path: Path, min_bytes: int = 10_000) -> bool:
  data = path.read_bytes()
  return data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= min_bytes


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


def test_rerun_of_a_finished_run_does_nothing(tmp_path, caplog, capsys, monkeypatch):
  # A cached CPU peak far below what any step does: MFU stays at most 100%, the cache is raised.
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path / "cache"))
  key = flops.cpu_peak_key("float32", 1024)
  flops.cpu_peak_cache().parent.mkdir(parents=True)
  flops.cpu_peak_cache().write_text(json.dumps({key: 1.0}))
  # ... and this run's own probe as low (a machine under load): the steps raise it.
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: 1.0)
  # More warmup than steps is clipped, with a note.
  args = ["train", "--config", "gpt_tiny", "--workdir", str(tmp_path / "run"), *SMALL,
          "--config.num_train_steps=4", "--config.eval_every=0", "--config.log_every=1",
          "--config.optimizer.warmup_steps=10"]
  assert cli.main(args) == 0
  assert "warmup_steps=10 exceeds the 4 steps scheduled" in caplog.text
  mfus = [r["mfu"] for r in _records(tmp_path / "run", "train") if "mfu" in r]
  assert mfus and all(0 < m <= 1 for m in mfus), mfus
  assert "raising the cached peak" in caplog.text
  assert json.loads(flops.cpu_peak_cache().read_text())[key] > 1e6
  lines = (tmp_path / "run" / "metrics.jsonl").read_text()
  capsys.readouterr()
  assert cli.main(args) == 0
  assert "the run already finished (step 4 of 4)" in caplog.text
  assert (tmp_path / "run" / "metrics.jsonl").read_text() == lines
  # The rerun still tells where the run's files are.
  out = capsys.readouterr().out
  assert "run finished at step 4 of 4" in out
  assert f"bertjax generate --params {tmp_path / 'run' / 'params'}" in out


def test_mfu_is_never_above_one_and_raises_a_measured_peak(tmp_path, monkeypatch):
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path))
  rng = random.Random(0)
  for _ in range(200):
    cached = rng.uniform(1.0, 1e12)
    peak = flops.Peak(cached, "float32", "test", cache_key="k")
    achieved = rng.uniform(0.0, 2e12)
    mfu = peak.mfu(achieved)
    assert 0 <= mfu <= 1
    assert peak.flops == max(cached, achieved)
    assert mfu == pytest.approx(achieved / peak.flops)
  # A data-sheet peak is never raised: the MFU is clipped.
  sheet = flops.Peak(1e12, "bfloat16", "data sheet")
  assert sheet.mfu(3e12) == 1.0 and sheet.flops == 1e12
  # The 8 simulated CPU devices share the host's cores: its measured peak counts once (in
  # `bertjax bench` too), and no data sheet applies.
  assert flops.measured_peak_devices() == 1 and flops.nominal_peak_flops() is None


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


def test_bert_tiny_trains_on_the_embedded_wikipedia_sample(tmp_path, capsys):
  """The README's main job, shortened: with no data.dataset the run trains a SentencePiece
  tokenizer on the embedded sample, builds it into WORKDIR/data, trains and evaluates on it;
  it ends with a summary and a plot, and `bertjax plot` compares it with another run."""
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
  summary = capsys.readouterr().out.split("run finished at step 30 of 30")[1]
  for line in ("last train (step 30): loss", "last eval (step 30): loss", "nsp_accuracy",
               f"{tmp_path}/metrics.jsonl", f"tensorboard --logdir {tmp_path}",
               f"{tmp_path}/metrics.png", f"bertjax export --params {tmp_path}/params",
               f"bertjax generate --params {tmp_path}/params"):
    assert line in summary, line
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert _is_png(tmp_path / "metrics.png")
  # Two runs in one figure (the second a copy with another name).
  other = tmp_path / "other"
  other.mkdir()
  shutil.copy(tmp_path / "metrics.jsonl", other / "metrics.jsonl")
  out = tmp_path / "compare.png"
  assert plot.cmd_plot(argparse.Namespace(workdirs=[str(tmp_path), str(other)],
                                          out=str(out))) == 0
  assert _is_png(out)
  with pytest.raises(ValueError, match="no metrics.jsonl"):
    plot.cmd_plot(argparse.Namespace(workdirs=[str(tmp_path / "params")], out=str(out)))


def test_each_run_probes_again_and_keeps_the_best_cpu_peak(tmp_path, monkeypatch):
  """A first probe taken under load must not stay the peak: every run probes once more and the
  cache keeps the higher of the two; a lower probe leaves it alone."""
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path))
  key = flops.cpu_peak_key("float32", 1024)
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: 5.0)
  assert flops.cpu_matmul_peak("float32")[0] == 5.0  # first run: best of its probes, cached
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: 8.0)
  assert flops.cpu_matmul_peak("float32")[0] == 8.0
  assert json.loads(flops.cpu_peak_cache().read_text())[key] == 8.0
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: 2.0)
  assert flops.cpu_matmul_peak("float32")[0] == 8.0
  assert json.loads(flops.cpu_peak_cache().read_text())[key] == 8.0
