#!/usr/bin/env python3
"""Train on N nodes under SLURM: write an sbatch script — one task (JAX process) per node holding
all of the node's GPUs by default, the first node of the allocation as the jax.distributed
coordinator — and submit it with sbatch.

In the script, the batch shell exports BERTJAX_COORDINATOR_ADDRESS (first host of
$SLURM_JOB_NODELIST and a port) and BERTJAX_NUM_PROCESSES ($SLURM_NTASKS); each task sets
BERTJAX_PROCESS_ID=$SLURM_PROCID inside `srun bash -c '...'` and runs the training command.
`--gpus-per-node 0` asks for no GPUs (CPU nodes), where `--tasks-per-node` can run several
processes per node. The submitting shell's environment goes with the job (sbatch's default
--export=ALL).

Preemption and time limits: the job is submitted with --requeue, so SLURM puts it back in the
queue after a node failure. A preemption with a grace time (PreemptMode=REQUEUE, GraceTime)
sends SIGTERM to the tasks: bertjax commits a checkpoint and exits 0, and the batch shell,
seeing the preemption in `scontrol show job`, requeues the job. --signal=B:TERM@GRACE makes
SLURM send SIGTERM to the batch shell GRACE seconds before the time limit; it forwards it to
the tasks (through scancel: srun would cancel the step on a SIGTERM of its own) and requeues
the job. The requeued job runs the same command with the same workdir and resumes from the
latest checkpoint. The workdir must be on a file system every node sees (NFS, Lustre,
GPFS...).

Failures: the first task to exit non-zero or be killed ends the step (srun --kill-on-bad-exit:
SIGCONT, SIGTERM, SIGKILL after KillWait, to every process of it), so a stopped or hung task
does not hold the job. Each task's shell records the step's first failure in
WORKDIR/slurm_first_failure; when that is one a restart cures (3, 5, 6 or a kill by a signal,
as launch/local.py restarts) the job requeues itself, up to --max-restarts times.
tests/test_slurm.py runs all of this on a one-node cluster. Stdlib only.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from common import data_note, flag_value, split_command

# In the workdir: "STATUS TASK" of the first task of the job's step to exit non-zero.
FIRST_FAILURE = "slurm_first_failure"

EXAMPLE = """example (4 nodes x 8 GPUs):
  python launch/slurm.py --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
      --setup 'source ~/bertjax/.venv/bin/activate' --dry-run -- \\
      bertjax train --config configs/bert_base.py --workdir /shared/runs/bert-base

  --dry-run prints the sbatch script and the sbatch command without writing or submitting
  anything. Exit codes: 0 submitted, 2 a bad request (no command, no workdir, nodes < 1).
"""


def script(a: argparse.Namespace, train: list[str]) -> str:
  sb = [f"--job-name={a.job_name}", f"--nodes={a.nodes}",
        f"--ntasks-per-node={a.tasks_per_node}"]
  if a.gpus_per_node:
    sb.append(f"--gpus-per-node={a.gpus_per_node}")
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
  workdir = Path(flag_value(train, "--workdir"))
  first_failure = shlex.quote(str(workdir / FIRST_FAILURE))
  # Each task's shell outlives its command to record the group's first failure (srun reports
  # only the worst status, which after --kill-on-bad-exit is a peer it killed). `trap :` keeps
  # the shell through a SIGTERM (a preemption, the step's end) without passing the trap on:
  # the command gets the signal itself, saves and exits, and the shell passes its status on.
  # The first task to fail creates the file (set -C: O_EXCL); the others cannot overwrite it.
  task = "; ".join([
      "export BERTJAX_PROCESS_ID=$SLURM_PROCID", "trap : TERM", shlex.join(train),
      "STATUS=$?",
      f'if [ $STATUS != 0 ]; then (set -C; echo "$STATUS $SLURM_PROCID" > {first_failure}) '
      "2>/dev/null; fi",
      "exit $STATUS"])
  lines = ["#!/bin/bash"] + [f"#SBATCH {x}" for x in sb] + [
      f"# Written by launch/slurm.py: {a.tasks_per_node} task(s) per node, each a JAX process; "
      "the first",
      "# node is the jax.distributed coordinator. Requeued after preemption; resumes from the",
      "# checkpoint.",
      "set -u",
  ]
  lines += a.setup
  lines += [
      'COORDINATOR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
      f'export BERTJAX_COORDINATOR_ADDRESS="$COORDINATOR:{port}"',
      'export BERTJAX_NUM_PROCESSES="$SLURM_NTASKS"',
      'echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NTASKS '
      'processes on $SLURM_NNODES node(s), coordinator $BERTJAX_COORDINATOR_ADDRESS"',
      "",
      "# SIGTERM to this shell (--signal, before the time limit): pass it to the tasks, let",
      "# them save a checkpoint and exit, then put the job back in the queue. The tasks are",
      "# signalled through scancel (job steps only): a SIGTERM to srun itself would cancel",
      "# the step and kill the tasks before they save.",
      "on_term() {",
      '  echo "[slurm] SIGTERM: forwarding to the tasks, then requeueing"',
      '  scancel --signal=TERM "$SLURM_JOB_ID"',
      '  wait "$SRUN_PID"',
      '  scontrol requeue "$SLURM_JOB_ID" || true  # already requeued on preemption',
      "  exit 0",
      "}",
      "trap on_term TERM",
      "",
      "# --kill-on-bad-exit: the first task to exit non-zero (or be killed) ends the step:",
      "# SIGCONT and SIGTERM to every process of it, SIGKILL after the cluster's KillWait.",
      f"FIRST_FAILURE={first_failure}",
      'rm -f "$FIRST_FAILURE"',
      f"srun --nodes={a.nodes} --ntasks-per-node={a.tasks_per_node} --kill-on-bad-exit=1 "
      f"bash -c {shlex.quote(task)} &",
      "SRUN_PID=$!",
      'wait "$SRUN_PID"',
      "RC=$?",
      'echo "[slurm] training exited with $RC"',
      "# A preemption with a grace time signals the tasks only: they save and exit 0, and the",
      "# job would end as completed. SLURM records the preemption (PreemptTime, reset by a",
      "# requeue): put the job back in the queue.",
      'if scontrol show job "$SLURM_JOB_ID" | grep -q "PreemptTime=[0-9]"; then',
      '  echo "[slurm] preempted: requeueing"',
      '  scontrol requeue "$SLURM_JOB_ID"',
      "fi",
      "# What a restart cures, as launch/local.py decides it from the first failure: a lost",
      "# peer (3), a hardware fault found by replay or the replica check (5), a hang (6), a",
      "# task killed by a signal (128 + N: a stopped or dead peer's, the OOM killer's). The run",
      "# resumes from its last checkpoint in a requeued job, up to --max-restarts times. Without",
      "# the first failure's record (a task's shell killed too), bertjax's own WORKDIR/exit.json",
      "# (written on 3, 5 and 6), then srun's status.",
      "STATUS=$RC",
      f"EXIT_FILE={shlex.quote(str(workdir / 'exit.json'))}",
      'if [ "$RC" != 0 ] && [ -f "$FIRST_FAILURE" ]; then',
      '  read -r STATUS TASK < "$FIRST_FAILURE"',
      '  echo "[slurm] first failure: task $TASK exited with status $STATUS"',
      'elif [ "$RC" != 0 ] && [ -f "$EXIT_FILE" ]; then',
      '  STATUS=$(sed -n \'s/.*"status": \\([0-9]*\\).*/\\1/p\' "$EXIT_FILE")',
      "fi",
      'case "$STATUS" in',
      "  3|5|6|129|1[3-9][0-9]|2[0-5][0-9])",
      f'    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {a.max_restarts} ]; then',
      '      echo "[slurm] exit status $STATUS: requeueing (restart '
      f'$((${{SLURM_RESTART_COUNT:-0}} + 1)) of {a.max_restarts})"',
      '      scontrol requeue "$SLURM_JOB_ID"',
      "    fi;;",
      "esac",
      'exit "$RC"',
  ]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  own, train = split_command(argv)
  p = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--nodes", type=int, required=True, help="number of nodes")
  p.add_argument("--gpus-per-node", type=int, default=8,
                 help="GPUs per node (default 8; 0: CPU nodes, no GPUs requested)")
  p.add_argument("--tasks-per-node", type=int, default=1,
                 help="JAX processes per node (default 1, holding all the node's GPUs; more "
                      "only on CPU nodes)")
  p.add_argument("--cpus-per-task", type=int, help="CPUs per task (per JAX process)")
  p.add_argument("--partition", help="SLURM partition")
  p.add_argument("--account", help="SLURM account")
  p.add_argument("--time", help="time limit, e.g. 24:00:00 (the job requeues itself at it)")
  p.add_argument("--exclusive", action="store_true", help="whole nodes only")
  p.add_argument("--job-name", default="bertjax", help="job name (default bertjax)")
  p.add_argument("--port", type=int, default=0,
                 help="coordinator port (default: 20000 + job id mod 20000)")
  p.add_argument("--grace", type=int, default=120,
                 help="seconds before the time limit that SIGTERM comes (default 120)")
  p.add_argument("--max-restarts", dest="max_restarts", type=int, default=3,
                 help="requeue the job after a lost peer, a hardware fault or a hang (exit "
                      "status 3, 5, 6) up to this many times (default 3)")
  p.add_argument("--setup", action="append", default=[],
                 help="a shell line run before srun, e.g. 'source venv/bin/activate' "
                      "or 'module load cuda' (repeatable)")
  p.add_argument("--output", default="%x-%j.out", help="log file pattern (default %%x-%%j.out)")
  p.add_argument("--script", help="where to write the sbatch script (default JOB_NAME.sbatch)")
  p.add_argument("--dry-run", action="store_true", help="print the script and the command")
  a = p.parse_args(own)
  problem = None
  if a.nodes < 1 or a.tasks_per_node < 1 or a.gpus_per_node < 0:
    problem = ("--nodes and --tasks-per-node must be at least 1, --gpus-per-node at least 0")
  elif a.tasks_per_node > 1 and a.gpus_per_node:
    # Each process would see (and JAX would claim) every GPU of the node.
    problem = ("--tasks-per-node > 1 is for CPU nodes (--gpus-per-node 0): on GPU nodes one "
               "process per node holds all the node's GPUs")
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
