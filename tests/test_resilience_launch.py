"""Faults across processes and restarts, through launch/local.py as a user runs it: the same
spike decisions on 1 x 8 and 2 x 4 processes x devices; a hang in a data worker or a
collective found within the watchdog's limit, every process's stacks in the log, the group
restarted and the run finished from its checkpoint; a stopped process (SIGSTOP) killed with
its process group and the group restarted without a person, ending bit-exact with an
uninterrupted run; a process made 20% slower named; and the goodput ledger of a run with an
injected compile delay, a late batch, a kill and a restore, whose categories add up to the
wall clock and put each disruption where it belongs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import train_helpers

from bertjax.resilience import ledger

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _train_args(workdir: Path, steps: int = 30, **config) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
          str(workdir), *train_helpers.MULTIPROCESS_TINY, f"--config.num_train_steps={steps}",
          "--config.checkpoint.every=10", "--config.resilience.spike_min_history=8",
          *(f"--config.{k}={v}" for k, v in config.items())]


def _launch(processes: int, args: list[str], restarts: int = 0,
            timeout: float = 600) -> tuple[int, str, float]:
  start = time.time()
  result = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--processes",
                           str(processes), "--devices", str(8 // processes), "--grace", "30",
                           "--restarts", str(restarts), "--", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
  return result.returncode, result.stdout + result.stderr, time.time() - start


def _events(workdir: Path) -> list[dict]:
  return [json.loads(x) for x in (workdir / "resilience.jsonl").read_text().splitlines()]


def test_two_layouts_make_the_same_decisions(tmp_path):
  """A NaN batch at position 24 and a poisoned window at 12..14 (x50): rewinds, skips and
  replay verdicts are the same on 1 x 8 and 2 x 4 (losses to float32 rounding: gloo sums in
  another order)."""
  decisions = {}
  for processes in (1, 2):
    workdir = tmp_path / f"p{processes}"
    code, out, _ = _launch(processes, _train_args(workdir, steps=40, **{
        "faults.nan": "24", "faults.poison": "12,13,14"}))
    assert code == 0, out[-3000:]
    decisions[processes] = _events(workdir)
  one, two = decisions[1], decisions[2]
  assert [e["kind"] for e in one] == [e["kind"] for e in two]
  assert [e["kind"] for e in one].count("rewind") == 2
  for a, b in zip(one, two):
    for key in a:
      if key in ("loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, nan_ok=True), (a, b)
      else:
        assert a[key] == b[key], (key, a, b)


def test_data_trouble_around_an_earlier_rewind_is_no_hardware_fault(tmp_path):
  """Poisoned batches at 14, 33 and 36 and a NaN batch at 30, through launch/local.py with a
  restart allowed: the NaN rewinds to step 30, then three skips within the window alarm from
  step 15, whose replay starts at checkpoint 10, before that rewind. The run ends with status
  0 and the poisoned batches skipped; it once replayed onto the skipped NaN batch and exited 5
  (a hardware fault for data faults alone), twice."""
  code, out, _ = _launch(2, _train_args(tmp_path, steps=40, **{
      "faults.poison": "14,33,36", "faults.nan": "30"}), restarts=1)
  assert code == 0, out[-3000:]
  events = _events(tmp_path)
  assert not [e for e in events if e["kind"] == "hardware_fault"], events
  assert [(e["rewound_to"], e["replay"]) for e in events if e["kind"] == "rewind"] == [
      (30, "reproduced"), (10, "reproduced")], events
  assert "[launch] group started (attempt 2)" not in out  # no restart was needed


@pytest.mark.parametrize("where", ["data", "collective"])
def test_a_hang_is_found_dumped_and_restarted(tmp_path, where):
  """Process 1's batch of step 15 never comes (data), or process 1 never sends step 15
  (collective). Floor 5 s (the default 60 s would make a slow test): the hang is found within
  max(3 x p99, floor) plus the watchdog's poll, both processes' stacks are in the log and in
  WORKDIR/hangs, both exit with status 6, the launcher starts the group again and the run ends
  from its step-10 checkpoint."""
  workdir = tmp_path / "run"
  code, out, _ = _launch(2, _train_args(workdir, **{
      "faults.hang": f"{where}:15", "faults.process": 1, "resilience.hang_floor_s": 5}),
      restarts=1)
  assert code == 0, out[-4000:]
  found = re.findall(r"\[p(\d)\] bertjax: process \d of 2: hang: .*?no step completed here in "
                     r"(\d+) s \(limit (\d+) s", out)
  assert sorted(p for p, _, _ in found) == ["0", "1"], out[-4000:]
  print(f"{where} hang: (process, waited s, limit s) {found}")
  first = min(found, key=lambda f: int(f[1]))
  assert int(first[1]) <= int(first[2]) + 1
  stack = "hang_data" if where == "data" else "before_step"
  assert f"in {stack}" in out  # process 1's stack shows where it hangs
  assert "[launch] restart 1 of 1: a process exited with 6" in out
  assert f"resumed from {workdir / 'checkpoints'} step 10" in out
  assert "run finished at step 30 of 30" in out
  assert sorted(p.name for p in (workdir / "hangs").iterdir()) == [
      "attempt-0001-process-0.txt", "attempt-0001-process-1.txt"]
  joined = ledger.report(ledger.read_attempts(workdir))
  assert joined["seconds"]["hung"] >= 4.0


def _children(parent: int) -> dict[int, int]:
  """The processes `parent` started, by BERTJAX_PROCESS_ID: their pids, from Linux's /proc."""
  found = {}
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rpartition(")")[2].split()
      if int(fields[1]) != parent:
        continue
      environ = (stat.parent / "environ").read_bytes().split(b"\0")
    except (OSError, IndexError, ValueError):
      continue  # ended meanwhile
    for item in environ:
      if item.startswith(b"BERTJAX_PROCESS_ID="):
        found[int(item.split(b"=", 1)[1])] = int(stat.parent.name)
  return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the processes in /proc")
def test_a_stopped_process_is_killed_and_the_group_restarts(tmp_path):
  """Process 1 is stopped (SIGSTOP) after the step-10 checkpoint, as a frozen host would be:
  process 0's watchdog (floor 5 s) finds the hang and exits 6; process 1, which SIGTERM does
  not reach while stopped, is killed with its process group --grace (10 s) plus --kill-grace
  (the default 10 s) later. The group starts again without a person within max(3 x the
  watchdog's limit, 60 s) of the stop, resumes from its last checkpoint and ends with every
  step's loss and the final parameters bit-exact with an uninterrupted run's."""
  steps = 24
  watchdog = {"resilience.hang_floor_s": 5, "distributed.step_timeout_s": 60}
  reference = tmp_path / "reference"
  code, out, _ = _launch(2, _train_args(reference, steps=steps, **watchdog))
  assert code == 0, out[-3000:]
  workdir = tmp_path / "run"
  launcher = subprocess.Popen(
      [sys.executable, str(ROOT / "launch" / "local.py"), "--processes", "2", "--devices", "4",
       "--grace", "10", "--restarts", "1", "--", *_train_args(workdir, steps=steps, **watchdog)],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: list[tuple[float, str]] = []  # (time.monotonic() when read, line)

  def read() -> None:
    for line in launcher.stdout:
      lines.append((time.monotonic(), line))

  def output() -> str:
    return "".join(line for _, line in list(lines))

  def restarted_at() -> float | None:
    return next((t for t, line in list(lines) if line.startswith(
        "[launch] restart 1 of 1: a process exited with 6")), None)

  def bound() -> float:
    """max(3 x the watchdog's limit, 60 s): the limit process 0 found the hang with, or
    step_timeout_s until it has."""
    found = re.search(r"\[p0\] bertjax: process 0 of 2: hang: .*?\(limit (\d+) s", output())
    return max(3 * (int(found.group(1)) if found else watchdog["distributed.step_timeout_s"]),
               60)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    deadline = time.monotonic() + 300
    while not ((workdir / "metrics.jsonl").exists()
               and max(train_helpers.step_losses(workdir), default=0) >= 12
               and 10 in train_helpers.committed_steps(workdir)):
      assert launcher.poll() is None and time.monotonic() < deadline, output()[-3000:]
      time.sleep(0.05)
    stopped_pid = _children(launcher.pid)[1]
    os.kill(stopped_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    while (restarted_at() is None and launcher.poll() is None
           and time.monotonic() - stopped_at <= bound() + 5):
      time.sleep(0.2)
    assert restarted_at() is not None, (
        f"no restart {time.monotonic() - stopped_at:.0f} s after the stop\n{output()[-4000:]}")
    print(f"stopped process: the group restarted {restarted_at() - stopped_at:.1f} s after the "
          f"stop (bound {bound()} s)")
    assert restarted_at() - stopped_at <= bound(), output()[-4000:]
    launcher.wait(timeout=600)
  finally:
    if launcher.poll() is None:  # the run did not end: nothing of it is left running
      for pid in _children(launcher.pid).values():
        if os.getpgid(pid) == pid:  # a group of its own: take its children too
          os.killpg(pid, signal.SIGKILL)
        else:
          os.kill(pid, signal.SIGKILL)
      launcher.kill()
      launcher.wait()
  reader.join(timeout=30)
  out = output()
  assert launcher.returncode == 0, out[-4000:]
  assert re.search(rf"SIGKILL to the process group of process 1 \(pid {stopped_pid}, stopped",
                   out), out[-4000:]
  assert not Path(f"/proc/{stopped_pid}").exists()  # killed and reaped
  resumed = int(re.search(rf"resumed from {re.escape(str(workdir / 'checkpoints'))} step (\d+)",
                          out).group(1))
  assert resumed >= 10 and f"run finished at step {steps} of {steps}" in out
  assert train_helpers.step_losses(workdir) == train_helpers.step_losses(reference)
  expected, got = train_helpers.final_params(reference), train_helpers.final_params(workdir)
  assert expected.keys() == got.keys()
  for name in expected:
    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_slower_host_is_named(tmp_path):
  workdir = tmp_path / "run"
  code, out, _ = _launch(2, _train_args(workdir, **{"faults.slow_process": 1,
                                                    "faults.slow_fraction": 0.2}))
  assert code == 0, out[-3000:]
  assert re.search(r"process 1 is slower than its peers: its own work per step exceeds the "
                   r"fastest process's by \d+% of the step time", out), out[-3000:]
  assert "process 0 is slower" not in out
  record = ledger.read_attempts(workdir)[0]
  print(f"slow host: {record['slow_hosts']}")
  assert list(record["slow_hosts"]) == ["1"] and record["slow_hosts"]["1"] > 0.1
  assert "slow host(s): process 1" in "\n".join(ledger.table(workdir))


COMPILE_DELAY_S, DATA_DELAY_S, KILL_AFTER = 12.0, 4.0, 17


def test_the_ledger_adds_up_and_puts_each_disruption_in_its_category(tmp_path):
  """A run with the compile delayed 12 s, the batch of step 6 late 4 s and a SIGKILL after step
  17 (its checkpoint is step 10), restarted by the launcher. The categories add up to the wall
  clock within 1%; the first attempt's compile holds the injected delay once (see below), its
  data wait exceeds a baseline's by the injected delay within 5%; the 7 steps trained past the checkpoint are lost time; the second
  attempt restores.

  The compile baseline is a clean run's first attempt: a resumed attempt compiles ~0.3 s
  faster (its restore has traced the model already), which the second attempt would count
  against the ledger. The data-wait baseline is the second attempt's, per step."""
  clean = tmp_path / "clean"
  code, out, _ = _launch(1, _train_args(clean, steps=2))
  assert code == 0, out[-3000:]
  baseline_compile = ledger.read_attempts(clean)[0]["seconds"]["compile"]
  workdir = tmp_path / "run"
  code, out, outside = _launch(1, _train_args(workdir, **{
      "faults.compile_delay_s": COMPILE_DELAY_S, "faults.data_delay": f"5:{DATA_DELAY_S}",
      "faults.kill": KILL_AFTER}), restarts=1)
  assert code == 0, out[-3000:]
  assert "[launch] restart 1 of 1: a process was killed by SIGKILL" in out
  first, second = ledger.read_attempts(workdir)
  joined = ledger.report([first, second])
  print(f"compile baseline {baseline_compile:.3f} s; ledger: wall {joined['wall']:.2f} s "
        f"(launcher {outside:.2f} s), categories "
        f"{ {k: round(v, 3) for k, v in joined['seconds'].items()} }; first attempt "
        f"{first['seconds']}, {first['steps']} steps; second {second['seconds']}, "
        f"{second['steps']} steps")
  measured = sum(v for k, v in joined["seconds"].items() if k != "other")
  assert abs(measured - joined["wall"]) <= 0.01 * joined["wall"], joined
  # The ledger's wall clock is the launcher's, less the launcher's own start and each
  # process's exit after its last record (interpreter and jax.distributed shutdown: under
  # 1.5 s an attempt here).
  assert 0 <= outside - joined["wall"] <= 1.5 * 2, (joined["wall"], outside)
  # The delay is counted as compile time, whole and once: the category holds the 12 s sleep
  # and the compile itself. That compile is not the clean baseline's to the second on a shared
  # machine: under the other xdist worker's load it took 2.0 s more in one CI run and 2.5 s
  # less in another (baselines of 3-4 s), so the compile's own share may be up to twice the
  # baseline; a delay counted elsewhere (compile ≈ the baseline) or twice (≥ 24 s) still fails.
  compile_s = first["seconds"]["compile"]
  assert COMPILE_DELAY_S <= compile_s <= COMPILE_DELAY_S + 2 * baseline_compile + 1.0, (
      compile_s, baseline_compile)
  natural = second["seconds"]["data_wait"] * first["steps"] / second["steps"]
  extra_data = first["seconds"]["data_wait"] - natural
  assert abs(extra_data - DATA_DELAY_S) <= 0.05 * DATA_DELAY_S, extra_data
  assert first["restored_step"] is None and second["restored_step"] == 10
  redone = KILL_AFTER - 10
  lost = joined["attempts"][0]["lost"]
  assert lost == pytest.approx(redone * first["seconds"]["productive"] / first["steps"])
  assert second["seconds"]["restore"] > 0 and joined["seconds"]["down"] > 0
  table = "\n".join(ledger.table(workdir))
  assert "2 attempt(s)" in table and "resumed at step 10" in table
