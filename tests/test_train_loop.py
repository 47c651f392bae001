"""`bertjax train` end to end: metrics files, falling loss, eval, profiler, NaN stop, export,
the end-of-run summary and plot, MFU against a cached CPU peak; the loop's step hooks, train
metrics read one step late, the transfer guard around the step, the batch check's width."""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_helpers
from bertjax import cli
from bertjax.checkpoints import params as checkpoint
from bertjax.training import flops, hooks, loop, phase_data, plot
from bertjax.training.pretraining import Pretraining
from bertjax.parallel import sharding
from bertjax.training.metrics import TrainingDiverged
from bertjax.training.trainer import Trainer
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--config.data.source=synthetic_markov", *train_helpers.tiny_args(**{
    "model.vocab_size": 128, "max_predictions": 5, "optimizer.warmup_steps": 5,
    "log_every": 10})]


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_bert_train_mlm_and_nsp_metrics(tmp_path):
  assert cli.main(["train", "--config", "bert_tiny", "--workdir", str(tmp_path), *SMALL,
                   "--config.num_train_steps=20", "--config.eval_every=0",
                   "--config.grad_accum_steps=2", "--config.mesh.fsdp=2",
                   "--config.mesh.tensor=2"]) == 0
  last = _records(tmp_path, "train")[-1]
  for key in ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
    assert key in last
  assert last["loss"] == pytest.approx(last["mlm_loss"] + last["nsp_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("guard", [False, True], ids=["guard-off", "guard-on"])
def test_nan_loss_stops_the_run_with_a_clear_message(tmp_path, guard):
  """A learning rate of 1e30 diverges at once: without the spike guard the first NaN stops
  the run; with it each rewind meets NaN again and the run stops after max_rewinds."""
  result = subprocess.run(
      [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
       str(tmp_path), *SMALL, "--config.num_train_steps=30", "--config.eval_every=0",
       "--config.optimizer.learning_rate=1e30", "--config.optimizer.clip_norm=0",
       "--config.log_every=1", f"--config.resilience.spike_sigmas={6.0 if guard else 0.0}",
       "--config.resilience.max_rewinds=2"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "XLA_FLAGS": xla_flags(1)})
  assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
  if guard:
    assert "came back after 2 rewind(s) (resilience.max_rewinds=2); stopping" in result.stderr
  else:
    assert "loss is nan" in result.stderr.lower() or "loss is inf" in result.stderr.lower()
  assert "stopping" in result.stderr


@pytest.mark.slow
def test_rerun_of_a_finished_run_does_nothing(tmp_path, caplog, capsys, monkeypatch):
  # A cached CPU peak far below what any step does: MFU stays at most 100%, the steps raise the
  # run's peak and its record (never the machine's cache).
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
  assert "raising the run's peak" in caplog.text
  assert json.loads(flops.cpu_peak_cache().read_text())[key] == 1.0
  assert json.loads((tmp_path / "run" / "mfu_peak.json").read_text())["flops"] > 1e6
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
    achieved = [rng.uniform(0.0, 2e12) for _ in range(flops.RAISE_WINDOW)]
    mfus = [peak.mfu(a) for a in achieved]
    assert all(0 <= m <= 1 for m in mfus)
    # Raised to the median of the intervals so far where, from the third on, it beats the peak.
    assert peak.flops == max([cached] + [statistics.median(achieved[:n]) for n in
                                         range(flops.RAISE_AFTER, len(achieved) + 1)])
    assert mfus[-1] == pytest.approx(min(1.0, achieved[-1] / peak.flops))
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


@pytest.mark.slow
def test_bert_tiny_trains_on_the_embedded_wikipedia_sample(tmp_path, capsys):
  """The README's main job's path with the classic tiny BERT, shortened: with no data.dataset
  the run trains a SentencePiece tokenizer on the embedded sample, builds it into
  WORKDIR/data, trains and evaluates on it; it ends with a summary and a plot, and `bertjax
  plot` compares it with another run."""
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


def _info(step: int, total: int, loss: float = 0.0, **kw) -> hooks.StepInfo:
  phase = types.SimpleNamespace(index=0, batch_size=4, seq_length=8, flops_per_step=1e6)
  return hooks.StepInfo(step=step, total=total, state=None,
                        metrics={"loss": jnp.asarray(loss, jnp.float32)}, phase=phase,
                        compiled=False, started=0.0, **kw)


def test_step_hooks_run_in_order_at_their_cadence():
  calls = []
  step_hooks = hooks.Hooks()
  step_hooks.add(lambda i: calls.append(("every 2", i.step)), every=2)
  step_hooks.add(lambda i: calls.append(("at 3", i.step)), steps=[3])
  step_hooks.add(lambda i: calls.append(("every 4, last", i.step)), every=4, last=True,
                 name="c")
  step_hooks.add(lambda i: calls.append(("never", i.step)))
  for step in range(1, 6):
    step_hooks.run(_info(step, total=5))
  assert calls == [("every 2", 2), ("at 3", 3), ("every 2", 4), ("every 4, last", 4),
                   ("every 4, last", 5)]
  assert step_hooks.names()[2:] == ["c", "<lambda>"]


class _Writer:
  def __init__(self):
    self.records = []

  def write(self, step, metrics, prefix="train"):
    self.records.append((step, prefix, dict(metrics)))


def test_train_metrics_are_read_one_step_late_with_their_steps_values(monkeypatch):
  """A log step's metrics stay on the device until the loop has dispatched the next step;
  then they are written as that step's, timed from read to read with evals left out; the last
  step is read at once; a NaN raises when read."""
  now = [0.0]
  monkeypatch.setattr(hooks.time, "perf_counter", lambda: now[0])
  read = []
  device_get = jax.device_get
  monkeypatch.setattr(hooks.jax, "device_get", lambda x: read.append(x) or device_get(x))
  writer = _Writer()
  train = hooks.TrainMetrics(writer, flops.Peak(1e9, "float32", "test"), step=0)
  log_every, total = 2, 5

  def step(n: int, at: float) -> None:
    """The loop's order: step n dispatched, the previous step's metrics read, the hook."""
    now[0] = at
    train.read_pending()
    now[0] = at + 0.5
    if n % log_every == 0 or n == total:
      train(_info(n, total, loss=10.0 * n))

  step(1, 1.0)
  step(2, 2.0)
  assert writer.records == [] and read == []  # step 2 dispatched: nothing read yet
  step(3, 3.0)  # ... read once step 3 is on its way
  assert [(r[0], r[2]["loss"]) for r in writer.records] == [(2, 20.0)]
  assert writer.records[0][2]["step_time"] == pytest.approx(1.5)  # (3.0 - 0) / 2 steps
  assert train.last["loss"] == 20.0
  train.exclude(1.0)  # an eval
  step(4, 4.0)
  step(5, 7.0)  # the last step: read at once, no step after it
  assert [(r[0], r[2]["loss"]) for r in writer.records] == [(2, 20.0), (4, 40.0), (5, 50.0)]
  assert writer.records[1][2]["step_time"] == pytest.approx((7.0 - 3.0 - 1.0) / 2)
  assert writer.records[2][2]["step_time"] == pytest.approx(7.5 - 7.0)
  assert writer.records[2][2]["tokens_per_sec"] == pytest.approx(4 * 8 / 0.5)
  assert len(read) == 3
  train.read_pending()  # nothing pending: nothing read
  assert len(read) == 3
  train(_info(6, 8, loss=float("nan")))
  now[0] = 9.0
  with pytest.raises(TrainingDiverged, match="loss is nan at step 6"):
    train.read_pending()


def test_the_step_is_dispatched_under_a_transfer_guard(tmp_path, monkeypatch):
  """Batch and state are placed on the devices explicitly before the step; an implicit
  host-to-device transfer inside the step (a NumPy array reaching a jitted function) raises."""
  seen = []
  original = Trainer.step

  def step(self, state, batch):
    seen.append(jax.config.jax_transfer_guard_host_to_device)
    jax.jit(lambda x: x + 1)(np.ones(2, np.float32))  # implicit: refused in the step
    return original(self, state, batch)

  monkeypatch.setattr(Trainer, "step", step)
  config = train_helpers.tiny_config("gpt", num_train_steps=2)
  with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device transfer"):
    loop.train_and_evaluate(config, tmp_path)
  assert seen == ["disallow"]
  # Outside the step the default holds (explicit and implicit transfers alike).
  assert jax.config.jax_transfer_guard_host_to_device is None


@pytest.mark.parametrize("rules, ways", [("data_parallel", 8), ("tensor", 2)])
def test_the_loops_batch_check_uses_the_rules_data_parallel_width(devices, rules, ways):
  """On a 2x2x2 (data, fsdp, tensor) mesh the data_parallel preset splits the batch over all
  three axes (8 ways), the tensor preset over `data` alone (2 ways): a batch of 4 is refused by
  the first and accepted by the second."""
  config = train_helpers.tiny_config("gpt", batch_size=4, sharding_rules=rules,
                                     **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
  trainer = Trainer(config, sharding.mesh_from_config(config))
  assert dict(trainer.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert sharding.batch_ways(trainer.mesh, trainer.rules) == ways
  workload = Pretraining(config, None, is_main=True)  # synthetic data: no dataset to build
  if 4 % ways:
    with pytest.raises(ValueError, match=f"not divisible by the {ways} data-parallel ways"):
      phase_data.PhaseData(workload, trainer, 0)
  else:
    phase = phase_data.PhaseData(workload, trainer, 0)
    phase.batches.close()
    assert phase.rows == (0, 1, 2, 3) and phase.layout.batch_size == 4
  config.batch_size = 8  # a multiple of both widths
  phase_data.PhaseData(workload, trainer, 0).batches.close()
