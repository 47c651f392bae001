"""The cloud launchers (launch/tpu_vm.py, gke.py, slurm.py), through their --dry-run output for a
pod of 4 hosts and for 2 slices of 4 hosts (multislice), their refusals of mismatched requests,
the TPU VM supervision loop against a fake `gcloud` on PATH, the SLURM script's requeue
decision against a fake `srun` and `scontrol`, and the multislice run command against a fake
metadata server (`curl`). No network, no cloud: the scripts are run as a user
runs them."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUCKET = "my-bucket"
TRAIN = ["bertjax", "train", "--config", "configs/bert_base.py",
         "--workdir", f"/gcs/{BUCKET}/bert-base", "--config.batch_size=512"]


def launch(script: str, *args: str, env: dict | None = None, cwd: Path = REPO):
  return subprocess.run([sys.executable, str(REPO / "launch" / script), *args],
                        capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def commands(stdout: str) -> list[list[str]]:
  """The command lines of a dry run (not comments, not the heredoc), as argv lists."""
  out, in_heredoc = [], False
  for line in stdout.splitlines():
    if line.startswith("cat > ") and line.endswith("<<'EOF'"):
      in_heredoc = True
      continue
    if in_heredoc:
      in_heredoc = line != "EOF"
      continue
    if line and not line.startswith("#"):
      out.append(shlex.split(line))
  return out


def heredoc(stdout: str) -> str:
  lines = stdout.splitlines()
  start = next(i for i, l in enumerate(lines) if l.endswith("<<'EOF'"))
  end = lines.index("EOF", start)
  return "\n".join(lines[start + 1:end]) + "\n"


# ---------------------------------------------------------------------------- TPU VM


TPU_ARGS = ["up", "--name", "bert-pod", "--zone", "us-central2-b", "--project", "my-project",
            "--tpu-type", "v4-32", "--hosts", "4", "--spot", "--bucket", BUCKET,
            "--package", "bertjax[tpu] @ git+https://example.com/bertjax", "--dry-run", "--"]


def test_tpu_vm_dry_run_of_a_4_host_pod():
  r = launch("tpu_vm.py", *TPU_ARGS, *TRAIN)
  assert r.returncode == 0, r.stderr
  cmds = commands(r.stdout)
  create = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "queued-resources",
                                          "create"]]
  assert len(create) == 1
  c = create[0]
  assert c[5] == "bert-pod"
  for flag in ("--node-id=bert-pod", "--zone=us-central2-b", "--project=my-project",
               "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"):
    assert flag in c, (flag, c)
  ssh = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
  assert len(ssh) == 3  # mount, install, run
  for c in ssh:
    assert "--worker=all" in c and c[5] == "bert-pod"
  mount, install, run = (next(a for a in c if a.startswith("--command="))[10:] for c in ssh)
  assert f"gcsfuse --implicit-dirs {BUCKET} /gcs/{BUCKET}" in mount
  assert 'pip install -q "bertjax[tpu] @ git+https://example.com/bertjax"' in install
  # The train command verbatim, after the multi-host variables (4 processes, port 8482).
  assert run.endswith("exec " + shlex.join(TRAIN))
  assert "BERTJAX_NUM_PROCESSES=4 " in run
  assert "agent-worker-number" in run and ":8482" in run
  # configs/ is copied to every worker, where the relative --config path resolves.
  scp = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]]
  assert any("configs" in c and "--worker=all" in c and "--recurse" in c for c in scp)
  # The order of one cycle, then the delete the supervision loop would run on preemption.
  kinds = [c[4] if c[3] == "queued-resources" else c[3] + " " + c[4] for c in cmds
           if c[0] == "gcloud"]
  assert kinds[:2] == ["create", "describe"]
  assert kinds[-2:] == ["tpu-vm ssh", "delete"]
  assert "--force" in cmds[-1]
  assert "--max-restarts=10" in r.stdout and "resumes" in r.stdout


def test_tpu_vm_passes_a_config_variant_verbatim():
  """`configs/gpt3.py:size=13b` (a variant, bertjax.config) reaches every worker unchanged:
  its ':', '=' and ',' need no quoting and the launcher does not look inside --config."""
  train = ["bertjax", "train", "--config", "configs/gpt3.py:size=13b,runlocal", "--workdir",
           f"/gcs/{BUCKET}/gpt3", f"--config.data.dataset=/gcs/{BUCKET}/web_text"]
  r = launch("tpu_vm.py", *TPU_ARGS, *train)
  assert r.returncode == 0, r.stderr
  run = [next(a for a in c if a.startswith("--command="))[10:] for c in commands(r.stdout)
         if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]][-1]
  assert run.endswith("exec " + shlex.join(train))
  assert "--config configs/gpt3.py:size=13b,runlocal " in run


def test_tpu_vm_builds_and_copies_a_wheel_without_package():
  args = [a for a in TPU_ARGS if a not in ("--package", "bertjax[tpu] @ git+https://example.com/"
                                           "bertjax")]
  r = launch("tpu_vm.py", *args, *TRAIN)
  assert r.returncode == 0, r.stderr
  cmds = commands(r.stdout)
  assert ["python3", "-m", "pip", "wheel", "--no-deps", "-w", "dist", "."] in cmds
  wheel = next(c for c in cmds if c[4] == "scp" and c[5].endswith(".whl"))
  assert wheel[5].startswith("dist/bertjax-") and "--worker=all" in wheel
  install = next(a for c in cmds for a in c if a.startswith("--command=") and "pip" in a)
  assert f'./{Path(wheel[5]).name}[tpu]' in install


@pytest.mark.parametrize("tpu_type, hosts, runtime", [
    ("v4-16", 2, "tpu-ubuntu2204-base"), ("v5p-32", 4, "v2-alpha-tpuv5"),
    ("v5litepod-16", 4, "v2-alpha-tpuv5-lite"), ("v6e-16", 4, "v2-alpha-tpuv6e")])
def test_tpu_vm_types_hosts_and_runtimes(tpu_type, hosts, runtime):
  args = ["up", "--name", "n", "--zone", "z", "--tpu-type", tpu_type, "--hosts", str(hosts),
          "--bucket", BUCKET, "--package", "bertjax[tpu]", "--dry-run", "--", *TRAIN]
  r = launch("tpu_vm.py", *args)
  assert r.returncode == 0, r.stderr
  assert f"--runtime-version={runtime}" in r.stdout
  assert f"BERTJAX_NUM_PROCESSES={hosts} " in r.stdout
  assert "--spot" not in r.stdout


@pytest.mark.parametrize("change, message", [
    ({"--tpu-type": "v4-33"}, "unknown TPU type 'v4-33'"),
    ({"--tpu-type": "v7-16"}, "unknown TPU type 'v7-16'"),
    ({"--hosts": "2"}, "--hosts 2 does not match --tpu-type v4-32"),
])
def test_tpu_vm_refuses_mismatched_requests(change, message):
  args = list(TPU_ARGS)
  for flag, value in change.items():
    args[args.index(flag) + 1] = value
  r = launch("tpu_vm.py", *args, *TRAIN)
  assert r.returncode == 2
  assert message in r.stderr
  assert "gcloud" not in r.stdout


def test_tpu_vm_refuses_a_workdir_outside_the_bucket():
  train = [a if not a.startswith("/gcs/") else "runs/bert-base" for a in TRAIN]
  r = launch("tpu_vm.py", *TPU_ARGS, *train)
  assert r.returncode == 2
  assert f"--workdir must be a directory under /gcs/{BUCKET}" in r.stderr
  r = launch("tpu_vm.py", *TPU_ARGS)  # no training command at all
  assert r.returncode == 2 and "no training command" in r.stderr
  # The bucket itself, as gs://, is fine (bertjax writes there natively); another bucket is not.
  for workdir, code in ((f"gs://{BUCKET}/bert-base", 0), ("gs://other-bucket/bert-base", 2)):
    train = [a if not a.startswith("/gcs/") else workdir for a in TRAIN]
    r = launch("tpu_vm.py", *TPU_ARGS, *train)
    assert r.returncode == code, r.stderr


# Two v5litepod-16 slices (4 hosts of 4 chips each) in one queued resource.
MULTI_ARGS = [a if a != "v4-32" else "v5litepod-16" for a in TPU_ARGS[:-1]] + [
    "--num-slices", "2", "--"]


def remote_command(argv: list[str]) -> str:
  return next(a for a in argv if a.startswith("--command="))[len("--command="):]


def test_tpu_vm_dry_run_of_2_slices():
  r = launch("tpu_vm.py", *MULTI_ARGS, *TRAIN)
  assert r.returncode == 0, r.stderr
  assert ("# bert-pod: 2 x v5litepod-16 = 32 chips on 8 hosts (2 slices over DCN)"
          in r.stdout)
  # The printout is a shell script: the concurrent runs end with ` &`, then `wait`.
  assert subprocess.run(["bash", "-n"], input=r.stdout, text=True, check=False).returncode == 0
  cmds = commands(r.stdout)
  (create,) = [c for c in cmds if c[3:5] == ["queued-resources", "create"]]
  assert create[5] == "bert-pod" and "--node-count=2 --node-prefix=bert-pod" in shlex.join(create)
  assert not any(a.startswith("--node-id") for a in create), create
  # The queued resource, not a node, is what describe and delete act on.
  assert all(c[5] == "bert-pod" for c in cmds if c[3:4] == ["queued-resources"])
  ssh = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]]
  assert all("--worker=all" in c for c in ssh)
  mounts = [c[5] for c in ssh if "gcsfuse --implicit-dirs" in remote_command(c)]
  installs = [c[5] for c in ssh if "pip install" in remote_command(c)]
  assert mounts == installs == ["bert-pod-0", "bert-pod-1"]
  scp = [c for c in cmds if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]]
  assert sorted(c[-4] for c in scp) == ["bert-pod-0:~/", "bert-pod-1:~/"]
  # One run per slice, in the background, then `wait`; the same command on both.
  runs = [c for c in ssh if "exec bertjax" in remote_command(c)]
  assert [c[5] for c in runs] == ["bert-pod-0", "bert-pod-1"]
  assert all(c[-1] == "&" for c in runs)
  lines = r.stdout.splitlines()
  assert lines[lines.index(shlex.join(runs[-1][:-1]) + " &") + 1] == "wait"
  run0, run1 = (remote_command(c[:-1]) for c in runs)
  assert run0 == run1 and run0.endswith("exec " + shlex.join(TRAIN))
  # Process ids slice-major from the tpu-env metadata: slice id * 4 hosts + worker number.
  assert "attributes/tpu-env" in run0 and "attributes/agent-worker-number" in run0
  assert "BERTJAX_PROCESS_ID=$((SLICE_ID * 4 + WORKER)) " in run0
  assert "BERTJAX_NUM_PROCESSES=8 " in run0
  assert "BERTJAX_COORDINATOR_ADDRESS=${COORDINATOR%:*}:8482 " in run0
  assert cmds[-1][3:5] == ["queued-resources", "delete"]
  # Without --package: one wheel built, copied to every slice.
  package = MULTI_ARGS[MULTI_ARGS.index("--package") + 1]
  args = [a for a in MULTI_ARGS if a not in ("--package", package)]
  cmds = commands(launch("tpu_vm.py", *args, *TRAIN).stdout)
  assert sum(c[:4] == ["python3", "-m", "pip", "wheel"] for c in cmds) == 1
  wheels = [c for c in cmds if c[3:5] == ["tpu-vm", "scp"] and c[5].endswith(".whl")]
  assert [c[6] for c in wheels] == ["bert-pod-0:~/", "bert-pod-1:~/"]


def test_tpu_vm_refuses_zero_slices():
  r = launch("tpu_vm.py", *MULTI_ARGS[:-3], "--num-slices", "0", "--", *TRAIN)
  assert r.returncode == 2
  assert "--num-slices must be 1 or more, got 0" in r.stderr and "gcloud" not in r.stdout


TPU_ENV = """ACCELERATOR_TYPE: 'v5litepod-16'
MEGASCALE_COORDINATOR_ADDRESS: '{coordinator}'
MEGASCALE_NUM_SLICES: '2'
MEGASCALE_PORT: '8080'
MEGASCALE_SLICE_ID: '{slice_id}'
TPU_PROCESS_BOUNDS: '2,2,1'
"""


@pytest.mark.parametrize("shell", ["bash", "sh"])
@pytest.mark.parametrize("slice_id, worker, coordinator, expected", [
    (1, 2, "10.130.0.12:8080", "pid=6 n=8 coordinator=10.130.0.12:8482"),
    (0, 3, "bert-pod-0-w-0", "pid=3 n=8 coordinator=bert-pod-0-w-0:8482"),
    (None, 0, None, None),  # no MEGASCALE_* values: refused, training not started
])
def test_tpu_vm_multislice_run_command_numbers_processes_slice_major(
    tmp_path, shell, slice_id, worker, coordinator, expected):
  """The run command of a 2-slice dry run, executed by a shell against a fake metadata server
  (a `curl` answering tpu-env and agent-worker-number) and a fake `bertjax`."""
  if shutil.which(shell) is None:
    pytest.skip(f"no {shell}")
  r = launch("tpu_vm.py", *MULTI_ARGS, *TRAIN)
  run = next(remote_command(c) for c in commands(r.stdout) if "exec bertjax" in shlex.join(c))
  bin_dir, home = tmp_path / "bin", tmp_path / "home"
  (home / "bertjax-venv" / "bin").mkdir(parents=True)
  (home / "bertjax-venv" / "bin" / "activate").write_text("")
  bin_dir.mkdir()
  scripts = {
      "curl": '#!/bin/sh\nfor a; do url=$a; done\ncase "$url" in\n'
              '  */tpu-env) printf "%s" "$FAKE_TPU_ENV" ;;\n'
              '  */agent-worker-number) printf "%s" "$FAKE_WORKER" ;;\n'
              '  *) exit 22 ;;\nesac\n',
      "bertjax": '#!/bin/sh\necho "pid=$BERTJAX_PROCESS_ID n=$BERTJAX_NUM_PROCESSES '
                 'coordinator=$BERTJAX_COORDINATOR_ADDRESS args=$*"\n'}
  for name, text in scripts.items():
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  tpu_env = ("ACCELERATOR_TYPE: 'v5litepod-16'\n" if slice_id is None else
             TPU_ENV.format(coordinator=coordinator, slice_id=slice_id))
  env = dict(os.environ, HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             FAKE_TPU_ENV=tpu_env, FAKE_WORKER=str(worker))
  out = subprocess.run([shell, "-c", run], capture_output=True, text=True, env=env, timeout=30,
                       check=False)
  if expected is None:
    assert out.returncode == 1 and out.stdout == ""
    assert "no MEGASCALE_SLICE_ID" in out.stderr
  else:
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{expected} args={shlex.join(TRAIN[1:])}\n"


FAKE_GCLOUD = r"""#!{python}
import os, sys, time
d = os.environ["FAKE_DIR"]
argv = sys.argv[1:]
open(os.path.join(d, "calls"), "a").write(" ".join(argv) + "\n")
state_file = os.path.join(d, "state")
state = open(state_file).read() if os.path.exists(state_file) else "NOT_FOUND"
def set_state(s):
  open(state_file, "w").write(s)
if argv[2:4] == ["queued-resources", "describe"]:
  if state == "NOT_FOUND":
    sys.exit(1)
  print(state)
elif argv[2:4] == ["queued-resources", "create"]:
  set_state("ACTIVE")
elif argv[2:4] == ["queued-resources", "delete"]:
  os.remove(state_file)
elif argv[2:4] == ["tpu-vm", "ssh"] and "exec bertjax train" in argv[-1] and \
    "FAKE_SLICES" in os.environ:
  # One ssh per slice: each waits (10 s at most) until the others have started too.
  node = argv[4]
  open(os.path.join(d, "started-" + node), "w").close()
  deadline = time.time() + 10
  while len([f for f in os.listdir(d) if f.startswith("started-")]) < int(
      os.environ["FAKE_SLICES"]):
    if time.time() > deadline:
      print(f"{{node}}: the other slices did not start: not run at once")
      sys.exit(99)
    time.sleep(0.05)
  if node == os.environ.get("FAKE_HANG_NODE"):
    print(f"{{node}}: waiting for the other slices", flush=True)
    time.sleep(60)
  if node == os.environ.get("FAKE_FAIL_NODE"):
    print(f"{{node}}: step 40, then this slice failed")
    sys.exit(3)
  print(f"{{node}}: training finished")
elif argv[2:4] == ["tpu-vm", "ssh"] and "exec bertjax train" in argv[-1]:
  runs = len([l for l in open(os.path.join(d, "calls")) if "exec bertjax train" in l])
  if runs <= int(os.environ.get("FAKE_PREEMPTIONS", "1")):
    print(f"run {{runs}}: step 40, then the slice was preempted")
    set_state("SUSPENDED")
    sys.exit(255)
  print(f"run {{runs}}: resumed, training finished")
"""


def fake_cloud(tmp_path: Path, preemptions: int = 0, **fake: str) -> dict:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
  gcloud.chmod(0o755)
  return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
              FAKE_DIR=str(tmp_path), FAKE_PREEMPTIONS=str(preemptions),
              **{f"FAKE_{k.upper()}": v for k, v in fake.items()})


def test_tpu_vm_supervision_recreates_the_slice_after_preemption(tmp_path):
  env = fake_cloud(tmp_path, preemptions=1)
  args = [a for a in TPU_ARGS if a != "--dry-run"]
  log = tmp_path / "run.log"
  r = launch("tpu_vm.py", *args[:-1], "--poll", "0", "--log-file", str(log),
             "--configs", str(REPO / "configs"), "--", *TRAIN, env=env, cwd=tmp_path)
  assert r.returncode == 0, r.stdout + r.stderr
  calls = (tmp_path / "calls").read_text().splitlines()
  kinds = [c.split()[3] for c in calls if c.split()[2] == "queued-resources"]
  assert kinds.count("create") == 2 and kinds.count("delete") == 1
  assert kinds.index("delete") < len(kinds) - 1 - kinds[::-1].index("create")
  runs = [c for c in calls if "exec bertjax train" in c]
  assert len(runs) == 2 and all(shlex.join(TRAIN) in c for c in runs)
  text = log.read_text()
  assert "run 1: step 40, then the slice was preempted" in text
  assert "run 2: resumed, training finished" in text
  assert "restart 1/10" in text


def test_tpu_vm_supervision_gives_up_after_max_restarts(tmp_path):
  env = fake_cloud(tmp_path, preemptions=5)
  args = [a for a in TPU_ARGS if a != "--dry-run"]
  r = launch("tpu_vm.py", *args[:-1], "--poll", "0", "--max-restarts", "1",
             "--log-file", str(tmp_path / "run.log"), "--configs", str(REPO / "configs"),
             "--", *TRAIN, env=env, cwd=tmp_path)
  assert r.returncode == 255
  calls = (tmp_path / "calls").read_text()
  assert calls.count("exec bertjax train") == 2
  assert "giving up after 1 restarts" in r.stdout


@pytest.mark.parametrize("fail", [None, "bert-pod-0", "bert-pod-1"])
def test_tpu_vm_multislice_runs_all_slices_at_once_and_fails_if_one_fails(tmp_path, fail):
  env = fake_cloud(tmp_path, slices="2", **({"fail_node": fail} if fail else {}))
  args = [a for a in MULTI_ARGS if a != "--dry-run"]
  log = tmp_path / "run.log"
  r = launch("tpu_vm.py", *args[:-1], "--poll", "0", "--max-restarts", "0",
             "--log-file", str(log), "--configs", str(REPO / "configs"), "--", *TRAIN,
             env=env, cwd=tmp_path)
  calls = (tmp_path / "calls").read_text().splitlines()
  (create,) = [c for c in calls if c.startswith("compute tpus queued-resources create")]
  assert "--node-count=2 --node-prefix=bert-pod" in create and "--node-id" not in create
  ssh = [c.split()[4] for c in calls if c.startswith("compute tpus tpu-vm ssh")]
  assert ssh.count("bert-pod-0") == ssh.count("bert-pod-1") == 3  # mount, install, run
  # Both slices' output, each line with its prefix, on the console and in the log.
  text = log.read_text()
  for i in (0, 1):
    result = "step 40, then this slice failed" if fail == f"bert-pod-{i}" else "training finished"
    assert f"[slice {i}] bert-pod-{i}: {result}" in text
    assert f"[slice {i}] bert-pod-{i}: {result}" in r.stdout
  assert "not run at once" not in text
  if fail is None:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "training finished on all workers" in r.stdout
  else:
    assert r.returncode == 3, r.stdout + r.stderr
    assert "the run exited with 3" in text
    assert "giving up after 0 restarts" in r.stdout


def test_tpu_vm_multislice_ends_the_other_slices_after_the_grace_period(tmp_path):
  env = fake_cloud(tmp_path, slices="2", fail_node="bert-pod-1", hang_node="bert-pod-0")
  args = [a for a in MULTI_ARGS if a != "--dry-run"]
  args[0] = "run"
  start = time.monotonic()
  r = launch("tpu_vm.py", *args[:-1], "--grace", "1", "--log-file", str(tmp_path / "run.log"),
             "--", *TRAIN, env=env, cwd=tmp_path)
  assert r.returncode == 3, r.stdout + r.stderr
  assert time.monotonic() - start < 30  # not the hanging slice's 60 s
  assert "[slice 0] bert-pod-0: waiting for the other slices" in r.stdout
  assert "slice 1's run exited with 3; the other slices have 1 s to exit" in r.stdout
  assert "terminating the runs still going" in r.stdout


# ---------------------------------------------------------------------------- GKE


GKE_ARGS = ["--name", "bert-pod", "--tpu-type", "v5litepod-16", "--hosts", "4", "--spot",
            "--bucket", BUCKET, "--package", "bertjax[tpu] @ git+https://example.com/bertjax",
            "--dry-run", "--"]


def test_gke_jobset_manifest_for_4_hosts():
  r = launch("gke.py", *GKE_ARGS, *TRAIN)
  assert r.returncode == 0, r.stderr
  text = heredoc(r.stdout)
  lines = [l.split("#")[0].strip() for l in text.splitlines()]
  for line in ("kind: JobSet", "completionMode: Indexed", "parallelism: 4", "completions: 4",
               "maxRestarts: 10", "backoffLimit: 0",
               "cloud.google.com/gke-tpu-accelerator: tpu-v5-lite-podslice",
               "cloud.google.com/gke-tpu-topology: 4x4", 'cloud.google.com/gke-spot: "true"',
               "google.com/tpu: 4", 'gke-gcsfuse/volumes: "true"',
               "driver: gcsfuse.csi.storage.gke.io", f"bucketName: {BUCKET}",
               f"mountPath: /gcs/{BUCKET}", "exec " + shlex.join(TRAIN)):
    assert line in lines, line
  # Two-space indentation throughout, no tabs: YAML-shaped text.
  assert "\t" not in text
  assert all((len(l) - len(l.lstrip())) % 2 == 0 for l in text.splitlines())
  try:
    import yaml
  except ImportError:
    yaml = None
  if yaml is not None:
    doc = yaml.safe_load(text)
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"]) == (4, 4)
    pod = job["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    container = pod["containers"][0]
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert container["command"][-1].splitlines()[-1] == "exec " + shlex.join(TRAIN)
  cmds = commands(r.stdout)
  assert ["kubectl", "apply", "-f", "bert-pod.yaml"] in cmds
  logs = next(c for c in cmds if c[:3] == ["kubectl", "logs", "-f"])
  assert "jobset.sigs.k8s.io/jobset-name=bert-pod" in logs
  assert "configmap" in r.stdout and "--from-file=configs" in r.stdout


def test_gke_indexed_job_for_a_v4_32():
  args = [a if a != "v5litepod-16" else "v4-32" for a in GKE_ARGS]
  r = launch("gke.py", "--kind", "job", *args, *TRAIN)
  assert r.returncode == 0, r.stderr
  lines = [l.split("#")[0].strip() for l in heredoc(r.stdout).splitlines()]
  for line in ("kind: Job", "kind: Service", "clusterIP: None", "subdomain: bert-pod",
               "parallelism: 4", "completions: 4", "backoffLimit: 40",
               "cloud.google.com/gke-tpu-accelerator: tpu-v4-podslice",
               "cloud.google.com/gke-tpu-topology: 2x2x4"):
    assert line in lines, line


def test_gke_xpk_command():
  r = launch("gke.py", "--xpk", "--cluster", "my-cluster", "--zone", "us-central2-b",
             "--name", "bert-pod", "--tpu-type", "v4-32", "--bucket", BUCKET, "--dry-run", "--",
             *TRAIN)
  assert r.returncode == 0, r.stderr
  (cmd,) = commands(r.stdout)
  assert cmd[:3] == ["xpk", "workload", "create"]
  for flag in ("--cluster=my-cluster", "--workload=bert-pod", "--tpu-type=v4-32",
               "--num-slices=1", "--max-restarts=10", f"--storage={BUCKET}"):
    assert flag in cmd
  command = next(a for a in cmd if a.startswith("--command="))
  assert command.endswith("exec " + shlex.join(TRAIN))


def test_gke_jobset_for_2_slices():
  r = launch("gke.py", "--num-slices", "2", *GKE_ARGS, *TRAIN)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("# bert-pod: 2 x v5litepod-16 = 32 chips on 8 hosts (2 slices over "
                             "DCN)")
  text = heredoc(r.stdout)
  lines = [l.split("#")[0].strip() for l in text.splitlines()]
  for line in ("kind: JobSet", "replicas: 2", "parallelism: 4", "completions: 4",
               "hostNetwork: true", "dnsPolicy: ClusterFirstWithHostNet",
               "alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool",
               "cloud.google.com/gke-tpu-topology: 4x4", "exec " + shlex.join(TRAIN)):
    assert line in lines, line
  assert all((len(l) - len(l.lstrip())) % 2 == 0 for l in text.splitlines())
  try:
    import yaml
  except ImportError:
    yaml = None
  if yaml is not None:
    job = yaml.safe_load(text)["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 2
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
  # One node pool per slice in the printed prerequisite; logs from all 8 pods.
  pools = [shlex.split(l[4:]) for l in r.stdout.splitlines()
           if l.startswith("#   gcloud container node-pools create")]
  assert [p[4] for p in pools] == ["bert-pod-pool-0", "bert-pod-pool-1"]
  assert all("--num-nodes=4" in p and "--tpu-topology=4x4" in p for p in pools)
  assert "2 TPU node pools" in r.stdout
  assert "--max-log-requests=8" in r.stdout
  # A single slice keeps the pod network and one node pool.
  single = launch("gke.py", *GKE_ARGS, *TRAIN).stdout
  assert "hostNetwork" not in single and "replicas: 1" in single
  assert "node-pools create bert-pod-pool " in single


def test_gke_xpk_command_for_2_slices():
  r = launch("gke.py", "--xpk", "--cluster", "my-cluster", "--name", "bert-pod", "--tpu-type",
             "v4-32", "--num-slices", "2", "--bucket", BUCKET, "--dry-run", "--", *TRAIN)
  assert r.returncode == 0, r.stderr
  (cmd,) = commands(r.stdout)
  assert "--num-slices=2" in cmd and "--tpu-type=v4-32" in cmd


@pytest.mark.parametrize("extra, message", [
    (["--hosts", "2"], "--hosts 2 does not match --tpu-type v5litepod-16"),
    (["--topology", "2x4"], "--topology 2x4 does not match"),
    (["--tpu-type", "v5litepod-12"], "unknown TPU type 'v5litepod-12'"),
    (["--num-slices", "0"], "--num-slices must be 1 or more, got 0"),
    (["--kind", "job", "--num-slices", "2"], "--num-slices > 1 needs a JobSet"),
])
def test_gke_refuses_mismatched_requests(extra, message):
  args = list(GKE_ARGS)
  args.remove("--hosts")
  args.remove("4")
  if extra[0] == "--tpu-type":
    args[args.index("--tpu-type") + 1] = extra[1]
    extra = []
  r = launch("gke.py", *extra, *args, *TRAIN)
  assert r.returncode == 2
  assert message in r.stderr
  assert "kubectl" not in r.stdout


def test_gke_needs_a_way_to_get_bertjax_into_the_pod():
  args = [a for a in GKE_ARGS if a not in ("--package", "bertjax[tpu] @ git+https://example.com/"
                                           "bertjax")]
  r = launch("gke.py", *args, *TRAIN)
  assert r.returncode == 2 and "--package" in r.stderr
  r = launch("gke.py", "--image", "us-docker.pkg.dev/p/r/bertjax:1", *args, *TRAIN)
  assert r.returncode == 0 and "pip install" not in heredoc(r.stdout)


# ---------------------------------------------------------------------------- SLURM


def test_slurm_script_for_4_nodes():
  r = launch("slurm.py", "--nodes", "4", "--gpus-per-node", "8", "--time", "24:00:00",
             "--setup", "source /shared/venv/bin/activate", "--dry-run", "--", *TRAIN)
  assert r.returncode == 0, r.stderr
  text = heredoc(r.stdout)
  lines = text.splitlines()
  assert lines[0] == "#!/bin/bash"
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "#SBATCH --requeue", "#SBATCH --signal=B:TERM@120", "#SBATCH --time=24:00:00",
               'COORDINATOR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
               'export BERTJAX_NUM_PROCESSES="$SLURM_NTASKS"',
               "source /shared/venv/bin/activate"):
    assert line in lines, line
  # #SBATCH lines come before the first command.
  first_command = next(i for i, l in enumerate(lines) if l and not l.startswith("#"))
  assert all(i < first_command for i, l in enumerate(lines) if l.startswith("#SBATCH"))
  assert any(l.startswith('export BERTJAX_COORDINATOR_ADDRESS="$COORDINATOR:') for l in lines)
  srun = next(l for l in lines if l.startswith("srun "))
  inner = shlex.split(srun)[-2]  # bash -c '<inner>' &
  assert shlex.split(srun)[-4:-2] == ["bash", "-c"]
  assert inner.startswith("export BERTJAX_PROCESS_ID=$SLURM_PROCID; trap : TERM; "
                          + shlex.join(TRAIN) + "; STATUS=$?; ")
  assert "/gcs/my-bucket/bert-base/slurm_first_failure" in inner and "set -C" in inner
  assert "trap on_term TERM" in lines and 'scontrol requeue "$SLURM_JOB_ID"' in text
  assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
  assert commands(r.stdout)[0] == ["sbatch", "bertjax.sbatch"]


def test_slurm_script_for_cpu_nodes_with_two_processes_each():
  r = launch("slurm.py", "--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "0",
             "--dry-run", "--", *TRAIN)
  assert r.returncode == 0, r.stderr
  lines = heredoc(r.stdout).splitlines()
  assert "#SBATCH --ntasks-per-node=2" in lines
  assert not any("gpus" in l for l in lines)
  srun = next(l for l in lines if l.startswith("srun "))
  assert srun.startswith("srun --nodes=1 --ntasks-per-node=2 --kill-on-bad-exit=1 ")


# srun as the batch script meets it: every task at once (SLURM_PROCID), each in a process group
# of its own; with --kill-on-bad-exit the first non-zero exit ends the step (SIGCONT, then
# SIGTERM to every process of every task, as slurmstepd does), and the status is the worst.
FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys, time
args = sys.argv[1:]
command = next(i for i, a in enumerate(args) if not a.startswith("--"))
options = dict(a[2:].split("=", 1) for a in args[:command])
count = int(options["nodes"]) * int(options["ntasks-per-node"])
tasks = [subprocess.Popen(args[command:], env=dict(os.environ, SLURM_PROCID=str(i)),
                          start_new_session=True) for i in range(count)]
statuses, ending = {{}}, False
while len(statuses) < count:
  for i, task in enumerate(tasks):
    if i not in statuses and task.poll() is not None:
      statuses[i] = 128 - task.returncode if task.returncode < 0 else task.returncode
      if statuses[i] and not ending and options.get("kill-on-bad-exit") == "1":
        ending = True
        for other in tasks:
          if other.poll() is None:
            os.killpg(other.pid, signal.SIGCONT)
            os.killpg(other.pid, signal.SIGTERM)
  time.sleep(0.05)
sys.exit(max(statuses.values()))
"""
FAKE_SCONTROL = """#!/bin/sh
case "$1 $2" in
  "show hostnames") echo localhost;;
  "show job") echo "JobId=$3 JobState=RUNNING PreemptTime=None";;
  requeue*) echo "$@" >> "$FAKE_DIR/scontrol-requeue";;
esac
"""
# The training command of a task: FAKE_TASK_<procid> says what it does ("exit:N:SECONDS",
# "signal:N:SECONDS", "stop": SIGSTOP itself; otherwise it trains until a signal ends it).
FAKE_TASK = """import os, signal, sys, time
plan = os.environ.get("FAKE_TASK_" + os.environ["SLURM_PROCID"], "train").split(":")
if plan[0] == "stop":
  os.kill(os.getpid(), signal.SIGSTOP)
if plan[0] in ("exit", "signal"):
  time.sleep(float(plan[2]))
  if plan[0] == "exit":
    sys.exit(int(plan[1]))
  os.kill(os.getpid(), int(plan[1]))
time.sleep(60)
"""


@pytest.mark.parametrize("tasks, restart_count, first, requeued", [
    # Task 0's watchdog finds the hang (6) while task 1 is stopped (SIGSTOP); srun's status is
    # task 1's 143.
    (("exit:6:0.5", "stop"), 0, "task 0 exited with status 6", True),
    (("exit:6:0.5", "stop"), 3, "task 0 exited with status 6", False),  # --max-restarts 3
    # A peer killed outright (SIGKILL: the OOM killer, a dead host).
    (("train", "signal:9:0.5"), 0, "task 1 exited with status 137", True),
    # A user error on one task is no restart, though srun reports the 143 of the task it ended.
    (("exit:1:0.5", "train"), 0, "task 0 exited with status 1", False),
], ids=["hang-with-a-stopped-peer", "hang-after-max-restarts", "killed-peer", "user-error"])
def test_slurm_script_requeues_on_the_first_failure_of_the_step(tmp_path, tasks, restart_count,
                                                                first, requeued):
  """The sbatch script run by bash against a fake srun and scontrol: whether the job requeues
  itself follows the first task to fail, as launch/local.py's restarts do, not srun's worst
  status."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)),
                     ("scontrol", FAKE_SCONTROL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(0o755)
  (tmp_path / "task.py").write_text(FAKE_TASK)
  workdir = tmp_path / "run"
  workdir.mkdir()
  r = launch("slurm.py", "--nodes", "1", "--tasks-per-node", "2", "--gpus-per-node", "0",
             "--dry-run", "--", sys.executable, str(tmp_path / "task.py"), "--workdir",
             str(workdir))
  assert r.returncode == 0, r.stderr
  (tmp_path / "job.sbatch").write_text(heredoc(r.stdout))
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             FAKE_DIR=str(tmp_path), SLURM_JOB_ID="42", SLURM_JOB_NODELIST="localhost",
             SLURM_NTASKS="2", SLURM_NNODES="1", SLURM_RESTART_COUNT=str(restart_count),
             **{f"FAKE_TASK_{i}": plan for i, plan in enumerate(tasks)})
  job = subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=60)
  assert (tmp_path / "scontrol-requeue").exists() == requeued, job.stdout + job.stderr
  assert f"[slurm] first failure: {first}" in job.stdout, job.stdout + job.stderr
  status = first.rsplit(" ", 1)[1]
  assert (f"[slurm] exit status {status}: requeueing (restart {restart_count + 1} of 3)"
          in job.stdout) == requeued


def test_slurm_writes_nothing_in_dry_run_and_refuses_bad_requests(tmp_path):
  r = launch("slurm.py", "--nodes", "4", "--dry-run", "--", *TRAIN, cwd=tmp_path)
  assert r.returncode == 0 and not list(tmp_path.iterdir())
  r = launch("slurm.py", "--nodes", "0", "--dry-run", "--", *TRAIN)
  assert r.returncode == 2 and "--nodes" in r.stderr
  r = launch("slurm.py", "--nodes", "1", "--tasks-per-node", "0", "--dry-run", "--", *TRAIN)
  assert r.returncode == 2 and "--tasks-per-node" in r.stderr
  r = launch("slurm.py", "--nodes", "1", "--tasks-per-node", "2", "--dry-run", "--", *TRAIN)
  assert r.returncode == 2 and "for CPU nodes (--gpus-per-node 0)" in r.stderr
  r = launch("slurm.py", "--nodes", "4", "--dry-run", "--", "bertjax", "train")
  assert r.returncode == 2 and "no --workdir" in r.stderr


# ---------------------------------------------------------------------------- help


@pytest.mark.parametrize("script, example", [
    ("tpu_vm.py", "python launch/tpu_vm.py up --name bert-base"),
    ("gke.py", "python launch/gke.py --name bert-base --tpu-type v4-32"),
    ("slurm.py", "python launch/slurm.py --nodes 4 --gpus-per-node 8"),
])
def test_help_prints_an_example(script, example):
  r = launch(script, "--help")
  assert r.returncode == 0
  assert "example" in r.stdout and example in r.stdout and "--dry-run" in r.stdout


# ---------------------------------------------------------------------------- data


@pytest.mark.parametrize("script, args", [
    ("tpu_vm.py", TPU_ARGS),
    ("gke.py", None),
    ("slurm.py", ["--nodes", "4", "--dry-run", "--"]),
])
def test_launchers_say_how_a_pod_run_gets_its_data(script, args):
  """A multi-host run with no --config.data.dataset builds data.sources in process 0 first:
  each launcher says so (a `#` line) and names `bertjax data build`; with a dataset, silence."""
  args = GKE_ARGS if args is None else args
  r = launch(script, *args, *TRAIN)
  assert r.returncode == 0, r.stderr
  note = [l for l in (r.stdout + r.stderr).splitlines()
          if l.startswith("#") and "no --config.data.dataset" in l]
  assert len(note) == 1 and "bertjax data build" in note[0], note
  r = launch(script, *args, *TRAIN, "--config.data.dataset=/gcs/my-bucket/data/wiki")
  assert r.returncode == 0 and "no --config.data.dataset" not in r.stdout + r.stderr


# ---------------------------------------------------------------------------- local


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_local_processes_die_with_a_killed_launcher(tmp_path):
  """SIGKILL to launch/local.py's process group (a lost host, as the multi-host tests kill one)
  ends every process it started, though each leads a process group of its own: none trains on
  as an orphan and writes checkpoints the restarted run did not expect. Found when a killed
  4-process run committed step 4 after the kill that should have left step 2."""
  pids = tmp_path / "pids"
  child = ("import os, pathlib, time; "
           f"p = pathlib.Path({str(pids)!r}); "
           "p.mkdir(exist_ok=True); (p / str(os.getpid())).touch(); time.sleep(120)")
  launcher = subprocess.Popen(
      [sys.executable, str(REPO / "launch" / "local.py"), "--processes", "2", "--devices", "1",
       "--", sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  deadline = time.monotonic() + 30
  while not pids.exists() or len(list(pids.iterdir())) < 2:
    assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
    time.sleep(0.05)
  started = [int(p.name) for p in pids.iterdir()]
  os.killpg(launcher.pid, signal.SIGKILL)
  launcher.communicate()
  deadline = time.monotonic() + 10
  alive = started
  while alive and time.monotonic() < deadline:
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()
             and Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"]
    time.sleep(0.05)
  assert not alive, f"processes {alive} outlived their killed launcher"
