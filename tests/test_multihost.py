"""Issue 3 acceptance 4: 2 processes x 4 CPU devices on 127.0.0.1 (gloo collectives) train
exactly like one process with 8 devices; a dead peer makes the survivor exit, not hang."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--config.data.source=synthetic_markov", "--config.model.vocab_size=128",
        "--config.model.hidden_size=64",
        "--config.model.num_heads=4", "--config.model.mlp_dim=128",
        "--config.model.max_positions=32", "--config.seq_length=32", "--config.batch_size=16",
        "--config.model.hidden_dropout=0.0", "--config.model.attention_dropout=0.0",
        "--config.eval_every=0", "--config.optimizer.warmup_steps=2", "--config.log_every=1"]


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
                               "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
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
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONUNBUFFERED": "1"}
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
