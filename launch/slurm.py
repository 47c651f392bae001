#!/usr/bin/env python3
"""Train on N GPU nodes under SLURM: write an sbatch script — one task per node holding all of
the node's GPUs, the first node of the allocation as the jax.distributed coordinator — and
submit it with sbatch.

In the script, the batch shell exports BERTJAX_COORDINATOR_ADDRESS (first host of
$SLURM_JOB_NODELIST and a port) and BERTJAX_NUM_PROCESSES ($SLURM_NNODES); each task sets
BERTJAX_PROCESS_ID=$SLURM_PROCID inside `srun bash -c '...'` and runs the training command.

Preemption and time limits: the job is submitted with --requeue, so SLURM puts it back in the
queue after a preemption or a node failure; --signal=B:TERM@GRACE makes SLURM send SIGTERM to
the batch shell GRACE seconds before the time limit, which forwards it to the tasks (bertjax
saves a checkpoint and exits 0) and then requeues the job itself. The requeued job runs the
same command with the same workdir and resumes from the latest checkpoint. The workdir must be
on a file system every node sees (NFS, Lustre, GPFS...).
Stdlib only.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from common import data_note, flag_value, split_command

EXAMPLE = """example (4 nodes x 8 GPUs):
  python launch/slurm.py --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
      --setup 'source ~/bertjax/.venv/bin/activate' --dry-run -- \\
      bertjax train --config configs/bert_base.py --workdir /shared/runs/bert-base

  --dry-run prints the sbatch script and the sbatch command without writing or submitting
  anything. Exit codes: 0 submitted, 2 a bad request (no command, no workdir, nodes < 1).
"""


def script(a: argparse.Namespace, train: list[str]) -> str:
  sb = [f"--job-name={a.job_name}", f"--nodes={a.nodes}", "--ntasks-per-node=1",
        f"--gpus-per-node={a.gpus_per_node}"]
  if a.cpus_per_task:
    sb.append(f"--cpus-per-task={a.cpus_per_task}")
  if a.partition:
    sb.append(f"--partition={a.partition}")
  if a.account:
    sb.append(f"--account={a.account}")
  if a.time:
    sb.append(f"--time={a.time}")
  if a.exclusive:
    sb.append("--exclusive")
  sb += ["--requeue", f"--signal=B:TERM@{a.grace}", "--open-mode=append",
         f"--output={a.output}"]
  port = str(a.port) if a.port else "$((20000 + SLURM_JOB_ID % 20000))"
  task = f"export BERTJAX_PROCESS_ID=$SLURM_PROCID; exec {shlex.join(train)}"
  lines = ["#!/bin/bash"] + [f"#SBATCH {x}" for x in sb] + [
      "# Written by launch/slurm.py: one task per node with all its GPUs; the first node is the",
      "# jax.distributed coordinator. Requeued after preemption; resumes from the checkpoint.",
      "set -u",
  ]
  lines += a.setup
  lines += [
      'COORDINATOR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
      f'export BERTJAX_COORDINATOR_ADDRESS="$COORDINATOR:{port}"',
      'export BERTJAX_NUM_PROCESSES="$SLURM_NNODES"',
      'echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_NNODES '
      'nodes, coordinator $BERTJAX_COORDINATOR_ADDRESS"',
      "",
      "# SIGTERM before the time limit (--signal) or on preemption: pass it to the tasks, let",
      "# them save a checkpoint and exit, then put the job back in the queue.",
      "on_term() {",
      '  echo "[slurm] SIGTERM: forwarding to the tasks, then requeueing"',
      '  kill -TERM "$SRUN_PID" 2>/dev/null',
      '  wait "$SRUN_PID"',
      '  scontrol requeue "$SLURM_JOB_ID" || true  # already requeued on preemption',
      "  exit 0",
      "}",
      "trap on_term TERM",
      "",
      f"srun --nodes={a.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
      f"bash -c {shlex.quote(task)} &",
      "SRUN_PID=$!",
      'wait "$SRUN_PID"',
      "RC=$?",
      'echo "[slurm] training exited with $RC"',
      'exit "$RC"',
  ]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  own, train = split_command(argv)
  p = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--nodes", type=int, required=True, help="number of nodes (= JAX processes)")
  p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
  p.add_argument("--cpus-per-task", type=int, help="CPUs per task (= per node)")
  p.add_argument("--partition", help="SLURM partition")
  p.add_argument("--account", help="SLURM account")
  p.add_argument("--time", help="time limit, e.g. 24:00:00 (the job requeues itself at it)")
  p.add_argument("--exclusive", action="store_true", help="whole nodes only")
  p.add_argument("--job-name", default="bertjax", help="job name (default bertjax)")
  p.add_argument("--port", type=int, default=0,
                 help="coordinator port (default: 20000 + job id mod 20000)")
  p.add_argument("--grace", type=int, default=120,
                 help="seconds before the time limit that SIGTERM comes (default 120)")
  p.add_argument("--setup", action="append", default=[],
                 help="a shell line run before srun, e.g. 'source venv/bin/activate' "
                      "or 'module load cuda' (repeatable)")
  p.add_argument("--output", default="%x-%j.out", help="log file pattern (default %%x-%%j.out)")
  p.add_argument("--script", help="where to write the sbatch script (default JOB_NAME.sbatch)")
  p.add_argument("--dry-run", action="store_true", help="print the script and the command")
  a = p.parse_args(own)
  problem = None
  if a.nodes < 1 or a.gpus_per_node < 1:
    problem = "--nodes and --gpus-per-node must be at least 1"
  elif not train:
    problem = ("no training command: put it after --, e.g. -- bertjax train "
               "--config configs/bert_base.py --workdir /shared/runs/RUN")
  elif flag_value(train, "--workdir") is None:
    problem = ("the training command has no --workdir (a directory on a file system every node "
               "sees; the requeued job resumes from it)")
  if problem:
    p.print_usage(sys.stderr)
    print(f"{p.prog}: error: {problem}", file=sys.stderr)
    return 2
  if note := data_note(train):
    print(f"# {note}", file=sys.stderr)
  path = a.script or f"{a.job_name}.sbatch"
  text = script(a, train)
  submit = ["sbatch", path]
  if a.dry_run:
    print(f"cat > {shlex.quote(path)} <<'EOF'")
    sys.stdout.write(text)
    print("EOF")
    print(shlex.join(submit))
    print(f"# logs: tail -f {a.output.replace('%x', a.job_name).replace('%j', 'JOBID')}; "
          f"queue: squeue -u $USER")
    return 0
  Path(path).write_text(text)
  print(f"[launch] wrote {path}\n[launch] {shlex.join(submit)}", flush=True)
  return subprocess.run(submit, check=False).returncode


if __name__ == "__main__":
  sys.exit(main())
