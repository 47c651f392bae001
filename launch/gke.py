#!/usr/bin/env python3
"""Train on a TPU slice in a GKE cluster: generate a JobSet (default) or an Indexed Job
manifest — one pod per TPU host (completions = parallelism = hosts), TPU node selectors
(cloud.google.com/gke-tpu-accelerator, cloud.google.com/gke-tpu-topology), google.com/tpu
chips per pod, the bucket mounted with the Cloud Storage FUSE CSI driver at /gcs/BUCKET, the
same `bertjax train` command in every pod — apply it with kubectl and follow the logs. Or,
with --xpk, the equivalent `xpk workload create`.

Preemption: a JobSet whose pod dies (a Spot node reclaimed, a host failure) is re-created as a
whole, at most --max-restarts times (failurePolicy.maxRestarts); the pods get SIGTERM first
(bertjax saves a checkpoint and exits 0) and the new pods resume from the latest checkpoint in
the same workdir. GKE sets TPU_WORKER_HOSTNAMES / TPU_WORKER_ID in TPU pods, from which JAX
(through bertjax.parallel.distributed) finds its peers; the launcher sets no variables of its own.

Several slices (--num-slices N; a JobSet or xpk, not --kind job): the replicated Job gets
`replicas: N`, one Job per slice, each on its own node pool of the slice's shape (the
exclusive-topology annotation), and the pods use the host network, as in xpk's multislice
template and the JobSet TPU example. GKE then sets the MEGASCALE_* variables of the slices
over DCN in the pods (JAX: "GKE via JobSet"; not checked in detail here) and
bertjax.parallel.distributed leaves the cluster detection to JAX; the mesh across slices is
config.dcn_mesh (data parallel by default).

The container needs bertjax: an --image with it installed, or --package, pip-installed when a
pod starts. configs/ travels as a ConfigMap mounted at /bertjax/configs (the working
directory), so `--config configs/bert_base.py` works in the pod.
Stdlib only: runs on a laptop with kubectl (or xpk), no bertjax or jax needed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from common import (REPO, UsageError, data_note, flag_value, parse_tpu_type, rel, show,
                    split_command)

EXAMPLE = """example (BERT-base on a v4-32 slice: 16 chips on 4 hosts, Spot nodes):
  python launch/gke.py --name bert-base --tpu-type v4-32 --spot --bucket my-bucket \\
      --package 'bertjax[tpu] @ git+https://github.com/OWNER/bertjax' --dry-run -- \\
      bertjax train --config configs/bert_base.py --workdir /gcs/my-bucket/bert-base

  the same through xpk (its cluster made with `xpk cluster create`):
  python launch/gke.py --xpk --cluster my-cluster --zone us-central2-b --project my-project \\
      --name bert-base --tpu-type v4-32 --bucket my-bucket --dry-run -- \\
      bertjax train --config configs/bert_base.py --workdir /gcs/my-bucket/bert-base

  on 2 slices over DCN (one node pool per slice): add --num-slices 2 (JobSet or xpk)

  --dry-run prints the manifest and the exact commands instead of running them. Exit codes:
  0 applied, 2 a bad request (unknown TPU type, hosts or topology not matching it, workdir
  outside the bucket, no way to get bertjax into the container, --num-slices with --kind job).
"""
DEFAULT_IMAGE = "python:3.11"
WORKDIR_IN_POD = "/bertjax"


def container_script(args: argparse.Namespace, train: list[str], requirement: str | None) -> str:
  lines = ["set -e"]
  if requirement:
    lines.append(f'pip install -q "{requirement}"')
  lines.append(f"exec {show(train)}")
  return "\n".join(lines)


def manifest(args: argparse.Namespace, tpu, topology: str, train: list[str]) -> str:
  """A JobSet (or Indexed Job + headless Service) as YAML text."""
  name, hosts, chips, slices = args.name, tpu.hosts, tpu.chips_per_host, args.num_slices
  mount = f"/gcs/{args.bucket}"
  script = container_script(args, train, args.package)
  selectors = [f"cloud.google.com/gke-tpu-accelerator: {tpu.gke_accelerator}",
               f"cloud.google.com/gke-tpu-topology: {topology}"]
  if args.spot:
    selectors.append('cloud.google.com/gke-spot: "true"')
  tolerations = ["- key: google.com/tpu", "  operator: Exists", "  effect: NoSchedule"]
  if args.spot:
    tolerations += ["- key: cloud.google.com/gke-spot", "  operator: Exists",
                    "  effect: NoSchedule"]
  pod = ["metadata:", "  annotations:", '    gke-gcsfuse/volumes: "true"', "spec:",
         "  restartPolicy: Never", f"  terminationGracePeriodSeconds: {args.grace}"]
  if args.kind == "job":
    pod.append(f"  subdomain: {name}")
  if slices > 1:  # as xpk's multislice JobSet and the JobSet TPU multislice example
    pod += ["  hostNetwork: true", "  dnsPolicy: ClusterFirstWithHostNet"]
  if args.service_account:
    pod.append(f"  serviceAccountName: {args.service_account}")
  pod += ["  nodeSelector:"] + [f"    {s}" for s in selectors]
  pod += ["  tolerations:"] + [f"  {t}" for t in tolerations]
  pod += ["  containers:", "  - name: bertjax", f"    image: {args.image}"]
  if args.configs:
    pod.append(f"    workingDir: {WORKDIR_IN_POD}")
  pod += ["    command:", "    - bash", "    - -c", "    - |"]
  pod += [f"      {line}" for line in script.splitlines()]
  pod += ["    resources:", "      requests:", f"        google.com/tpu: {chips}",
          "      limits:", f"        google.com/tpu: {chips}",
          "    volumeMounts:", "    - name: gcs", f"      mountPath: {mount}"]
  if args.configs:
    pod += ["    - name: configs", f"      mountPath: {WORKDIR_IN_POD}/configs"]
  pod += ["  volumes:", "  - name: gcs", "    csi:", "      driver: gcsfuse.csi.storage.gke.io",
          "      volumeAttributes:", f"        bucketName: {args.bucket}",
          "        mountOptions: implicit-dirs"]
  if args.configs:
    pod += ["  - name: configs", "    configMap:", f"      name: {name}-configs"]

  def indent(lines, n):
    return [" " * n + line for line in lines]

  if args.kind == "jobset":
    head = ["apiVersion: jobset.x-k8s.io/v1alpha2", "kind: JobSet", "metadata:",
            f"  name: {name}", "  annotations:",
            "    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool",
            "spec:", "  failurePolicy:",
            f"    maxRestarts: {args.max_restarts}  # re-create all pods after a failure",
            "  replicatedJobs:", "  - name: workers",
            "    replicas: 1" if slices == 1 else
            f"    replicas: {slices}  # one Job per slice, each on its own node pool",
            "    template:",
            "      spec:", "        completionMode: Indexed",
            f"        parallelism: {hosts}  # one pod per TPU host",
            f"        completions: {hosts}",
            "        backoffLimit: 0  # a failed pod fails the Job; the JobSet restarts all",
            "        template:"]
    return "\n".join(head + indent(pod, 10)) + "\n"
  head = ["apiVersion: v1", "kind: Service", "metadata:", f"  name: {name}", "spec:",
          "  clusterIP: None", "  selector:", f"    job-name: {name}", "---",
          "apiVersion: batch/v1", "kind: Job", "metadata:", f"  name: {name}", "spec:",
          "  completionMode: Indexed", f"  parallelism: {hosts}  # one pod per TPU host",
          f"  completions: {hosts}",
          f"  backoffLimit: {args.max_restarts * hosts}  # pod failures before the Job fails",
          "  template:"]
  return "\n".join(head + indent(pod, 4)) + "\n"


def pod_selector(args: argparse.Namespace) -> str:
  if args.kind == "jobset":
    return f"jobset.sigs.k8s.io/jobset-name={args.name}"
  return f"job-name={args.name}"


def xpk_command(args: argparse.Namespace, tpu, train: list[str]) -> list[str]:
  cmd = ["xpk", "workload", "create", f"--cluster={args.cluster}", f"--workload={args.name}",
         f"--tpu-type={tpu.accelerator_type}", f"--num-slices={args.num_slices}",
         f"--max-restarts={args.max_restarts}"]
  if args.project:
    cmd.append(f"--project={args.project}")
  if args.zone:
    cmd.append(f"--zone={args.zone}")
  if args.image != DEFAULT_IMAGE:
    cmd.append(f"--docker-image={args.image}")
    requirement = args.package
  else:  # xpk layers --script-dir (this checkout, with configs/) into the base image at /app
    cmd += [f"--base-docker-image={DEFAULT_IMAGE}", f"--script-dir={rel(REPO)}"]
    requirement = args.package or ".[tpu]"
  cmd.append(f"--storage={args.storage or args.bucket}")
  script = container_script(args, train, requirement).replace("\n", "; ")
  cmd.append(f"--command={script}")
  return cmd


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  own, train = split_command(argv)
  p = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--name", required=True, help="JobSet / Job / xpk workload name")
  p.add_argument("--tpu-type", required=True,
                 help="accelerator type as for TPU VMs: v4-32, v5p-32, v5litepod-16, v6e-16...")
  p.add_argument("--hosts", type=int,
                 help="expected number of hosts per slice (checked against the type)")
  p.add_argument("--num-slices", type=int, default=1,
                 help="slices of --tpu-type joined over the data-center network (multislice; "
                 "JobSet or xpk, one node pool per slice); default 1")
  p.add_argument("--topology", help="slice topology (default: the standard shape of the type, "
                 "e.g. v4-32 -> 2x2x4, v5litepod-16 -> 4x4)")
  p.add_argument("--bucket", required=True, help="GCS bucket mounted at /gcs/BUCKET in each pod")
  p.add_argument("--image", default=DEFAULT_IMAGE,
                 help=f"container image (default {DEFAULT_IMAGE}: then --package is needed)")
  p.add_argument("--package", help="pip requirement installed when a pod starts, e.g. "
                 "'bertjax[tpu] @ git+https://github.com/OWNER/bertjax'")
  p.add_argument("--configs", default=rel(REPO / "configs"),
                 help="config directory shipped as a ConfigMap ('' for none: the image has it)")
  p.add_argument("--spot", action="store_true", help="schedule on Spot TPU nodes")
  p.add_argument("--service-account", help="Kubernetes service account with access to the "
                 "bucket (Workload Identity)")
  p.add_argument("--kind", choices=["jobset", "job"], default="jobset",
                 help="JobSet (restarts all pods together; needs the JobSet controller) or an "
                      "Indexed Job with a headless Service")
  p.add_argument("--max-restarts", type=int, default=10, help="restarts after failures")
  p.add_argument("--grace", type=int, default=120,
                 help="terminationGracePeriodSeconds: time to save a checkpoint on SIGTERM")
  p.add_argument("--manifest", help="where to write the manifest (default: NAME.yaml)")
  p.add_argument("--xpk", action="store_true", help="submit with `xpk workload create`")
  p.add_argument("--cluster", help="xpk: cluster name")
  p.add_argument("--zone", help="xpk: zone of the cluster")
  p.add_argument("--project", help="xpk: GCP project")
  p.add_argument("--storage", help="xpk: name of the gcsfuse storage attached with `xpk storage "
                 "attach` (default: the bucket name)")
  p.add_argument("--dry-run", action="store_true", help="print the manifest and the commands")
  a = p.parse_args(own)
  try:
    if a.num_slices < 1:
      raise UsageError(f"--num-slices must be 1 or more, got {a.num_slices}")
    if a.num_slices > 1 and a.kind == "job" and not a.xpk:
      raise UsageError("--num-slices > 1 needs a JobSet (one Job per slice): an Indexed Job "
                       "(--kind job) spans one slice only")
    tpu = parse_tpu_type(a.tpu_type, a.hosts)
    default_topology = tpu.topology
    topology = a.topology or default_topology
    chips = 1
    for d in topology.split("x"):
      chips *= int(d) if d.isdigit() else 0
    if chips != tpu.chips or len(topology.split("x")) != len(default_topology.split("x")):
      raise UsageError(f"--topology {topology} does not match --tpu-type "
                       f"{tpu.accelerator_type} ({tpu.chips} chips, e.g. {default_topology})")
    if not train:
      raise UsageError("no training command: put it after --, e.g. -- bertjax train "
                       "--config configs/bert_base.py --workdir /gcs/BUCKET/RUN")
    mount = f"/gcs/{a.bucket}"
    workdir = flag_value(train, "--workdir")
    inside = [f"{mount}/", f"gs://{a.bucket}/"]  # the mount, or gs:// (written natively)
    if workdir is None or not any(workdir.startswith(p) and len(workdir) > len(p)
                                  for p in inside):
      raise UsageError(f"the training --workdir must be a directory under {mount} (the bucket "
                       f"mounted in every pod) or gs://{a.bucket}/, got {workdir!r}")
    if a.xpk and not a.cluster:
      raise UsageError("--xpk needs --cluster")
    if not a.xpk and a.image == DEFAULT_IMAGE and not a.package:
      raise UsageError(f"the default image {DEFAULT_IMAGE} has no bertjax: give --package (a pip "
                       "requirement installed at pod start) or --image with bertjax installed")
  except (UsageError, ValueError) as e:
    p.print_usage(sys.stderr)
    print(f"{p.prog}: error: {e}", file=sys.stderr)
    return 2

  out = sys.stdout
  head = (f"# {a.name}: {tpu.describe(a.num_slices).replace(tpu.topology, topology)}; "
          f"GKE {tpu.gke_accelerator} nodes ({tpu.gke_machine_type})")
  if note := data_note(train):
    head += f"\n# {note}"
  if a.xpk:
    storage = a.storage or a.bucket
    cmd = xpk_command(a, tpu, train)
    lines = [head,
             f"# prerequisite (once): the bucket attached to the cluster at {mount}:",
             "#   " + show(["xpk", "storage", "attach", storage, "--type=gcsfuse",
                           f"--cluster={a.cluster}"]
                          + ([f"--zone={a.zone}"] if a.zone else [])
                          + ([f"--project={a.project}"] if a.project else [])
                          + [f"--bucket={a.bucket}", f"--mount-point={mount}",
                             "--readonly=false", "--auto-mount=false", "--size=1"]),
             "# Spot capacity is a property of the xpk cluster (xpk cluster create --spot).",
             show(cmd)]
    if a.dry_run:
      print("\n".join(lines), file=out)
      return 0
    print("\n".join(lines[:-1]), file=out, flush=True)
    return subprocess.run(cmd, check=False).returncode

  path = a.manifest or f"{a.name}.yaml"
  text = manifest(a, tpu, topology, train)
  configmap = (["kubectl", "create", "configmap", f"{a.name}-configs", f"--from-file={a.configs}",
                "--dry-run=client", "-o", "yaml"], ["kubectl", "apply", "-f", "-"])
  apply_ = ["kubectl", "apply", "-f", path]
  wait = ["kubectl", "wait", "--for=condition=Ready", "pod", "-l", pod_selector(a),
          "--timeout=1h"]
  logs = ["kubectl", "logs", "-f", "-l", pod_selector(a), "-c", "bertjax", "--prefix",
          f"--max-log-requests={tpu.hosts * a.num_slices}", "--tail=-1"]
  status = ["kubectl", "get", "jobset" if a.kind == "jobset" else "job", a.name]
  pools = ([f"{a.name}-pool"] if a.num_slices == 1 else
           [f"{a.name}-pool-{i}" for i in range(a.num_slices)])
  node_pools = [["gcloud", "container", "node-pools", "create", pool, "--cluster=CLUSTER",
                 "--location=ZONE", f"--machine-type={tpu.gke_machine_type}",
                 f"--tpu-topology={topology}", f"--num-nodes={tpu.hosts}"]
                + (["--spot"] if a.spot else []) for pool in pools]
  if a.dry_run:
    print(head, file=out)
    pool = ("a TPU node pool of this shape" if a.num_slices == 1 else
            f"{a.num_slices} TPU node pools of this shape (one per slice)")
    print(f"# prerequisite (once): {pool}, the GCS FUSE CSI driver and "
          "(for JobSet) the JobSet controller in the cluster, e.g.", file=out)
    for node_pool in node_pools:
      print("#   " + show(node_pool), file=out)
    print(f"cat > {shlex.quote(path)} <<'EOF'", file=out)
    out.write(text)
    print("EOF", file=out)
    if a.configs:
      print(show(configmap[0]) + " | " + show(configmap[1]), file=out)
    for cmd in (apply_, wait, logs):
      print(show(cmd), file=out)
    print(f"# status: {show(status)}", file=out)
    return 0
  Path(path).write_text(text)
  print(f"[launch] wrote {path}", flush=True)
  try:
    if a.configs:
      print("[launch] " + show(configmap[0]) + " | " + show(configmap[1]), flush=True)
      made = subprocess.run(configmap[0], capture_output=True, text=True, check=True)
      subprocess.run(configmap[1], input=made.stdout, text=True, check=True)
    for cmd in (apply_, wait):
      print("[launch] " + show(cmd), flush=True)
      subprocess.run(cmd, check=True)
    print("[launch] " + show(logs), flush=True)
    subprocess.run(logs, check=False)
  except subprocess.CalledProcessError as e:
    print(f"[launch] failed: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    pass
  print(f"[launch] the job runs on in the cluster; status: {show(status)}; logs: {show(logs)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
