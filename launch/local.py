#!/usr/bin/env python3
"""Run one command as N cooperating JAX processes on this machine (127.0.0.1), each with M CPU
devices: the multi-host setup of a pod, in miniature. The multi-host tests use it.

  python launch/local.py --processes 2 --devices 4 -- \\
      bertjax train --config configs/gpt_tiny.py --workdir runs/gpt_2x4

Each process gets BERTJAX_COORDINATOR_ADDRESS / BERTJAX_NUM_PROCESSES / BERTJAX_PROCESS_ID
(read by bertjax.parallel.distributed), JAX_PLATFORMS=cpu and its device count in XLA_FLAGS; output
lines are prefixed with [pN]. If a process fails, the launcher says which and how (its exit
status or the signal that killed it), the others get --grace seconds to notice and exit on
their own, then are terminated; the launcher exits with the first failure's code (128 + N for
signal N).

With --restarts N the launcher starts the whole group again, up to N times, when a process
fails in a way a restart cures: a lost peer (exit status 3), a hardware fault found by replay or
the replica check (5), a hang (6) or a kill by a signal. The command resumes from its workdir's
last checkpoint; a user error (2) or a failed run (1) is not restarted.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


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


# One writer at a time: the pumps share sys.stdout, whose text layer is not thread-safe (two
# threads writing at once can drop or merge lines under load).
_OUTPUT = threading.Lock()


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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=2, help="number of processes (hosts)")
  parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
  parser.add_argument("--grace", type=float, default=60.0,
                      help="seconds the others get to exit after one process fails")
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
  for attempt in range(args.restarts + 1):
    code = run_group(args, command, args.port or free_port())
    if code == 0 or not restartable(exit_code_of(code)) or attempt == args.restarts:
      return code
    print(f"[launch] restart {attempt + 1} of {args.restarts}: a process "
          f"{how(exit_code_of(code))}; starting the group again", flush=True)
  return code


def run_group(args: argparse.Namespace, command: list[str], port: int) -> int:
  """Runs the group once; the first failure's status (128 + N for signal N)."""
  procs, pumps = [], []
  for i in range(args.processes):
    proc = subprocess.Popen(command, env=process_env(i, args.processes, args.devices, port),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pumps.append(threading.Thread(target=_pump, args=(i, proc.stdout), daemon=True))
    pumps[-1].start()
    procs.append(proc)
  first_failure, failed_at, reported = 0, None, set()

  def report(i: int, code: int) -> None:
    reported.add(i)
    running = sum(p.poll() is None for p in procs)
    print(f"[launch] process {i} {how(code)}"
          + (f"; the others have {args.grace:.0f} s to exit" if running else ""), flush=True)

  while True:
    running = [p.poll() is None for p in procs]
    for i, p in enumerate(procs):
      if p.returncode not in (None, 0) and i not in reported:
        if failed_at is None:
          first_failure, failed_at = p.returncode, time.monotonic()
        report(i, p.returncode)
    if not any(running):
      break
    if failed_at is not None and time.monotonic() - failed_at > args.grace:
      for p in procs:
        if p.poll() is None:
          p.terminate()
    time.sleep(0.2)
  # Every line the processes wrote is passed on before the launcher exits (the pumps end at
  # their pipes' end; a grandchild still holding a pipe open gets a few seconds).
  for pump in pumps:
    pump.join(timeout=10)
  # A process killed by a signal: the shell's convention, 128 + the signal number.
  return 128 - first_failure if first_failure < 0 else first_failure


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
