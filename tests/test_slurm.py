"""launch/slurm.py against a real SLURM: a one-node cluster on this machine (munged, slurmctld,
slurmd from Debian's packages, 2 CPUs), started and stopped by the `cluster` fixture. Jobs are
submitted through the launcher exactly as a user would (2 tasks x 4 simulated CPU devices, one
node) and compared with the same command through launch/local.py: a job trains to the end with
the same per-step losses; SIGTERM as SLURM sends it at the time limit (batch shell only) or on
preemption (every step and the batch shell) commits a checkpoint, the job requeues itself and
resumes exactly; a task killed outright ends the step within the heartbeat time and the job
requeues itself and resumes from the last committed step; a hang exits with status 6 and the
job requeues itself; a stopped task (SIGSTOP) ends with the step and the job requeues itself
and resumes exactly. Skipped with a reason where SLURM is not installed (.ci/run installs it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import train_helpers
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel")
HEARTBEAT_S = 10  # config.distributed.heartbeat_timeout_s of the jobs below

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(c) is None for c in DAEMONS + CLIENTS) or os.geteuid() != 0,
        reason="needs SLURM and munge (Debian: apt-get install slurmd slurmctld slurm-client "
               "munge, as .ci/run does) and root to run slurmd"),
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclass
class Cluster:
  """A running one-node cluster: `env` points the SLURM clients at it (SLURM_CONF)."""
  root: Path
  env: dict[str, str]

  def scontrol(self, *args: str) -> str:
    result = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout

  def job(self, job_id: int) -> dict[str, str]:
    """`scontrol show job` as key=value pairs (JobState, Restarts, ExitCode, ...)."""
    return dict(re.findall(r"(\w+)=(\S*)", self.scontrol("show", "job", str(job_id))))

  def wait(self, job_id: int, until, timeout: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while not until(info := self.job(job_id)):
      assert time.monotonic() < deadline, (info, self.log_tail())
      time.sleep(0.5)
    return info

  def log_tail(self) -> str:
    return "".join(p.read_text()[-2000:] for p in sorted(self.root.glob("*.log")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  root = tmp_path_factory.mktemp("slurm")
  root.chmod(0o700)
  (root / "state").mkdir()
  (root / "spool").mkdir()
  key = root / "munge.key"
  key.write_bytes(os.urandom(1024))
  key.chmod(0o400)
  socket_path = root / "munge.sock"
  # "localhost" rather than this machine's name, which SLURM shortens at the first dot and
  # which need not resolve: the job's coordinator address is its first node's name.
  host = "localhost"
  ctld_port = _free_port()
  slurmd_port = _free_port()
  # A test cluster's settings: cred_expire (default 120 s) is also how long a requeued job waits
  # before it may start again, and the scheduler looks at pending jobs every 2 s (default 60).
  # Preemption as GPU clusters set it up: a job of the `high` partition preempts jobs of `low`
  # (the default), which get SIGTERM and GraceTime seconds before they are killed and requeued.
  (root / "slurm.conf").write_text(f"""\
ClusterName=bertjax-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path},cred_expire=5
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd.log'}
PlugStackConfig={root / 'plugstack.conf'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
ReturnToService=2
JobRequeue=1
MpiDefault=none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=low Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=high Nodes={host} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=off
""")
  (root / "plugstack.conf").write_text("")
  env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
  subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={socket_path}",
                  f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                  f"--seed-file={root / 'munged.seed'}"], check=True, timeout=30)
  subprocess.run(["slurmctld", "-f", str(root / "slurm.conf"), "-i"], env=env, check=True,
                 timeout=30)
  subprocess.run(["slurmd", "-f", str(root / "slurm.conf"), "-N", host], env=env, check=True,
                 timeout=30)
  cluster = Cluster(root, env)
  try:
    deadline = time.monotonic() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, text=True,
                                       capture_output=True).stdout:
      assert time.monotonic() < deadline, cluster.log_tail()
      time.sleep(0.5)
    yield cluster
  finally:
    subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=env,
                   capture_output=True, timeout=30)
    for name in ("slurmd", "slurmctld", "munged"):
      pid_file = root / f"{name}.pid"
      if pid_file.exists():
        try:
          os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
          pass


def _train(config: str, workdir: Path, steps: int) -> list[str]:
  return [sys.executable, "-m", "bertjax", "train", "--config", config, "--workdir", str(workdir),
          f"--config.num_train_steps={steps}", "--config.mesh.data=2", "--config.mesh.fsdp=2",
          "--config.mesh.tensor=2", "--config.checkpoint.every=2", "--config.checkpoint.keep=0",
          f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}",
          *train_helpers.MULTIPROCESS_TINY]


def _local(config: str, workdir: Path, steps: int) -> None:
  """The same command through launch/local.py (2 processes x 4 devices): the reference."""
  result = subprocess.run([sys.executable, str(ROOT / "launch" / "local.py"), "--processes", "2",
                           "--devices", "4", "--", *_train(config, workdir, steps)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:]


@pytest.fixture(scope="module")
def reference_24(tmp_path_factory) -> Path:
  """24 uninterrupted steps of the tiny GPT through launch/local.py."""
  workdir = tmp_path_factory.mktemp("reference") / "local"
  _local("gpt_tiny", workdir, 24)
  return workdir


def _submit(cluster: Cluster, config: str, workdir: Path, steps: int,
            extra: list[str] = ()) -> tuple[int, Path]:
  """Submits through launch/slurm.py from `workdir`'s parent, as a user would; the job's
  environment is the submitting shell's (4 simulated CPU devices per task)."""
  workdir.parent.mkdir(parents=True, exist_ok=True)
  log = workdir.parent / f"{workdir.name}-%j.out"
  env = {**cluster.env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(4),
         "PYTHONUNBUFFERED": "1"}
  result = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "slurm.py"), "--nodes", "1", "--tasks-per-node", "2",
       "--gpus-per-node", "0", "--job-name", workdir.name, "--output", str(log),
       "--port", str(_free_port()), "--grace", "30", "--", *_train(config, workdir, steps),
       *extra],
      cwd=workdir.parent, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"[launch] wrote {workdir.name}.sbatch" in result.stdout
  job_id = int(re.search(r"Submitted batch job (\d+)", result.stdout).group(1))
  return job_id, workdir.parent / f"{workdir.name}-{job_id}.out"


def _parent(pid: int) -> int | None:
  """`pid`'s parent, from /proc (None once it has ended)."""
  try:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def _trainer(cluster: Cluster, job_id: int, task: int) -> int:
  """The pid of task `task`'s training process in step 0 of the job: the child (from /proc) of
  the task's shell, the one of the task's processes whose parent is not one of them."""
  rows = [line.split() for line in cluster.scontrol("listpids", str(job_id)).splitlines()[1:]]
  pids = {int(r[0]) for r in rows if r[2] == "0" and r[4] == str(task)}
  shell = next(pid for pid in pids if _parent(pid) not in pids)
  return next(int(p.name) for p in Path("/proc").iterdir()
              if p.name.isdigit() and _parent(int(p.name)) == shell)


def _ended(info: dict[str, str]) -> bool:
  return info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def _assert_same_run(reference: Path, workdir: Path) -> None:
  """The same steps logged (none missing, none extra), each loss and the final parameters
  within 1e-6."""
  expected, got = train_helpers.step_losses(reference), train_helpers.step_losses(workdir)
  assert sorted(got) == sorted(expected), (sorted(expected), sorted(got))
  train_helpers.assert_same_training(reference, workdir)


def _wait_for_step(workdir: Path, log: Path, step: int, timeout: float = 300) -> None:
  """Until `step` is logged and a checkpoint is committed."""
  deadline = time.monotonic() + timeout
  while not ((workdir / "metrics.jsonl").exists()
             and max(train_helpers.step_losses(workdir), default=0) >= step
             and train_helpers.committed_steps(workdir)):
    assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
    time.sleep(0.2)


@pytest.mark.parametrize("config", ["gpt_tiny", "bert_tiny"])
def test_a_two_task_job_trains_like_the_local_launcher(cluster, tmp_path, config):
  _local(config, tmp_path / "local", 10)
  job_id, log = _submit(cluster, config, tmp_path / "runs" / "job", 10)
  info = cluster.wait(job_id, _ended)
  output = log.read_text()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-3000:]
  assert f"[slurm] job {job_id} (restart 0): 2 processes on 1 node(s)" in output
  assert "process 1 of 2, 4 local devices of 8" in output
  assert "run finished at step 10 of 10" in output and "[slurm] training exited with 0" in output
  assert (tmp_path / "runs" / "job.sbatch").exists()  # where the launcher said it wrote it
  assert train_helpers.committed_steps(tmp_path / "runs" / "job")[-1] == 10
  _assert_same_run(tmp_path / "local", tmp_path / "runs" / "job")


@pytest.mark.parametrize("how", ["time-limit", "preemption"])
def test_sigterm_commits_requeues_and_resumes_exactly(cluster, reference_24, tmp_path, how):
  """time-limit: the SIGTERM that `--signal=B:TERM@GRACE` sends to the batch shell before the
  time limit (the shell forwards it to the tasks and requeues); preemption: a job of the
  `high` partition needs the node, SLURM sends SIGTERM to the tasks and gives them GraceTime
  (the batch shell sees the preemption after they exit and requeues)."""
  workdir = tmp_path / "runs" / "job"
  job_id, log = _submit(cluster, "gpt_tiny", workdir, 24)
  _wait_for_step(workdir, log, 6)
  if how == "time-limit":
    subprocess.run(["scancel", "--batch", "--signal=TERM", str(job_id)], env=cluster.env,
                   check=True, timeout=30)
  else:
    urgent = subprocess.run(["sbatch", "--partition=high", "--ntasks=2", "--parsable",
                             f"--output={tmp_path / 'urgent.out'}", "--wrap", "echo urgent"],
                            env=cluster.env, capture_output=True, text=True, timeout=30)
    assert urgent.returncode == 0, urgent.stderr
  info = cluster.wait(job_id, lambda i: int(i["Restarts"]) >= 1 and _ended(i))
  output = log.read_text()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-3000:]
  stopped = int(re.search(r"stopped at step (\d+) on preemption notice; checkpoint committed",
                          output).group(1))
  assert 6 <= stopped < 24
  assert ("[slurm] SIGTERM: forwarding to the tasks, then requeueing" if how == "time-limit"
          else "[slurm] preempted: requeueing") in output
  if how == "preemption":
    assert cluster.job(int(urgent.stdout.split(";")[0]))["JobState"] == "COMPLETED"
  assert f"[slurm] job {job_id} (restart 1)" in output
  assert f"resumed from {workdir / 'checkpoints'} step {stopped}" in output
  assert "run finished at step 24 of 24" in output
  _assert_same_run(reference_24, workdir)


def test_a_killed_task_ends_the_step_and_the_job_requeues_itself(cluster, reference_24,
                                                                   tmp_path):
  """SIGKILL of task 1's training process (the OOM killer, a dead host): the step ends within
  the heartbeat time (srun's --kill-on-bad-exit, the survivor stopped by the coordination
  service), the batch script finds the first failure (137: killed by a signal) and requeues
  the job, which resumes from the last committed step."""
  workdir = tmp_path / "runs" / "job"
  job_id, log = _submit(cluster, "gpt_tiny", workdir, 24)
  _wait_for_step(workdir, log, 6)
  os.kill(_trainer(cluster, job_id, 1), signal.SIGKILL)
  killed_at = time.monotonic()
  last_commit = train_helpers.committed_steps(workdir)[-1]
  while "[slurm] training exited with" not in (output := log.read_text()):
    assert time.monotonic() - killed_at < HEARTBEAT_S + 60, (output[-3000:], cluster.log_tail())
    time.sleep(0.2)
  failed_after = time.monotonic() - killed_at
  print(f"job {job_id}: the step ended {failed_after:.1f} s after the kill")
  assert failed_after <= HEARTBEAT_S + 5, failed_after
  # The step that was being saved at the kill may or may not have committed.
  resume_from = train_helpers.committed_steps(workdir)[-1]
  assert resume_from >= last_commit
  info = cluster.wait(job_id, lambda i: int(i["Restarts"]) >= 1 and _ended(i))
  output = log.read_text()
  assert info["JobState"] == "COMPLETED", output[-3000:]
  assert "[slurm] first failure: task 1 exited with status 137" in output
  assert "[slurm] exit status 137: requeueing (restart 1 of 3)" in output
  assert f"resumed from {workdir / 'checkpoints'} step {resume_from}" in output
  assert "run finished at step 24 of 24" in output
  _assert_same_run(reference_24, workdir)


def test_a_hang_exits_6_and_the_job_requeues_itself(cluster, tmp_path):
  """Task 1 never sends step 15 (the fault lab; the watchdog's floor 5 s): both tasks write
  their stacks and exit with status 6, the batch script requeues the job, and the requeued job
  (a new attempt: the fault does not fire again) resumes from the last checkpoint and ends."""
  workdir = tmp_path / "runs" / "job"
  job_id, log = _submit(cluster, "gpt_tiny", workdir, 24, [
      "--config.faults.hang=collective:15", "--config.faults.process=1",
      "--config.resilience.hang_floor_s=5"])
  info = cluster.wait(job_id, lambda i: int(i["Restarts"]) >= 1 and _ended(i))
  output = log.read_text()
  assert info["JobState"] == "COMPLETED", output[-3000:]
  assert "[slurm] exit status 6: requeueing (restart 1 of 3)" in output
  assert output.count("hang: ") >= 2 and "in before_step" in output
  assert f"[slurm] job {job_id} (restart 1)" in output
  assert re.search(rf"resumed from {re.escape(str(workdir / 'checkpoints'))} step 1[0-4]\b",
                   output), output[-3000:]
  assert "run finished at step 24 of 24" in output


# What finds a stopped task first: the watchdog of the other (floor 5 s; the heartbeat timeout
# raised to 60 s so that it is not first), or the coordination service, which stops the other
# when the stopped task's heartbeats are HEARTBEAT_S late (the watchdog at its 60 s default).
STOP_FINDERS = {
    "watchdog": (["--config.resilience.hang_floor_s=5", "--config.distributed.step_timeout_s=20",
                  "--config.distributed.heartbeat_timeout_s=60"], "task 0 exited with status 6"),
    "heartbeat": ([], "task 0 exited with status 134"),  # SIGABRT by the coordination client
}


@pytest.mark.parametrize("finder", STOP_FINDERS)
def test_a_stopped_task_is_killed_and_the_job_requeues_itself(cluster, reference_24, tmp_path,
                                                             finder):
  """Task 1's training process is stopped (SIGSTOP) after step 6, as a frozen host would be.
  Task 0 ends: its watchdog exits 6, or the coordination service aborts it when task 1's
  heartbeats stop (SIGABRT, 134); `srun --kill-on-bad-exit` ends the step (SIGCONT and SIGTERM
  to every process of it, SIGKILL after KillWait); the batch script finds the first failure
  and requeues the job. The requeued job starts within max(3 x the watchdog's limit, 60 s) of
  the stop, without a person, resumes from the last committed step and ends with every step's
  loss and the final parameters equal to an uninterrupted run's."""
  extra, first_failure = STOP_FINDERS[finder]
  workdir = tmp_path / "runs" / "job"
  job_id, log = _submit(cluster, "gpt_tiny", workdir, 24, extra)
  _wait_for_step(workdir, log, 6)
  stopped = _trainer(cluster, job_id, 1)
  os.kill(stopped, signal.SIGSTOP)
  stopped_at = time.monotonic()
  restart_line = f"[slurm] job {job_id} (restart 1)"
  while restart_line not in (output := log.read_text()):
    assert time.monotonic() - stopped_at < 300, (output[-3000:], cluster.log_tail())
    time.sleep(0.5)
  restarted_after = time.monotonic() - stopped_at
  # The limit the watchdog found the hang with; where the heartbeat came first, the 60 s floor
  # of the bound (the watchdog's own limit was above it).
  found = re.search(r"bertjax: process 0 of 2: hang: .*?\(limit (\d+) s", output)
  bound = max(3 * int(found.group(1)) if found else 0, 60)
  print(f"job {job_id} ({finder}): the requeued job started {restarted_after:.1f} s after the "
        f"stop (bound {bound} s)")
  assert restarted_after <= bound, output[-3000:]
  assert bool(found) == (finder == "watchdog"), output[-3000:]
  status = first_failure.rsplit(" ", 1)[1]
  assert f"[slurm] first failure: {first_failure}" in output, output[-3000:]
  assert f"[slurm] exit status {status}: requeueing (restart 1 of 3)" in output
  assert not Path(f"/proc/{stopped}").exists()  # ended with the step
  info = cluster.wait(job_id, lambda i: int(i["Restarts"]) >= 1 and _ended(i))
  output = log.read_text()
  assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", output[-3000:]
  assert re.search(rf"resumed from {re.escape(str(workdir / 'checkpoints'))} step \d+\b",
                   output), output[-3000:]
  assert "run finished at step 24 of 24" in output
  _assert_same_run(reference_24, workdir)
