#!/usr/bin/env python3
"""Run one command as N cooperating JAX processes on this machine (127.0.0.1), each with M CPU
devices: the multi-host setup of a pod, in miniature. The multi-host tests use it.

  python launch/local.py --processes 2 --devices 4 -- \\
      bertjax train --config configs/gpt_tiny.py --workdir runs/gpt_2x4

Each process gets BERTJAX_COORDINATOR_ADDRESS / BERTJAX_NUM_PROCESSES / BERTJAX_PROCESS_ID
(read by bertjax.parallel.distributed), JAX_PLATFORMS=cpu and its device count in XLA_FLAGS; output
lines are prefixed with [pN]. Each process leads a process group of its own (it and whatever it
starts), whose pids the launcher prints.

If a process fails (any non-zero status, or a signal), the launcher says which and how, the
others get --grace seconds to notice and exit on their own, then SIGTERM, then --kill-grace
seconds later SIGKILL to their whole process group: a process that is stopped (SIGSTOP) or
stuck where SIGTERM cannot reach it still ends, and no child of it is left behind. The launcher
exits with the first failure's code (128 + N for signal N).

With --restarts N the launcher starts the whole group again, up to N times, when a process
fails in a way a restart cures: a lost peer (exit status 3), a hardware fault found by replay or
the replica check (5), a hang (6) or a kill by a signal. The command resumes from its workdir's
last checkpoint; a user error (2) or a failed run (1) is not restarted.

SIGTERM or Ctrl-C to the launcher is passed on as SIGTERM to every process (bertjax commits a
checkpoint and exits 0); the group is killed --grace seconds later, or at a second signal, and
not restarted. SIGKILL to the launcher (or its process group) kills every process too, on
Linux: each is armed to die with it, as the processes of a lost host do.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(index: int, processes: int, devices: int, port: int) -> dict[str, str]:
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(
      BERTJAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", BERTJAX_NUM_PROCESSES=str(processes),
      BERTJAX_PROCESS_ID=str(index), JAX_PLATFORMS="cpu",
      XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]))
  return env


# One writer at a time: the pumps and the launcher's own messages share sys.stdout, whose text
# layer is not thread-safe (two threads writing at once can drop or merge lines under load).
_OUTPUT = threading.Lock()


def say(message: str) -> None:
  """One line of the launcher's own."""
  with _OUTPUT:
    sys.stdout.write(f"[launch] {message}\n")
    sys.stdout.flush()


def _pump(index: int, stream) -> None:
  for line in iter(stream.readline, ""):
    with _OUTPUT:
      sys.stdout.write(f"[p{index}] {line}")
      sys.stdout.flush()


# Exit statuses a restart cures (bertjax.cli.common): a lost peer, a hardware fault, a hang.
RESTARTABLE = (3, 5, 6)


def restartable(code: int) -> bool:
  """Whether a group that failed with `code` (a process's status, negative for a signal) is
  started again."""
  return code in RESTARTABLE or code < 0


class Interruptions:
  """SIGTERM and SIGINT to the launcher, counted: the first stops the group gently (SIGTERM to
  each process, which saves and exits), a second at once (SIGKILL)."""

  def __init__(self) -> None:
    self.count = 0
    self.name = ""

  def install(self) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    self.count += 1
    self.name = self.name or signal.Signals(signum).name


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=2, help="number of processes (hosts)")
  parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--grace", type=float, default=60.0,
                      help="seconds the others get to exit after one process fails, before "
                           "SIGTERM (60)")
  parser.add_argument("--kill-grace", type=float, default=10.0,
                      help="seconds from SIGTERM to SIGKILL of a process's whole process group "
                           "(10)")
  parser.add_argument("--restarts", type=int, default=0,
                      help="start the group again up to this many times after a lost peer, "
                           "a hardware fault, a hang or a kill (0)")
  parser.add_argument("--dry-run", action="store_true", help="print the commands only")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command given (put it after --)")
  if args.dry_run:
    port = args.port or free_port()
    for i in range(args.processes):
      env = process_env(i, args.processes, args.devices, port)
      keys = ("BERTJAX_COORDINATOR_ADDRESS", "BERTJAX_NUM_PROCESSES", "BERTJAX_PROCESS_ID",
              "JAX_PLATFORMS", "XLA_FLAGS")
      print(" ".join(f"{k}='{env[k]}'" for k in keys) + " " + " ".join(command))
    return 0
  # The processes lead process groups of their own, so the terminal's Ctrl-C reaches only the
  # launcher: it passes it on, and still kills them if they do not exit.
  interruptions = Interruptions()
  interruptions.install()
  for attempt in range(args.restarts + 1):
    code = run_group(args, command, args.port or free_port(), attempt, interruptions)
    if (code == 0 or interruptions.count or not restartable(exit_code_of(code))
        or attempt == args.restarts):
      return code
    say(f"restart {attempt + 1} of {args.restarts}: a process {how(exit_code_of(code))}; "
        "starting the group again")
  return code


def run_group(args: argparse.Namespace, command: list[str], port: int, attempt: int,
              interruptions: Interruptions) -> int:
  """Runs the group once; the first failure's status (128 + N for signal N)."""
  procs, pumps = [], []
  try:
    # Every process is started before the first pump thread: the child's setup function runs
    # between fork and exec, which is safe only while the launcher has one thread.
    for i in range(args.processes):
      # stdin from /dev/null: a process of a background process group that read the terminal
      # would be stopped by SIGTTIN.
      procs.append(subprocess.Popen(
          command, env=process_env(i, args.processes, args.devices, port),
          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
          process_group=0, preexec_fn=dies_with(os.getpid())))
    for i, proc in enumerate(procs):
      pumps.append(threading.Thread(target=_pump, args=(i, proc.stdout), daemon=True))
      pumps[-1].start()
    say(f"group started (attempt {attempt + 1}): "
        + ", ".join(f"p{i} pid {p.pid}" for i, p in enumerate(procs)))
    first_failure = supervise(args, procs, interruptions)
  finally:
    # Whatever a process started and left running (a data worker, a grandchild holding its
    # pipe) goes with it, and so does the whole group if the launcher itself fails.
    for proc in procs:
      kill_group(proc)
    for proc in procs:
      proc.wait()
    # Every line the processes wrote is passed on before the launcher exits (the pumps end at
    # their pipes' end; a grandchild that left the process group gets a few seconds).
    for pump in pumps:
      pump.join(timeout=10)
  # A process killed by a signal: the shell's convention, 128 + the signal number.
  return 128 - first_failure if first_failure < 0 else first_failure


def dies_with(launcher: int):
  """The setup each process runs before its command (Linux): SIGKILL when the launcher dies.

  The processes lead process groups of their own, so a kill of the launcher's group (a lost
  host: `kill -9 -PGID`, a job scheduler ending the job step) would not reach them; without
  this they trained on as orphans, wrote checkpoints past the one the kill left and raced the
  restarted run for the workdir. None where the platform has no parent-death signal."""
  if not sys.platform.startswith("linux"):
    return None
  libc = ctypes.CDLL(None, use_errno=True)
  pr_set_pdeathsig = 1

  def setup() -> None:
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before the signal was armed
      os.kill(os.getpid(), signal.SIGKILL)

  return setup


def supervise(args: argparse.Namespace, procs: list[subprocess.Popen],
              interruptions: Interruptions) -> int:
  """Waits for every process to end, stopping the rest once one fails (or the launcher is
  interrupted): --grace seconds, SIGTERM, --kill-grace seconds, SIGKILL. The first failure's
  status (negative for a signal)."""
  first_failure, failed_at, reported = 0, None, set()
  termed_at, kill_after, killed, seen_interruptions = None, args.kill_grace, False, 0
  while True:
    for i, p in enumerate(procs):
      if p.poll() not in (None, 0) and i not in reported:
        reported.add(i)
        if failed_at is None:
          first_failure, failed_at = p.returncode, time.monotonic()
        running = sum(q.poll() is None for q in procs)
        say(f"process {i} {how(p.returncode)}"
            + (f"; the others have {args.grace:.0f} s to exit" if running else ""))
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    if not running:
      return first_failure
    now = time.monotonic()
    if interruptions.count > seen_interruptions:
      seen_interruptions = interruptions.count
      if termed_at is None:
        say(f"{interruptions.name}: SIGTERM to every process (each commits a checkpoint and "
            f"exits); SIGKILL in {args.grace:.0f} s or at a second signal")
        terminate(procs, running)
        termed_at, kill_after = now, args.grace
      elif not killed:  # a signal while the group is being stopped already: at once
        say(f"{interruptions.name}: SIGKILL to the process group of {describe(procs, running)}")
        kill(procs, running)
        killed = True
    if failed_at is not None and termed_at is None and now - failed_at > args.grace:
      say(f"{len(running)} process(es) still running {args.grace:.0f} s after the first "
          f"failure: SIGTERM to {describe(procs, running)}; SIGKILL in {args.kill_grace:.0f} s")
      terminate(procs, running)
      termed_at, kill_after = now, args.kill_grace
    if termed_at is not None and not killed and now - termed_at > kill_after:
      say(f"still running {kill_after:.0f} s after SIGTERM: SIGKILL to the process group of "
          f"{describe(procs, running)}")
      kill(procs, running)
      killed = True
    time.sleep(0.2)


def terminate(procs: list[subprocess.Popen], indices: list[int]) -> None:
  """SIGTERM to the processes themselves (not their groups: a data worker is the process's to
  stop)."""
  for i in indices:
    if procs[i].poll() is None:
      procs[i].terminate()


def kill(procs: list[subprocess.Popen], indices: list[int]) -> None:
  for i in indices:
    kill_group(procs[i])


def kill_group(proc: subprocess.Popen) -> None:
  """SIGKILL to `proc`'s process group (it leads it): works on a stopped process as on any."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # the group has ended already


def describe(procs: list[subprocess.Popen], indices: list[int]) -> str:
  """'process 1 (pid 4242, stopped)' for each of `indices`."""
  return ", ".join(f"process {i} (pid {procs[i].pid}"
                   + (", stopped: SIGTERM waits until it is continued" if stopped(procs[i].pid)
                      else "") + ")" for i in indices)


def stopped(pid: int) -> bool:
  """Whether `pid` is stopped (SIGSTOP, SIGTSTP, a debugger), from Linux's /proc; False where
  there is none."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  # The state follows the command name, which is in parentheses and may hold any character.
  return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def exit_code_of(status: int) -> int:
  """A group's status back as a process's (a signal's 128 + N as -N)."""
  return 128 - status if status > 128 else status


def how(code: int) -> str:
  """'exited with 3' or 'was killed by SIGKILL'."""
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with {code}"


if __name__ == "__main__":
  sys.exit(main())
