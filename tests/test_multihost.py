"""Several processes on 127.0.0.1 (gloo collectives) train exactly like one process: on the
synthetic stream and on the real embedded corpus (BERT pairs with dropout, GPT packing), with
1, 2 or 4 processes, the devices in a TPU slice's interleaved order (tests/slice_order.py),
after a kill and a resume on another process count, and to a clean common end of a finite
epoch; a dead peer makes the survivor exit, not hang."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import train_helpers
from xla_env import xla_flags

pytestmark = pytest.mark.slow  # several processes each: the full suite's

ROOT = Path(__file__).resolve().parent.parent
TINY = train_helpers.MULTIPROCESS_TINY


def _train_cmd(workdir: Path, steps: int, *extra: str) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
          str(workdir), f"--config.num_train_steps={steps}", "--config.mesh.data=2",
          "--config.mesh.fsdp=2", "--config.mesh.tensor=2", *TINY, *extra]


def _losses(workdir: Path) -> list[float]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(l)["loss"] for l in lines if json.loads(l)["split"] == "train"]


def test_two_processes_match_one_process(tmp_path):
  single = subprocess.run(_train_cmd(tmp_path / "single", 10), cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu",
                               "XLA_FLAGS": xla_flags(8)})
  assert single.returncode == 0, single.stdout + single.stderr
  multi = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--processes", "2",
                          "--devices", "4", "--", *_train_cmd(tmp_path / "multi", 10)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert multi.returncode == 0, multi.stdout + multi.stderr
  assert "[p1]" in multi.stdout and "process 1 of 2" in multi.stdout
  expected, got = _losses(tmp_path / "single"), _losses(tmp_path / "multi")
  assert len(expected) == len(got) == 10
  for a, b in zip(expected, got):
    assert abs(a - b) <= 1e-5, (expected, got)
  assert expected[-1] < expected[0]


@pytest.mark.parametrize("victim", [1, 0], ids=["kill-worker", "kill-coordinator"])
def test_killing_a_peer_ends_the_survivor(tmp_path, victim):
  port = 20000 + os.getpid() % 20000 + victim
  procs = []
  for i in range(2):
    env = {**os.environ, "BERTJAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "BERTJAX_NUM_PROCESSES": "2", "BERTJAX_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(4), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / f"p{i}.log", "w")
    procs.append(subprocess.Popen(
        _train_cmd(tmp_path / "w", 100000, "--config.distributed.heartbeat_timeout_s=10",
                   "--config.distributed.step_timeout_s=60", "--config.log_every=5"),
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  try:
    deadline = time.monotonic() + 300
    while "train step 10/" not in (tmp_path / "p0.log").read_text():
      assert time.monotonic() < deadline, (tmp_path / "p0.log").read_text()[-3000:]
      assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
      time.sleep(1)
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[1 - victim]
    code = survivor.wait(timeout=120)
    elapsed = time.monotonic() - killed_at
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  output = (tmp_path / f"p{1 - victim}.log").read_text()
  assert code != 0
  assert elapsed < 120
  assert ("another task died" in output or "peer process has probably died" in output
          or "unhealthy" in output), output[-3000:]


# --- the real corpus on any process count ------------------------------------------------------

CORPUS_MODEL = ["--config.model.vocab_size=1024", "--config.model.hidden_size=64",
                "--config.model.num_layers=2", "--config.model.num_heads=4",
                "--config.model.mlp_dim=128", "--config.model.max_positions=64",
                "--config.seq_length=64", "--config.batch_size=16", "--config.max_predictions=10",
                "--config.optimizer.warmup_steps=2", "--config.log_every=1",
                "--config.eval_every=0", "--config.checkpoint.every=2",
                "--config.checkpoint.keep=0", "--config.data.shuffle_window=16"]


@pytest.fixture(scope="module")
def wiki(embedded_1024):
  """The embedded Wikipedia sample built once per tokenizer style (BERT, GPT, T5 and BART
  SentencePiece, 1,024 ids: tests/conftest.py's embedded_1024)."""
  return {style: embedded_1024(style) for style in ("bert", "gpt", "t5", "bart")}


def _corpus_cmd(config: str, workdir: Path, dataset: Path, steps: int, slice_order: bool,
                *extra: str) -> list[str]:
  entry = [str(ROOT / "tests" / "slice_order.py")] if slice_order else ["-m", "bertjax"]
  return [sys.executable, *entry, "train", "--config", config, "--workdir", str(workdir),
          f"--config.num_train_steps={steps}", f"--config.data.dataset={dataset}",
          *CORPUS_MODEL, *extra]


def _launch(processes: int, devices: int, command: list[str], **kwargs) -> subprocess.Popen:
  if processes == 1:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(devices)}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)
  return subprocess.Popen([sys.executable, str(ROOT / "launch" / "local.py"), "--processes",
                           str(processes), "--devices", str(devices), "--", *command],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, **kwargs)


def _run(processes: int, devices: int, command: list[str]) -> str:
  proc = _launch(processes, devices, command)
  output, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, output[-4000:]
  return output


@pytest.mark.parametrize("objective", ["bert_pairs", "gpt_packing", "t5_span_corruption",
                                       "bart_denoising"])
def test_the_real_corpus_trains_the_same_on_any_process_count(wiki, tmp_path, objective):
  """One run of 1 x 8 processes x devices is the reference. A run on 4 x 2, killed (every
  process at once, as a lost slice) after a random step, resumes on 2 x 4 with two loader
  workers per process; both multi-process runs have the devices in a TPU slice's interleaved
  order, so each process's rows are scattered over the batch. Every step's loss (the killed
  run's before its checkpoint, the resumed run's after) and the final parameters equal the
  reference's (losses within 4 float32 spacings, parameters 1e-6; fp32). The GPT runs ramp
  their batch (bertjax.config.ramp: 8 rows for steps 1-7, then 16), so the kill and the resume
  on another process count fall in or right after the ramp. T5's span corruption and BART's denoising draw their noise per example: the
  same examples wherever their rows load."""
  config, style = {"bert_pairs": ("bert_tiny", "bert"), "gpt_packing": ("gpt_tiny", "gpt"),
                   "t5_span_corruption": ("t5:size=tiny", "t5"),
                   "bart_denoising": ("bart:size=tiny", "bart")}[objective]
  dataset = wiki[style]
  extra = ["--config.model.hidden_dropout=0.1", "--config.model.attention_dropout=0.1"]
  if objective == "gpt_packing":
    extra += ["--config.batch_ramp.start_batch_size=8", "--config.batch_ramp.increment=8",
              "--config.batch_ramp.samples=56"]
  reference = tmp_path / "1x8"
  _run(1, 8, _corpus_cmd(config, reference, dataset, 10, False, *extra))

  workdir = tmp_path / "4x2_then_2x4"
  kill_after = random.Random(objective).randint(3, 8)
  proc = _launch(4, 2, _corpus_cmd(config, workdir, dataset, 10, True, *extra),
                 start_new_session=True)

  try:
    deadline = time.monotonic() + 600
    # Past the random step, and a checkpoint committed (an async save may still be in flight
    # when that step is logged).
    while (not (workdir / "metrics.jsonl").exists()
           or max(train_helpers.step_losses(workdir), default=0) < kill_after
           or not train_helpers.committed_steps(workdir)):
      assert proc.poll() is None, proc.stdout.read()[-4000:]
      assert time.monotonic() < deadline
      time.sleep(0.05)
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    killed_output, _ = proc.communicate()
  assert "mesh process indices [0, 1, 2, 3, 0, 1, 2, 3]" in killed_output, killed_output[-3000:]
  assert ("each loads 2 of 8 rows" if objective == "gpt_packing" else "each loads 4 of 16 rows"
          ) in killed_output
  checkpoints = train_helpers.committed_steps(workdir)
  assert checkpoints and checkpoints[-1] < 10
  # Step 1 (the same weights on the same global batch) differs at most by the order in which
  # the collectives sum the 8 per-device partial losses: a few float32 roundings of the loss
  # (1 ulp on one machine, 2 on another, for the same code and batch: the CPU's codegen moves
  # the partial sums' roundings). A wrong row or mask moves it by far more.
  want, got = train_helpers.step_losses(reference), train_helpers.step_losses(workdir)
  assert abs(got[1] - want[1]) <= 4 * float(np.spacing(np.float32(want[1]))), (got[1], want[1])

  resumed = _run(2, 4, _corpus_cmd(config, workdir, dataset, 10, True, *extra,
                                   "--config.data.num_workers=2"))
  assert "mesh process indices [0, 1, 0, 1, 0, 1, 0, 1]" in resumed, resumed[-3000:]
  restored = int(resumed.split("resumed from ")[1].split("step ")[1].split()[0])
  assert restored == checkpoints[-1]
  # Steps 1..restored from the killed run, the rest from the resumed one.
  # Later steps likewise: the losses within 4 float32 spacings, the parameters within 1e-6
  # (what each objective reached: docs/results/2026-11-27-t5-bart-tiny.md).
  train_helpers.assert_same_training(reference, workdir, from_step=1, loss_ulps=4)
  if objective == "gpt_packing":
    sizes = {r["step"]: r["batch_size"] for r in map(json.loads, (
        reference / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"}
    assert [sizes[s] for s in range(1, 11)] == [8] * 7 + [16] * 3


def test_a_finite_epoch_ends_on_every_process_at_the_same_step(wiki, tmp_path):
  """data.num_epochs=1: the run stops where the first row stream runs out, on every process
  at once (no process waits in a collective), at the step a single process stops at."""
  common = ["--config.data.num_epochs=1", "--config.batch_size=64", "--config.log_every=50",
            "--config.checkpoint.every=0"]
  single = _run(1, 8, _corpus_cmd("gpt_tiny", tmp_path / "one", wiki["gpt"], 100000, False,
                                  *common))
  multi = _run(2, 4, _corpus_cmd("gpt_tiny", tmp_path / "two", wiki["gpt"], 100000, True,
                                 *common))
  end = int(single.split("ran out (data.num_epochs=1) after step ")[1].split(":")[0])
  assert 0 < end < 100000
  for process in (0, 1):
    assert f"[p{process}] " in multi and any(
        line.startswith(f"[p{process}] ") and f"ran out (data.num_epochs=1) after step {end}:"
        in line for line in multi.splitlines()), multi[-3000:]
  assert (tmp_path / "two" / "params" / "model.json").is_file()
  steps = [max(train_helpers.step_losses(tmp_path / name)) for name in ("one", "two")]
  assert steps == [end, end]
  assert "[launch] process" not in multi  # both processes exited 0


def test_the_local_launcher_says_which_process_died_and_how():
  script = ("import os, signal, time\n"
            "if os.environ['BERTJAX_PROCESS_ID'] == '1':\n"
            "  os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(120)\n")
  result = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--processes", "2",
                           "--devices", "1", "--grace", "1", "--", sys.executable, "-c", script],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 128 + signal.SIGKILL
  assert "[launch] process 1 was killed by SIGKILL; the others have 1 s to exit" in result.stdout
  assert "[launch] process 0 was killed by SIGTERM" in result.stdout  # ended after the grace
