"""`bertjax bench --gpu-session OUT`: what a lent GPU runs, in one command that fits a short lease
— the accelerator tier, the GPU table with a profile of every row (our kernels and the
reference's), variants of our step (XLA flags, attention, the layer loop), and one results page,
OUT/gpu-session.md (with OUT/gpu-session.json and OUT/traces.tar.gz).

Each (row, variant) is a job in a process of its own; jobs compile together in waves, then time
their steps one at a time under a lock file. A deadline ends the session with what finished;
the page is written whatever happened.

The guide: docs/doctor.md, 'One command on a lent GPU'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bertjax import config as config_lib
from bertjax import paths
from bertjax.parallel import host
from bertjax.tools import bench, bench_table, session_page
from bertjax.training import flops


# A variant of our step: XLA flags for its process and config overrides.
@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  xla_flags: str = ""
  overrides: tuple[tuple[str, str], ...] = ()
  doc: str = ""


VARIANTS = {v.name: v for v in (
    Variant("default", doc="the table's row as configured, under the bertjax command's flags"),
    Variant("triton-gemm", "--xla_gpu_enable_triton_gemm=true",
            doc="XLA's Triton GEMM fusions back on (the bertjax command turns them off)"),
    Variant("cublas-only", "--xla_gpu_enable_triton_gemm=false",
            doc="every GEMM through cuBLAS (no Triton GEMM fusions), as the bertjax command "
                "sets on a GPU host"),
    Variant("no-command-buffers", "--xla_gpu_enable_command_buffer=",
            doc="kernels launched one by one instead of replayed as CUDA graphs"),
    Variant("latency-hiding", "--xla_gpu_enable_latency_hiding_scheduler=true",
            doc="XLA's latency-hiding scheduler (JAX-Toolbox's image sets it)"),
    Variant("xla-attention", overrides=(("model.attention", "xla"),),
            doc="attention as XLA einsums instead of cuDNN's fused kernel"),
    Variant("scanned", overrides=(("model.scan_layers", "true"),),
            doc="the layers as one scanned loop (the pod configs' form)"),
)}

# A job's share of a wave (`Job.slots`): a job with the reference counts twice (torch.compile
# competes with XLA's compiles for the host's cores: seven compiles at once on an H200's host
# kept three torch.compiles from finishing within the lease;
# docs/results/2026-11-28-h200-gpu-session.md), and the rows whose steps hold the most memory
# count once more, so that few jobs hold the device's memory beside them.
_HEAVY_ROWS = ("GPT-2 XL s1024",)


@dataclasses.dataclass(frozen=True)
class Job:
  row: str
  variant: str
  reference: bool  # time the transformers step alternately with ours, and profile it

  @property
  def slots(self) -> int:
    return (2 if self.reference else 1) + (1 if self.row in _HEAVY_ROWS else 0)

  @property
  def name(self) -> str:
    return f"{self.row} / {self.variant}"

  @property
  def slug(self) -> str:
    return "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")


def plan(rows: tuple[str, ...] = (), variants: tuple[str, ...] = ("default",),
         variant_rows: tuple[str, ...] = ()) -> list[Job]:
  """The jobs: every row (or `rows`) as configured, against the reference; then each other
  variant, ours alone, on `variant_rows` (default: every row run)."""
  table = [r.name for r in bench_table.TABLES["gpu"]]
  unknown = (set(rows) | set(variant_rows)) - set(table)
  if unknown:
    raise ValueError(f"unknown rows {sorted(unknown)}; the gpu table has {', '.join(table)}")
  bad = set(variants) - set(VARIANTS)
  if bad:
    raise ValueError(f"unknown variants {sorted(bad)}; variants: {', '.join(VARIANTS)}")
  chosen = [r for r in table if not rows or r in rows]
  jobs = [Job(r, "default", True) for r in chosen]
  for v in variants:
    if v != "default":
      jobs += [Job(r, v, False) for r in chosen if not variant_rows or r in variant_rows]
  return jobs


def device_lock(out: Path) -> contextlib.AbstractContextManager:
  """The device to this process alone while held: `paths.host_lock` on the session's
  OUT/device.lock, which the tier and every job take."""
  return paths.host_lock(out / "device.lock")


# --------------------------------------------------------------------------------------------
# One job, in its own process


def run_job(job: Job, out: Path, reduced: bool, steps: int, pairs: int) -> dict[str, Any]:
  """The job's bench record: our step (and the reference's) compiled, then timed and profiled
  under the device lock; the optimized program is kept beside the trace."""
  row = next(r for r in bench_table.TABLES["gpu"] if r.name == job.row)
  overrides = bench_table.config_overrides(row, reduced)
  overrides.update(VARIANTS[job.variant].overrides)
  config = config_lib.load_config(row.config, list(overrides.items()))
  trace_dir = out / "traces" / job.slug
  started = time.time()

  def log(line: str) -> None:
    print(f"[{job.name} {time.time() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

  record = bench.run_benchmark(
      config, steps=steps, pairs=pairs, compare="hf" if job.reference else None,
      peak_size=flops.matmul_peak_size(512), profile_dir=str(trace_dir),
      reference_compile=job.reference and not reduced, profile_reference=job.reference,
      exclusive=lambda: timing_turn(out, job),
      log=log)
  record["job"] = dataclasses.asdict(job) | {"overrides": overrides,
                                             "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                             "seconds": time.time() - started}
  return record


def _job_main(spec: str) -> int:
  args = json.loads(spec)
  job, out = Job(**args["job"]), Path(args["out"])
  path = out / "jobs" / f"{job.slug}.json"
  try:
    record = run_job(job, out, args["reduced"], args["steps"], args["pairs"])
  except Exception as e:  # noqa: BLE001 - the job's failure is its result
    traceback.print_exc()
    record = {"job": dataclasses.asdict(job),
              "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
  finally:
    # A job that failed while compiling must not hold its wave's timing back.
    (out / "jobs" / f"{job.slug}.compiling").unlink(missing_ok=True)
  bench.write_record(record, str(path))
  return 0


# --------------------------------------------------------------------------------------------
# The session


def _versions() -> dict[str, str]:
  versions = {"python": sys.version.split()[0]}
  for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers"):
    try:
      versions[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001 - absent packages are reported as such
      versions[name] = "absent"
  try:
    versions["gpu"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    versions["gpu"] = "none (no nvidia-smi)"
  try:
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=10, cwd=here).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10, cwd=here).stdout.strip()
    versions["bertjax"] = (commit + (" with uncommitted changes" if changed else "")) or "unknown"
  except (OSError, subprocess.TimeoutExpired):
    versions["bertjax"] = "unknown"
  return versions


TIER_COMMAND = ("-m", "pytest", "-m", "accelerator", "-n", "0", "-p", "no:cacheprovider", "-o",
                "addopts=", "-rA", "--timeout", "300", "tests/test_accelerator.py")


def run_tier(out: Path, deadline: float, select: str = "") -> dict[str, Any]:
  """The accelerator tier (tests/test_accelerator.py; `select`: a pytest -k expression) under
  the device lock: each test's outcome and seconds, from pytest's JUnit report."""
  repo = Path(__file__).resolve().parents[2]
  if not (repo / "tests" / "test_accelerator.py").is_file():
    return {"error": "no tests/test_accelerator.py beside this bertjax (an installed copy)"}
  report = out / "tier.xml"
  command = [sys.executable, *TIER_COMMAND, *(("-k", select) if select else ()),
             f"--junitxml={report}"]
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  env.pop("XLA_FLAGS", None)
  # The tier runs on the accelerator: tests/conftest.py otherwise defaults JAX_PLATFORMS to
  # the CPU and adds the suite's CPU flags, which a newer jaxlib may not know (jax 0.11 aborts
  # on --xla_cpu_use_fusion_emitters: the tier of 2026-11-28's H200 session ended there).
  if not env.get("JAX_PLATFORMS", "").strip():
    env["JAX_PLATFORMS"] = host.accelerator_platform() or "cpu"
  started = time.time()
  with device_lock(out), open(out / "tier.log", "w") as log:
    try:
      code = subprocess.run(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=max(deadline - time.time(), 1)).returncode
    except subprocess.TimeoutExpired:
      code = None
  shown = " ".join(TIER_COMMAND) + (f" -k '{select}'" if select else "")
  result: dict[str, Any] = {"command": "python " + shown,
                            "returncode": code, "seconds": time.time() - started, "tests": []}
  if code is None:
    result["error"] = "cut by the session's deadline"
  if report.is_file():
    for case in ElementTree.parse(report).getroot().iter("testcase"):
      outcome = "passed"
      for tag in ("failure", "error", "skipped"):
        child = case.find(tag)
        if child is not None:
          outcome = {"failure": "failed"}.get(tag, tag)
          result.setdefault("messages", {})[case.get("name")] = (child.get("message") or "")[:300]
      result["tests"].append({"name": case.get("name"), "outcome": outcome,
                              "seconds": float(case.get("time") or 0)})
  return result


def with_flags(present: str, flags: str) -> str:
  """XLA_FLAGS `present` with each of `flags` in place of the same flag's setting there."""
  names = {f.split("=", 1)[0] for f in flags.split()}
  kept = [f for f in present.split() if f.split("=", 1)[0] not in names]
  return " ".join(kept + flags.split())


def _next_wave(queue: list[Job], max_jobs: int) -> list[Job]:
  """Takes the next wave off `queue`: jobs in order while their slots (`Job.slots`) fit in
  `max_jobs` (the first always goes, alone when it needs more). A wave's jobs compile
  together, then time one after another once all of them have compiled (`timing_turn`), so no
  compile competes with a timed step for the host's cores; the next wave starts when the last
  one has finished."""
  wave, used = [], 0
  while queue and (not wave or used + queue[0].slots <= max_jobs):
    used += queue[0].slots
    wave.append(queue.pop(0))
  return wave


@contextlib.contextmanager
def timing_turn(out: Path, job: Job, wait_seconds: float = 600) -> Iterator[None]:
  """The device to `job` alone (`device_lock`), once no other job of its wave is still
  compiling (their jobs/*.compiling markers gone; at most `wait_seconds`)."""
  (out / "jobs" / f"{job.slug}.compiling").unlink(missing_ok=True)
  with device_lock(out):
    give_up = time.time() + wait_seconds
    while list((out / "jobs").glob("*.compiling")) and time.time() < give_up:
      time.sleep(0.5)
    yield


def _start(job: Job, out: Path, reduced: bool, steps: int, pairs: int) -> subprocess.Popen:
  env = dict(os.environ)
  # Jobs share the device: each allocates what it uses instead of 75% of it up front.
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["XLA_FLAGS"] = with_flags(env.get("XLA_FLAGS", ""), VARIANTS[job.variant].xla_flags)
  spec = json.dumps({"job": dataclasses.asdict(job), "out": str(out), "reduced": reduced,
                     "steps": steps, "pairs": pairs})
  with open(out / "jobs" / f"{job.slug}.log", "w") as log:  # the child keeps its own handle
    return subprocess.Popen([sys.executable, "-m", "bertjax.tools.gpu_session", spec], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def run_session(out: str, *, jobs: list[Job], reduced: bool = False, tier: bool = True,
                tier_select: str = "", seconds: float = 450, max_jobs: int = 4, steps: int = 5,
                pairs: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs the tier (`tier_select`: a -k expression) and `jobs` within `seconds`, in waves of
  at most `max_jobs` slots (`_next_wave`); writes OUT/gpu-session.json, .md and
  traces.tar.gz. Returns the session's record."""
  root = Path(out)
  (root / "jobs").mkdir(parents=True, exist_ok=True)
  started = time.time()
  deadline = started + seconds
  session: dict[str, Any] = {"versions": _versions(), "reduced": reduced, "seconds": seconds,
                             "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                             "variant_docs": {k: v.doc for k, v in VARIANTS.items()}}
  tier_result: dict[str, Any] = {}
  tier_thread = None
  if tier:
    # Leave the jobs' timing a share of the lease: the tier gets at most 60% of it.
    tier_thread = threading.Thread(
        target=lambda: tier_result.update(run_tier(root, started + 0.6 * seconds,
                                                   tier_select)))
    tier_thread.start()
    time.sleep(1.0)  # the tier takes the lock first
  queue, running, done = list(jobs), {}, []
  while queue or running:
    for job, proc in list(running.items()):
      if proc.poll() is not None:
        running.pop(job)
        done.append(job)
        log(f"{job.name}: finished ({time.time() - started:.0f} s)")
    if time.time() > deadline:
      for job, proc in running.items():
        proc.kill()
        log(f"{job.name}: cut by the deadline")
      break
    if not running and queue:
      for job in _next_wave(queue, max_jobs):
        (root / "jobs" / f"{job.slug}.compiling").touch()
        running[job] = _start(job, root, reduced, steps, pairs)
        log(f"{job.name}: started")
    time.sleep(0.5)
  if tier_thread is not None:
    tier_thread.join(max(deadline - time.time(), 0) + 5)
  session["tier"] = tier_result or None
  session["jobs"] = []
  for job in jobs:
    path = root / "jobs" / f"{job.slug}.json"
    if path.is_file():
      session["jobs"].append(json.loads(path.read_text()))
    else:
      why = "not started before the deadline" if job in queue else "cut by the deadline"
      session["jobs"].append({"job": dataclasses.asdict(job), "error": why})
  session["elapsed_seconds"] = time.time() - started
  (root / "gpu-session.json").write_text(json.dumps(session, indent=1, default=str))
  (root / "gpu-session.md").write_text(session_page.render(session))
  with tarfile.open(root / "traces.tar.gz", "w:gz") as tar:
    for sub in ("traces", "jobs"):
      if (root / sub).is_dir():
        tar.add(root / sub, arcname=sub)
  return session


if __name__ == "__main__":
  sys.exit(_job_main(sys.argv[1]))
