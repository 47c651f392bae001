"""One run per workdir (bertjax.checkpoints.workdir): a second run is refused while the first
holds the lock, a stale lock is taken over, and a resumed run may change how it runs but not
what it computes without saying so."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import tiny_args

from bertjax import cli
from bertjax.checkpoints.workdir import LOCK_FILE, STALE_S, WorkdirBusy, WorkdirLock, config_changes
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
GPT = ["--config", "gpt_tiny", "--config.data.source=synthetic_markov", *tiny_args(**{
    "model.vocab_size": 128, "optimizer.warmup_steps": 1, "log_every": 1, "eval_every": 0,
    "checkpoint.every": 2})]


def _cmd(workdir: Path, steps: int, *extra: str) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--workdir", str(workdir), *GPT,
          f"--config.num_train_steps={steps}", *extra]


def _env() -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": xla_flags(2)}


def _steps(workdir: Path) -> list[int]:
  return [json.loads(line)["step"] for line in
          (workdir / "metrics.jsonl").read_text().splitlines()]


def _errors(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.slow
def test_a_second_run_in_a_busy_workdir_is_refused(tmp_path):
  workdir = tmp_path / "run"
  first = subprocess.Popen(_cmd(workdir, 100000), cwd=ROOT, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while not (workdir / "metrics.jsonl").exists() or len(_steps(workdir)) < 2:
      assert first.poll() is None and time.time() < deadline
      time.sleep(0.1)
    second = subprocess.run(_cmd(workdir, 100000, "--config.optimizer.learning_rate=0.01"),
                            cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2
    assert "Traceback" not in second.stderr
    errors = _errors(second.stderr)
    assert len(errors) == 1 and f"is in use by pid {first.pid} on {socket.gethostname()}" in \
        errors[0], second.stderr[-2000:]
    first.send_signal(signal.SIGTERM)  # saves and exits 0
    assert first.wait(timeout=300) == 0
  finally:
    if first.poll() is None:
      first.kill()
  steps = _steps(workdir)
  assert steps == sorted(set(steps))  # no step logged twice
  assert json.loads((workdir / "config.json").read_text())["optimizer"]["learning_rate"] == \
      pytest.approx(1e-3)  # the refused run changed nothing
  assert not (workdir / LOCK_FILE).exists()  # released on the way out


@pytest.mark.slow
def test_the_same_command_started_twice_at_once_runs_once(tmp_path):
  workdir = tmp_path / "run"
  procs = [subprocess.Popen(_cmd(workdir, 6), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outputs = [p.communicate(timeout=600) for p in procs]
  codes = sorted(p.returncode for p in procs)
  assert codes == [0, 2], outputs
  refused = outputs[[p.returncode for p in procs].index(2)][1]
  assert "is in use by pid" in refused and "Traceback" not in refused
  assert _steps(workdir) == [1, 2, 3, 4, 5, 6]


def test_stale_locks_are_taken_over_and_live_ones_refused(tmp_path, caplog):
  dead = subprocess.Popen(["true"])
  dead.wait()
  lock_path = tmp_path / LOCK_FILE

  def holder(host, pid, heartbeat):
    lock_path.write_text(json.dumps({"host": host, "pid": pid, "token": "x", "started": 0,
                                     "heartbeat": heartbeat, "command": "bertjax train"}))

  holder(socket.gethostname(), dead.pid, time.time())  # this host, its process gone
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert f"pid {dead.pid} on {socket.gethostname()} is no longer running" in caplog.text
  assert json.loads(lock_path.read_text())["pid"] == os.getpid()
  lock.release()
  assert not lock_path.exists()
  # Killed but never reaped (a container whose init does not reap orphans): a zombie is gone.
  zombie = subprocess.Popen(["sleep", "60"])
  zombie.kill()
  deadline = time.monotonic() + 10
  while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    assert time.monotonic() < deadline
    time.sleep(0.01)
  holder(socket.gethostname(), zombie.pid, time.time())
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert f"pid {zombie.pid} on {socket.gethostname()} is no longer running" in caplog.text
  lock.release()
  zombie.wait()
  # The holder's pid now belongs to a process that started later: the holder is gone.
  record = {"host": socket.gethostname(), "pid": os.getppid(), "pid_start": "1", "token": "x",
            "started": 0, "heartbeat": time.time(), "command": "bertjax train"}
  lock_path.write_text(json.dumps(record))
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert f"pid {os.getppid()} on {socket.gethostname()} is no longer running" in caplog.text
  lock.release()
  record["pid_start"] = open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19]
  lock_path.write_text(json.dumps(record))  # the same pid, started when the holder did: running
  with pytest.raises(WorkdirBusy, match=f"in use by pid {os.getppid()}"):
    WorkdirLock(tmp_path).acquire()
  holder("other-host", 123, time.time() - 5)  # another host, heartbeat fresh: running
  with pytest.raises(WorkdirBusy, match="in use by pid 123 on other-host"):
    WorkdirLock(tmp_path).acquire()
  holder("other-host", 123, time.time() - STALE_S - 60)  # another host, silent: gone
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert "last heartbeat was" in caplog.text
  lock.release()
  # An empty lock: a run killed while refreshing it (before heartbeats replaced the file
  # whole). It failed a T5 multi-process resume in CI with "another run took the lock".
  lock_path.write_text("")
  lock = WorkdirLock(tmp_path)
  lock.acquire()
  assert "does not parse" in caplog.text
  lock._beat = -1e9  # a heartbeat now: the file is replaced, never truncated
  lock.heartbeat()
  assert json.loads(lock_path.read_text())["pid"] == os.getpid()
  assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]
  lock.release()


@pytest.mark.slow
def test_a_resumed_run_may_change_how_it_runs_but_not_what_it_computes(tmp_path, capsys,
                                                                       caplog):
  import logging
  workdir = tmp_path / "run"
  train = ["train", "--workdir", str(workdir), *GPT]
  assert cli.main([*train, "--config.num_train_steps=4"]) == 0
  capsys.readouterr()
  # What the run computes: refused, with the difference named, and nothing written.
  for change, named in (("--config.optimizer.learning_rate=0.0005",
                         "optimizer.learning_rate: 0.001 -> 0.0005"),
                        ("--config.model.hidden_size=32", "model.hidden_size: 64 -> 32")):
    assert cli.main([*train, "--config.num_train_steps=6", change]) == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and named in err and "resume_with_changes" in err, err
    assert _steps(workdir) == [1, 2, 3, 4]
  # How it runs: accepted and listed.
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main([*train, "--config.num_train_steps=6", "--config.log_every=2"]) == 0
  assert "log_every: 1 -> 2; num_train_steps: 4 -> 6" in caplog.text
  assert _steps(workdir) == [1, 2, 3, 4, 6]
  # The user's explicit choice: continued, the change listed as such.
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main([*train, "--config.num_train_steps=8", "--config.log_every=2",
                     "--config.optimizer.learning_rate=0.0005",
                     "--config.resume_with_changes=true"]) == 0
  assert "with a changed config (resume_with_changes): optimizer.learning_rate" in caplog.text
  assert json.loads((workdir / "config.json").read_text())["optimizer"]["learning_rate"] == \
      pytest.approx(5e-4)


def test_config_changes_are_sorted_into_harmless_and_meaningful():
  saved = {"log_every": 1, "mesh": {"data": -1}, "data": {"num_workers": 0, "seed": 0},
           "model": {"hidden_size": 64, "remat_policy": "none"}, "seed": 0}
  current = {"log_every": 5, "mesh": {"data": 2}, "data": {"num_workers": 2, "seed": 1},
             "model": {"hidden_size": 64, "remat_policy": "dots"}, "seed": 3}
  harmless, meaningful = config_changes(saved, current)
  assert [h.split(":")[0] for h in harmless] == [
      "data.num_workers", "log_every", "mesh.data", "model.remat_policy", "seed"]
  assert meaningful == ["data.seed: 0 -> 1"]
  # A checkpoint from before a setting existed resumes; one that loses a setting does not.
  harmless, meaningful = config_changes({"model": {"width": 8}},
                                        {"model": {"width": 8, "lookup": "gather"}})
  assert harmless == ["model.lookup: '<absent>' -> 'gather'"] and not meaningful
  harmless, meaningful = config_changes({"model": {"width": 8, "lookup": "gather"}},
                                        {"model": {"width": 8}})
  assert meaningful == ["model.lookup: 'gather' -> '<absent>'"] and not harmless
