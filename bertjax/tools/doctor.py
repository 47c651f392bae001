"""`bertjax doctor`: is this machine (or slice) healthy, and will a run be as fast as projected?

One process per host runs every check, as `bertjax train` would run (same mesh, same
`jax.distributed` set-up); each check is one line, pass / warn / fail / skip with its figure,
and the whole report goes to JSON. The device's own checks (attention, products, collectives)
are in device_checks.py; the run's (environment, speed, checkpoint, loader) here.

The guide: docs/doctor.md, 'The checks'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform as platform_lib
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from bertjax import config as config_lib
from bertjax import data as data_lib
from bertjax import paths
from bertjax.data.prepare import ensure_dataset
from bertjax.parallel import distributed, sharding
from bertjax.tools import bench
from bertjax.tools.device_checks import (
  STATUSES,
  Check,
  attention_checks,
  collective_checks,
  product_check,
)
from bertjax.training import defaults
from bertjax.training import flops as flops_lib

CHECKS = ("environment", "attention", "products", "collectives", "speed", "checkpoint",
          "loader")


# --- environment -------------------------------------------------------------------------


def environment(config: ml_collections.ConfigDict, trainer: Any | None,
                choices: list[Any] = ()) -> Check:
  device = jax.local_devices()[0]
  versions = {"python": platform_lib.python_version(), "jax": jax.__version__,
              "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
              "flax": flax.__version__, "optax": optax.__version__,
              "orbax-checkpoint": getattr(ocp, "__version__", "")}
  try:
    import libtpu  # noqa: PLC0415 - optional (the tpu extra)
    versions["libtpu"] = getattr(libtpu, "__version__", "installed")
  except ImportError:
    pass
  runtime = getattr(device.client, "platform_version", "")
  memory = (device.memory_stats() or {}).get("bytes_limit")
  values = {"versions": versions, "platform": device.platform, "runtime": runtime,
            "device_kind": device.device_kind, "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "processes": jax.process_count(),
            "process_index": jax.process_index(), "device_memory_bytes": memory}
  figure = (f"{jax.device_count()} x {device.device_kind} ({device.platform}) in "
            f"{jax.process_count()} process(es)"
            + (f", {memory / 2**30:.1f} GiB each" if memory else "")
            + f"; jax {jax.__version__}")
  detail = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "jax")
  if runtime:
    detail += f"; runtime {runtime.splitlines()[0][:80]}"
  if choices:  # what the config's "auto" settings become here (bertjax.training.defaults)
    detail += "; " + "; ".join(c.line() for c in choices)
    values["auto"] = {c.key: c.value for c in choices}
  if trainer is not None:
    mesh = trainer.mesh
    layout = distributed.row_layout(trainer.data_sharding(), int(config.batch_size))
    values["mesh"] = dict(mesh.shape)
    values["row_layout"] = layout.summary()
    figure += f"; mesh {dict(mesh.shape)}"
    problems = layout.problems()
    return Check("environment", "fail" if problems else "pass", figure,
                 detail + f"; {layout.summary()}", values)
  return Check("environment", "pass", figure, detail, values)

# --- speed, checkpoint, loader -------------------------------------------------------------


def _out_of_memory(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def build_step(config: ml_collections.ConfigDict
               ) -> tuple[bench.OurStep, ml_collections.ConfigDict, str]:
  """The config's train step on a synthetic batch, or its runlocal shape when the full one
  does not fit in memory (the note says so)."""
  try:
    return bench.OurStep(config, bench.synthetic_batch(config)), config, ""
  except Exception as e:
    if not _out_of_memory(e):
      raise
    small = config_lib.runlocal(config)
    note = (f"the full shape did not fit ({str(e).splitlines()[0][:120]}): measured its "
            "runlocal shape")
    return bench.OurStep(small, bench.synthetic_batch(small)), small, note


def speed_check(step: bench.OurStep, config: ml_collections.ConfigDict, note: str,
                steps: int = 5, projected_mfu: float = 0.5) -> Check:
  step.run(1)  # the first call after compiling pays for transfers and autotuning
  times = step.run(steps)
  seconds = float(np.median(times))
  loss = float(jax.device_get(step.metrics["loss"]))
  model = config_lib.model_config(config)
  flops = flops_lib.run_flops_per_step(model, config)
  nominal = flops_lib.nominal_peak_flops()
  measured = (flops_lib.measure_matmul_peak(flops_lib.matmul_peak_size(1024),
                                            jnp.dtype(model.dtype))
              * flops_lib.measured_peak_devices() * jax.process_count())
  values = {"step_seconds": seconds, "step_seconds_all": times, "model_flops": flops,
            "measured_peak_flops": measured, "data_sheet_peak_flops": nominal,
            "mfu_vs_measured_peak": flops / seconds / measured,
            "tokens_per_second": int(config.batch_size) * int(config.seq_length) / seconds,
            "dtype": model.dtype, "shape": f"{config.batch_size}x{config.seq_length}"}
  figure = (f"{seconds * 1e3:,.1f} ms/step ({values['tokens_per_second']:,.0f} tokens/s), "
            f"MFU {values['mfu_vs_measured_peak']:.1%} of the measured {model.dtype} matmul peak")
  values["loss"] = loss
  status = "pass"
  if not math.isfinite(loss):
    status = "fail"
    figure += f"; the loss is {loss}"
  elif values["mfu_vs_measured_peak"] > 1.05:
    status = "fail"
    figure += ": faster than the matmul peak, so the timing or the FLOP count is wrong"
  if nominal:
    mfu = flops / seconds / nominal
    projected = flops / (nominal * projected_mfu)
    values.update(mfu_vs_data_sheet=mfu, projected_step_seconds=projected,
                  projected_mfu=projected_mfu)
    figure += (f", {mfu:.1%} of the data sheet; `bertjax compile` at --mfu {projected_mfu} "
               f"projects {projected * 1e3:,.3g} ms: calibrate with --mfu {mfu:.2g}")
    if status == "pass" and mfu < projected_mfu / 2:
      status = "warn"
  detail = (f"{model.family} {model.num_layers}x{model.hidden_size}, batch "
            f"{values['shape']}, {model.dtype}, attention {step.trainer.model_config.attention}"
            f", median of {steps} steps")
  return Check("speed", status, figure, detail + (f"; {note}" if note else ""), values)


def _leaves_equal(a: Any, b: Any) -> int:
  """Leaves of two identically sharded trees that differ on some addressable shard."""
  different = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    for sx, sy in zip(x.addressable_shards, y.addressable_shards):
      if not np.array_equal(np.asarray(sx.data), np.asarray(sy.data)):
        different += 1
        break
  return different


def restore(checkpointer: Any, directory: Any, target: Any) -> Any:
  """The state read back into the shardings of `target` (abstract)."""
  return checkpointer.restore(directory, target)


def checkpoint_check(state: Any, workdir: str) -> Check:
  tree = {"params": state.params, "opt_state": state.opt_state}
  size = sum(x.nbytes for x in jax.tree.leaves(tree))
  root = paths.path(workdir) / "doctor"
  directory = root / f"checkpoint-{_shared_token()}"
  checkpointer = ocp.StandardCheckpointer()
  try:
    start = time.perf_counter()
    checkpointer.save(directory, tree)
    checkpointer.wait_until_finished()
    write = time.perf_counter() - start
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          tree)
    start = time.perf_counter()
    restored = restore(checkpointer, directory, target)
    jax.block_until_ready(restored)
    read = time.perf_counter() - start
    different = _leaves_equal(tree, restored)
  finally:
    checkpointer.close()
    distributed.barrier("doctor checkpoint read")
    if jax.process_index() == 0 and directory.exists():
      directory.rmtree()
  values = {"bytes": size, "write_seconds": write, "read_seconds": read,
            "write_bytes_per_second": size / write, "read_bytes_per_second": size / read,
            "different_leaves": different, "directory": str(root)}
  figure = (f"{size / 2**20:,.1f} MiB written at {size / write / 2**20:,.1f} MiB/s, read at "
            f"{size / read / 2**20:,.1f} MiB/s")
  if different:
    return Check("checkpoint", "fail", f"{different} leaves read back differ; " + figure,
                 f"Orbax to {root}", values)
  return Check("checkpoint", "pass", figure + "; read back equal", f"Orbax to {root}, params "
               "and optimizer state", values)


def _shared_token() -> str:
  """A name every process agrees on (process 0's, broadcast)."""
  token = np.frombuffer(uuid.uuid4().bytes[:8], np.uint32).copy()
  token = multihost_utils.broadcast_one_to_all(token)
  return "".join(f"{int(x):08x}" for x in np.asarray(token))


def loader_check(config: ml_collections.ConfigDict, workdir: str, step_seconds: float,
                 trainer: Any, batches: int = 32) -> Check:
  dataset = ""
  if config.data.source == "corpus":
    try:
      dataset = ensure_dataset(config, workdir, build=False)
    except ValueError:
      return Check("loader", "skip", "no built dataset to read",
                   f"data.dataset is empty and {workdir}/data/dataset was not built; set "
                   "--config.data.dataset or --workdir to a run's (the doctor builds nothing)")
  rows = distributed.local_rows(trainer.data_sharding(), int(config.batch_size))
  # What the compiled step takes: this process's rows of the config's batch.
  expected = {k: (len(rows),) + v.shape[1:] for k, v in bench.synthetic_batch(config).items()}
  source = data_lib.make_batches(config, "train", rows, dataset)
  wrong: list[str] = []
  try:
    start = time.perf_counter()
    loaded = [next(source)]
    startup = time.perf_counter() - start
    # Past the prefetch buffer (which the first batch's wait filled): `batches`, and at
    # least two seconds' worth.
    start = time.perf_counter()
    count = 0
    while count < batches or time.perf_counter() - start < 2.0:
      batch = next(source)
      if len(loaded) < 4:
        loaded.append(batch)
      count += 1
    seconds = (time.perf_counter() - start) / count
  finally:
    if hasattr(source, "close"):
      source.close()
  for batch in loaded:
    for key, shape in expected.items():
      got = tuple(batch[key].shape) if key in batch else None
      if got != shape and not wrong:
        wrong.append(f"batch {key} is {'missing' if got is None else got}, the step takes "
                     f"{shape}")
  ratio = step_seconds / seconds
  values = {"batch_seconds": seconds, "startup_seconds": startup, "step_seconds": step_seconds,
            "batches_per_step_time": ratio, "rows_per_process": len(rows),
            "source": config.data.source}
  figure = (f"{1 / seconds:,.1f} batches/s ({len(rows)} rows each) against the step's "
            f"{1 / step_seconds:,.1f}/s: {ratio:,.1f}x what the step consumes; first batch "
            f"{startup:.2f} s")
  status = "pass" if ratio >= 1.0 else "warn"
  if status == "warn":
    figure += ": input-bound"
  if wrong:
    status, figure = "fail", f"{wrong[0]}; " + figure
  values["batches_timed"] = count
  return Check("loader", status, figure, f"{config.data.source} data, {count} batches after "
               f"the first, {int(config.data.num_workers)} worker(s)", values)


# --- the whole report ----------------------------------------------------------------------


def run_doctor(config: ml_collections.ConfigDict, workdir: str, *, checks: tuple[str, ...] =
               CHECKS, steps: int = 5, projected_mfu: float = 0.5,
               report: Callable[[Check], None] = lambda c: None) -> list[Check]:
  """Every requested check in order, each reported as it completes."""
  unknown = set(checks) - set(CHECKS)
  if unknown:
    raise ValueError(f"unknown doctor checks {sorted(unknown)}; checks: {', '.join(CHECKS)}")
  results: list[Check] = []

  def add(found: list[Check] | Check) -> None:
    for check in found if isinstance(found, list) else [found]:
      results.append(check)
      report(check)

  # The config's "auto" settings as a run here would resolve them (the environment check
  # says what they became).
  config, choices = defaults.resolve(config, jax.default_backend(),
                                     agree=defaults.all_processes_agree)
  step = note = None
  measured = config
  need_step = {"environment", "speed", "checkpoint", "loader"} & set(checks)
  if need_step:
    try:
      step, measured, note = build_step(config)
    except Exception as e:  # noqa: BLE001 - a step that does not build is the finding
      add(Check("speed", "fail", f"the train step did not build: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}"))
  if "environment" in checks:
    add(environment(measured, step.trainer if step else None, choices))
  if "attention" in checks:
    add(attention_checks(config))
  if "products" in checks:
    add(product_check())
  if "collectives" in checks:
    add(collective_checks(sharding.mesh_from_config(config)))
  speed = None
  if step is not None and {"speed", "loader"} & set(checks):
    speed = speed_check(step, measured, note, steps=steps, projected_mfu=projected_mfu)
    if "speed" in checks:
      add(speed)
  if step is not None and "checkpoint" in checks:
    add(checkpoint_check(step.state, workdir))
  if speed is not None and "loader" in checks:
    add(loader_check(measured, workdir, speed.values["step_seconds"], step.trainer))
  return results


def summary(checks: list[Check]) -> str:
  counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
  return ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def write_report(checks: list[Check], path: str, config_name: str) -> str:
  """The JSON report; processes other than 0 write PATH with .host<N> before the suffix."""
  target = paths.path(path)
  if jax.process_index() != 0:
    target = target.parent / f"{target.stem}.host{jax.process_index()}{target.suffix}"
  target.parent.mkdir(parents=True, exist_ok=True)
  record = {"config": config_name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "process_index": jax.process_index(), "process_count": jax.process_count(),
            "host": platform_lib.node(), "argv": sys.argv, "summary": summary(checks),
            "failed": [c.name for c in checks if c.status == "fail"],
            "checks": [dataclasses.asdict(c) for c in checks]}
  target.write_text(json.dumps(record, indent=1, default=float))
  return str(target)


def default_workdir() -> str:
  return os.path.join(os.environ.get("BERTJAX_CACHE", os.path.expanduser("~/.cache/bertjax")),
                      "doctor")
