#!/usr/bin/env python3
"""Train on a Cloud TPU VM pod slice: create it (a queued resource, optionally Spot), mount a
GCS bucket and install bertjax on every worker, run the same `bertjax train` on all workers
(`--worker=all`) with the output streamed and appended to a log file, and re-create the slice
and re-run after a preemption, so the run resumes from its latest checkpoint. With
--num-slices N, one queued resource of N such slices joined over the data-center network (DCN,
multislice): every step goes to each slice's node, and the run starts on all slices at once.

actions (default: up):
  up       create + wait + mount + install + run, then supervise: when the run fails or the
           slice is preempted/suspended, delete and re-create the slice and run again (same
           workdir: resumes), at most --max-restarts times; exit 0 when the run exits 0
  create   create the queued resource and wait until it is ACTIVE
  install  mount the bucket and install bertjax (+ configs/) on every worker
  run      run the training command on every worker once (output to the console and the log;
           with several slices, one ssh per slice at once, lines prefixed [slice i])
  status   print the queued resource's state
  delete   delete the queued resource and its slice

The training command follows `--`; its --workdir must be on the bucket, as gs://BUCKET/RUN or
under the bucket's mount point
(/gcs/BUCKET) so every worker and every re-created slice sees the same checkpoints.
Stdlib only: runs on a laptop with gcloud installed, no bertjax or jax needed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import (REPO, RUNTIMES, TpuSlice, UsageError, data_note, flag_value, parse_tpu_type,
                    rel, show, split_command)

EXAMPLE = """example (BERT-base on a v4-16: 8 chips on 2 hosts, Spot):
  python launch/tpu_vm.py up --name bert-base --zone us-central2-b --project my-project \\
      --tpu-type v4-16 --spot --bucket my-bucket --dry-run -- \\
      bertjax train --config configs/bert_base.py --workdir /gcs/my-bucket/bert-base \\
      --config.data.dataset=/gcs/my-bucket/data/wiki

  the dataset is built once beforehand, on any machine (docs/launching.md):
  bertjax data build --source wikipedia:enwiki-latest-pages-articles-multistream.xml.bz2 \\
      --tokenizer vocab.txt --out gs://my-bucket/data/wiki --eval-fraction 0.01

  the same on 2 v5litepod-16 slices over DCN (32 chips on 8 hosts, data parallel across the
  slices, config.dcn_mesh): --tpu-type v5litepod-16 --num-slices 2 instead of --tpu-type v4-16

  --dry-run prints the exact commands of one cycle (create, wait, mount, install, run) instead
  of running them; drop it to launch. Exit codes: 0 the run finished, 2 a bad request (unknown
  TPU type, hosts not matching it, workdir outside the bucket), else the run's last failure.
"""

# States of a queued resource that mean its slice is gone (re-create it).
DEAD_STATES = {"FAILED", "SUSPENDING", "SUSPENDED", "PREEMPTED", "DELETING"}
COORDINATOR_PORT = 8482  # the port JAX uses for its TPU coordinator
VENV = "bertjax-venv"    # on each worker, in the home directory


# ---------------------------------------------------------------------------- commands


class Commands:
  """Every external command of a launch, as argv lists."""

  def __init__(self, args: argparse.Namespace, tpu: TpuSlice, train: list[str]):
    self.a, self.tpu, self.train = args, tpu, train
    self.loc = [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])
    self.mount = f"/gcs/{args.bucket}" if args.bucket else None
    self.slices = args.num_slices
    # One slice is node NAME; N slices (--node-prefix) are nodes NAME-0 ... NAME-(N-1).
    self.nodes = ([args.name] if self.slices == 1 else
                  [f"{args.name}-{i}" for i in range(self.slices)])

  def create(self) -> list[str]:
    a = self.a
    # N slices are one request, --node-count with --node-prefix instead of --node-id (the two
    # exclude each other); describe and delete still act on the queued resource NAME.
    nodes = ([f"--node-id={a.name}"] if self.slices == 1 else
             [f"--node-count={self.slices}", f"--node-prefix={a.name}"])
    cmd = ["gcloud", "compute", "tpus", "queued-resources", "create", a.name,
           *nodes, *self.loc, f"--accelerator-type={self.tpu.accelerator_type}",
           f"--runtime-version={a.runtime_version or self.tpu.runtime_version}"]
    if a.spot:
      cmd.append("--spot")
    if a.reserved:
      cmd.append("--reserved")
    if a.service_account:
      cmd.append(f"--service-account={a.service_account}")
    if a.scopes:
      cmd.append(f"--scopes={a.scopes}")
    return cmd

  def describe(self) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "describe", self.a.name,
            *self.loc, "--format=value(state.state)"]

  def delete(self) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", self.a.name,
            *self.loc, "--force", "--quiet"]

  def ssh(self, remote: str, node: str | None = None) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node or self.a.name, *self.loc,
            "--worker=all", f"--command={remote}"]

  def scp(self, local: str, recurse: bool = False, node: str | None = None) -> list[str]:
    return (["gcloud", "compute", "tpus", "tpu-vm", "scp"] + (["--recurse"] if recurse else [])
            + [local, f"{node or self.a.name}:~/", *self.loc, "--worker=all"])

  def mount_remote(self) -> str:
    """Install gcsfuse if missing, mount the bucket at /gcs/BUCKET (idempotent)."""
    b, m = self.a.bucket, self.mount
    return ("set -e; if ! command -v gcsfuse >/dev/null; then "
            "echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] "
            "https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -c -s) main\" "
            "| sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null; "
            "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg "
            "| sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null; "
            "sudo apt-get update -qq; sudo apt-get install -y -qq gcsfuse; fi; "
            f"sudo mkdir -p {m}; sudo chown \"$USER\" {m}; "
            f"mountpoint -q {m} || gcsfuse --implicit-dirs {b} {m}")

  def wheel_name(self) -> str:
    import tomllib
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return f"bertjax-{version}-py3-none-any.whl"

  def build(self) -> list[str]:
    """Build a wheel of the local checkout into dist/ (skipped with --package)."""
    return ["python3", "-m", "pip", "wheel", "--no-deps", "-w", rel(REPO / "dist"), rel(REPO)]

  def requirement(self) -> str:
    if self.a.package:
      return self.a.package
    return f"./{self.wheel_name()}[tpu]"

  def install_remote(self) -> str:
    py = self.a.python
    return ("set -e; if ! command -v {py} >/dev/null; then sudo apt-get update -qq; "
            "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {py} {py}-venv; fi; "
            "[ -x {venv}/bin/pip ] || {py} -m venv {venv}; "
            "{venv}/bin/pip install -q --upgrade pip; "
            "{venv}/bin/pip install -q \"{req}\"; "
            "{venv}/bin/pip install -q --force-reinstall --no-deps \"{req}\""
            ).format(py=py, venv=VENV, req=self.requirement())

  def run_remote(self) -> str:
    """The training command on each worker, with the multi-host variables bertjax reads: on a
    TPU VM JAX finds its peers through the metadata server, which bertjax.parallel.distributed
    does not look at, so the worker number and worker 0's address come from there explicitly."""
    meta = ("curl -sf -H Metadata-Flavor:Google "
            "http://metadata.google.internal/computeMetadata/v1/instance/attributes/")
    if self.slices > 1:
      return self.run_remote_multislice(meta)
    if self.tpu.hosts == 1:
      return f"cd ~ && . {VENV}/bin/activate && exec {show(self.train)}"
    return (f"cd ~ && . {VENV}/bin/activate && "
            f"export BERTJAX_PROCESS_ID=$({meta}agent-worker-number) "
            f"BERTJAX_NUM_PROCESSES={self.tpu.hosts} "
            f"BERTJAX_COORDINATOR_ADDRESS=$({meta}worker-network-endpoints "
            f"| cut -d, -f1 | rev | cut -d: -f1 | rev):{COORDINATOR_PORT} && "
            f"exec {show(self.train)}")

  def run_remote_multislice(self, meta: str) -> str:
    """The same for N slices. The queued resource writes MEGASCALE_* values into the metadata
    attribute tpu-env (lines like `MEGASCALE_SLICE_ID: '1'`, parsed as MaxText's startup script
    does), where libtpu and JAX read them. JAX numbers processes slice-major, process id =
    slice id * hosts per slice + worker number, with its coordinator on the host named by
    MEGASCALE_COORDINATOR_ADDRESS (slice 0, worker 0): computing the ids the same way on each
    VM keeps them in line with the runtime's slice ids, whichever node NAME-i got which id.
    That value's format (IP or hostname, with a port or not) is undocumented: a port is cut.
    The quotes around a value are deleted with tr (\\047 = ') to keep ' out of the command."""
    hosts, slices = self.tpu.hosts, self.slices
    value = 'echo "$TPU_ENV" | grep ^MEGASCALE_{}: | cut -d: -f2- | tr -d "\\047\\" "'
    return (f"cd ~ && . {VENV}/bin/activate || exit 1; "
            f"TPU_ENV=$({meta}tpu-env); WORKER=$({meta}agent-worker-number); "
            f"SLICE_ID=$({value.format('SLICE_ID')}); "
            f"COORDINATOR=$({value.format('COORDINATOR_ADDRESS')}); "
            'if [ -z "$SLICE_ID" ] || [ -z "$COORDINATOR" ] || [ -z "$WORKER" ]; then '
            'echo "no MEGASCALE_SLICE_ID/MEGASCALE_COORDINATOR_ADDRESS in the tpu-env metadata '
            'or no agent-worker-number: not a multislice TPU VM" >&2; exit 1; fi; '
            f"export BERTJAX_PROCESS_ID=$((SLICE_ID * {hosts} + WORKER)) "
            f"BERTJAX_NUM_PROCESSES={slices * hosts} "
            f"BERTJAX_COORDINATOR_ADDRESS=${{COORDINATOR%:*}}:{COORDINATOR_PORT} && "
            f"exec {show(self.train)}")


# ---------------------------------------------------------------------------- execution


class Runner:
  def __init__(self, dry_run: bool, log_file: str | None):
    self.dry_run, self.log_file = dry_run, log_file

  def note(self, text: str) -> None:
    line = f"# {text}" if self.dry_run else f"[launch] {text}"
    print(line, flush=True)
    if not self.dry_run and self.log_file:
      with open(self.log_file, "a") as f:
        f.write(line + "\n")

  def __call__(self, argv: list[str], *, stream_to_log: bool = False,
               capture: bool = False, check: bool = True) -> subprocess.CompletedProcess:
    if self.dry_run:
      print(show(argv), flush=True)
      return subprocess.CompletedProcess(argv, 0, "ACTIVE" if capture else "")
    if capture:
      return subprocess.run(argv, capture_output=True, text=True, check=False)
    if not stream_to_log:
      proc = subprocess.run(argv, check=False)
    else:
      with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1) as p, open(self.log_file, "a") as log:
        for line in p.stdout:
          sys.stdout.write(line)
          sys.stdout.flush()
          log.write(line)
          log.flush()
        p.wait()
        proc = subprocess.CompletedProcess(argv, p.returncode)
    if check and proc.returncode != 0:
      raise subprocess.CalledProcessError(proc.returncode, argv)
    return proc

  def concurrent(self, argvs: list[list[str]], grace: float) -> int:
    """Runs the commands at once, every output line prefixed with `[slice i]` on the console
    and in the log file. 0 if all exit 0, else the first failure's code; after a failure the
    others get `grace` seconds to exit by themselves, then they are terminated. A dry run
    prints them as a shell script: each command with `&`, then `wait`."""
    if self.dry_run:
      for argv in argvs:
        print(show(argv) + " &", flush=True)
      print("wait", flush=True)
      return 0
    lock = threading.Lock()
    with open(self.log_file, "a") as log:

      def pump(i: int, stream) -> None:
        for line in stream:
          with lock:
            sys.stdout.write(f"[slice {i}] {line}")
            sys.stdout.flush()
            log.write(f"[slice {i}] {line}")
            log.flush()

      # Each in its own process group, so that ending one also ends the ssh gcloud started.
      procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True) for argv in argvs]
      threads = [threading.Thread(target=pump, args=(i, p.stdout), daemon=True)
                 for i, p in enumerate(procs)]
      for t in threads:
        t.start()
      first, failed_at, stopped = 0, None, False
      try:
        while True:
          codes = [p.poll() for p in procs]
          for i, code in enumerate(codes):
            if code not in (None, 0) and failed_at is None:
              first, failed_at = code, time.monotonic()
              if None in codes:
                with lock:
                  self.note(f"slice {i}'s run exited with {code}; the other slices have "
                            f"{grace:.0f} s to exit")
          if None not in codes:
            break
          if failed_at is not None and not stopped and time.monotonic() - failed_at > grace:
            with lock:
              self.note("terminating the runs still going")
            stop(procs)
            stopped = True
          time.sleep(0.2)
      finally:
        stop(procs)
        for t in threads:
          t.join(timeout=5)
    return first


def stop(procs: list[subprocess.Popen]) -> None:
  """SIGTERM to the process group of each process still running."""
  for p in procs:
    if p.poll() is not None:
      continue
    try:
      if hasattr(os, "killpg"):
        os.killpg(p.pid, signal.SIGTERM)
      else:
        p.terminate()
    except ProcessLookupError:
      pass


def state(c: Commands, run: Runner) -> str:
  out = run(c.describe(), capture=True)
  return out.stdout.strip() if out.returncode == 0 else "NOT_FOUND"


def create_and_wait(c: Commands, run: Runner, poll: float) -> None:
  what = ("the slice (queued resource" if c.slices == 1 else
          f"the {c.slices} slices, nodes {c.nodes[0]} to {c.nodes[-1]} (one queued resource")
  run.note(f"create {what}; the request waits in the queue for capacity)")
  run(c.create())
  run.note(f"wait until the queued resource is ACTIVE (polled every {poll:.0f} s)")
  if run.dry_run:
    run(c.describe(), capture=True)
    return
  while True:
    s = state(c, run)
    run.note(f"queued resource {c.a.name}: {s}")
    if s == "ACTIVE":
      return
    if s in DEAD_STATES or s == "NOT_FOUND":
      raise RuntimeError(f"queued resource {c.a.name} is {s}")
    time.sleep(poll)


def install(c: Commands, run: Runner) -> None:
  every = "every worker" + (f" of the {c.slices} slices" if c.slices > 1 else "")
  run.note(f"mount gs://{c.a.bucket} at {c.mount} on {every} (gcsfuse)")
  for node in c.nodes:
    run(c.ssh(c.mount_remote(), node))
  run.note(f"install bertjax on {every}" + ("" if c.a.package else
           " from a wheel of this checkout"))
  if not c.a.package:
    run(c.build())
  for node in c.nodes:
    if not c.a.package:
      run(c.scp(rel(REPO / "dist" / c.wheel_name()), node=node))
    run(c.scp(rel(Path(c.a.configs)), recurse=True, node=node))
    run(c.ssh(c.install_remote(), node))


def train(c: Commands, run: Runner) -> int:
  if c.slices > 1:
    # All slices at once: the processes of every slice meet in jax.distributed.initialize.
    run.note(f"run the training on all {c.tpu.hosts * c.slices} workers of the {c.slices} "
             f"slices at once, one ssh per slice (output prefixed [slice i] for node "
             f"{c.a.name}-i, streamed here and appended to {run.log_file})")
    return run.concurrent([c.ssh(c.run_remote(), node) for node in c.nodes], c.a.grace)
  run.note(f"run the training on all {c.tpu.hosts} worker{'s' if c.tpu.hosts > 1 else ''} "
           f"(output streamed here and appended to {run.log_file})")
  return run(c.ssh(c.run_remote()), stream_to_log=True, check=False).returncode


def up(c: Commands, run: Runner) -> int:
  a = c.a
  if run.dry_run:
    create_and_wait(c, run, a.poll)
    install(c, run)
    train(c, run)
    run.note("supervision: when the run fails or the queued resource is PREEMPTED/SUSPENDED/"
             "FAILED, the loop deletes the " + ("slice," if c.slices == 1 else
                                                 f"queued resource (all {c.slices} slices),"))
    run(c.delete())
    run.note(f"and repeats create, wait, mount, install and run (same --workdir: the run resumes "
             f"from its latest checkpoint), at most --max-restarts={a.max_restarts} times")
    return 0
  restarts, rc = 0, 1
  while True:
    try:
      s = state(c, run)
      if s != "ACTIVE":
        if s != "NOT_FOUND":
          run.note(f"queued resource {a.name} is {s}; deleting it")
          run(c.delete(), check=False)
        create_and_wait(c, run, a.poll)
      install(c, run)
      rc = train(c, run)
      if rc == 0:
        run.note("training finished on all workers")
        if a.delete_when_done:
          run(c.delete(), check=False)
        else:
          run.note(f"the slice is left up; delete it: {show(c.delete())}")
        return 0
      run.note(f"the run exited with {rc}; queued resource state: {state(c, run)}")
    except (RuntimeError, subprocess.CalledProcessError) as e:
      run.note(f"failed: {e}")
    if restarts >= a.max_restarts:
      run.note(f"giving up after {restarts} restarts; the slice is left as it is "
               f"(delete it: {show(c.delete())})")
      return rc or 1
    restarts += 1
    run.note(f"restart {restarts}/{a.max_restarts}: deleting and re-creating the slice")
    run(c.delete(), check=False)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  own, command = split_command(argv)
  p = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("action", nargs="?", default="up",
                 choices=["up", "create", "install", "run", "status", "delete"])
  p.add_argument("--name", required=True, help="queued resource and TPU node name")
  p.add_argument("--zone", required=True, help="e.g. us-central2-b (v4), us-east5-a (v5p)")
  p.add_argument("--project", help="GCP project (default: gcloud's configured project)")
  p.add_argument("--tpu-type", required=True,
                 help="accelerator type: v4-16, v4-32, v5p-32, v5litepod-16, v6e-16, ...")
  p.add_argument("--hosts", type=int,
                 help="expected number of hosts per slice (checked against the type)")
  p.add_argument("--num-slices", type=int, default=1,
                 help="slices of --tpu-type in one queued resource, joined over the data-center "
                 "network (multislice; nodes NAME-0 ... NAME-(N-1)); default 1")
  p.add_argument("--runtime-version", help="TPU software version (default per generation: "
                 + ", ".join(f"{k} {v}" for k, v in RUNTIMES.items()) + ")")
  tier = p.add_mutually_exclusive_group()
  tier.add_argument("--spot", action="store_true", help="Spot capacity (preemptible, cheaper)")
  tier.add_argument("--reserved", action="store_true", help="use the project's reservation")
  p.add_argument("--service-account", help="service account of the TPU VMs")
  p.add_argument("--scopes", default="https://www.googleapis.com/auth/cloud-platform",
                 help="access scopes of the TPU VMs (default: cloud-platform, IAM decides)")
  p.add_argument("--bucket", help="GCS bucket mounted at /gcs/BUCKET on every worker")
  p.add_argument("--package", help="pip requirement to install instead of a wheel of this "
                 "checkout, e.g. 'bertjax[tpu] @ git+https://github.com/OWNER/bertjax'")
  p.add_argument("--configs", default=rel(REPO / "configs"),
                 help="config directory copied to each worker's home (default: configs/)")
  p.add_argument("--python", default="python3.11", help="Python on the workers (>= 3.11)")
  p.add_argument("--max-restarts", type=int, default=10,
                 help="re-creations after preemption or failure (default 10)")
  p.add_argument("--delete-when-done", action="store_true",
                 help="up: delete the slice once the run has finished (default: leave it up)")
  p.add_argument("--poll", type=float, default=60.0, help="seconds between state polls")
  p.add_argument("--grace", type=float, default=300.0,
                 help="several slices: seconds the other slices' runs get to exit after one "
                 "fails, before their ssh is ended (default 300)")
  p.add_argument("--log-file", help="local log file the run's output is appended to "
                 "(default: NAME.log)")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  a = p.parse_args(own)
  try:
    if a.num_slices < 1:
      raise UsageError(f"--num-slices must be 1 or more, got {a.num_slices}")
    tpu = parse_tpu_type(a.tpu_type, a.hosts)
    if a.action in ("up", "run"):
      if not command:
        raise UsageError("no training command: put it after --, e.g. -- bertjax train "
                         "--config configs/bert_base.py --workdir /gcs/BUCKET/RUN")
      if not a.bucket:
        raise UsageError("--bucket is required: the workdir must be on the bucket, mounted on "
                         "every worker, so all hosts and every restart see the checkpoints")
      workdir = flag_value(command, "--workdir")
      mount = f"/gcs/{a.bucket}"
      # Either through the bucket's gcsfuse mount or as gs:// (bertjax writes there natively).
      inside = [f"{mount}/", f"gs://{a.bucket}/"]
      if workdir is None or not any(workdir.startswith(p) and len(workdir) > len(p)
                                    for p in inside):
        raise UsageError(f"the training --workdir must be a directory under {mount} (the "
                         f"bucket's gcsfuse mount on every worker) or gs://{a.bucket}/, got "
                         f"{workdir!r}")
    if a.action == "install" and not a.bucket:
      raise UsageError("--bucket is required (install also mounts it)")
  except UsageError as e:
    p.print_usage(sys.stderr)
    print(f"{p.prog}: error: {e}", file=sys.stderr)
    return 2
  log_file = (a.log_file or f"{a.name}.log") if a.action in ("up", "run") else None
  run = Runner(a.dry_run, log_file)
  c = Commands(a, tpu, command)
  run.note(f"{a.name}: {tpu.describe(a.num_slices)}, zone {a.zone}, runtime "
           f"{a.runtime_version or tpu.runtime_version}" + (", Spot" if a.spot else ""))
  if a.action in ("up", "run") and (note := data_note(command)):
    run.note(note)
  try:
    if a.action == "up":
      return up(c, run)
    if a.action == "create":
      create_and_wait(c, run, a.poll)
    elif a.action == "install":
      install(c, run)
    elif a.action == "run":
      return train(c, run)
    elif a.action == "status":
      out = run(c.describe(), capture=True)
      if not a.dry_run:
        print(out.stdout.strip() or out.stderr.strip())
    elif a.action == "delete":
      run(c.delete())
  except (RuntimeError, subprocess.CalledProcessError) as e:
    print(f"[launch] failed: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f"\n[launch] interrupted; the slice{'s are' if c.slices > 1 else ' is'} left running "
          f"(delete {'them' if c.slices > 1 else 'it'}: {show(c.delete())})", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
