"""`bertjax bench` (`run_benchmark`): how much of the machine one training step turns into model
FLOPs; guide: docs/performance.md.

Our step is the `Trainer`'s of `bertjax train` on a synthetic batch of the config's shape, timed
against the device's matmul peak measured here; its model FLOPs (`bertjax.training.flops`) stand
next to the FLOPs XLA compiled (`bertjax.tools.hlo`) and XLA's `cost_analysis`. `compare="hf"`
runs the same step in `transformers` (bench_hf.py) alternately with ours, block by block, since
on a drifting machine only ratios taken side by side mean anything; `best=True` runs both in
float32 and in bfloat16. A benchmark, never a test: the tests run it once at toy size for its
plumbing only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax.config import model_config
from bertjax.data import decoder_length, schema
from bertjax.models.params import count_params
from bertjax.parallel import sharding
from bertjax.tools import bench_hf, hlo, profiles, timing
from bertjax.training import defaults
from bertjax.training import flops as flops_lib
from bertjax.training.trainer import Trainer


def synthetic_batch(config: ml_collections.ConfigDict, seed: int = 0) -> dict[str, np.ndarray]:
  """A global batch of the config's shape with what real data has (bertjax.data.schema)."""
  return schema.example_batch(config.objective, int(config.batch_size), int(config.seq_length),
                              int(config.max_predictions),
                              vocab_size=int(config.model.vocab_size),
                              mask_prob=float(config.data.mask_prob),
                              packed=config.data.bert_instances == "packed", seed=seed,
                              decoder_length=decoder_length(config))


def predictions_per_seq(config: ml_collections.ConfigDict) -> int | None:
  """Positions per row whose vocabulary projection the step computes (None: all of them)."""
  return None if schema.objective(config.objective).causal else int(config.max_predictions)


class OurStep:
  """Our train step on the config's mesh: compiled once, then timed `steps` at a time."""

  def __init__(self, config: ml_collections.ConfigDict, batch: dict[str, np.ndarray]) -> None:
    self.mesh = sharding.mesh_from_config(config)
    self.trainer = Trainer(config, self.mesh)
    self.state = self.trainer.init_state(int(config.seed))
    step = self.trainer.compile_step(batch)
    self.batch = {k: jax.device_put(v, self.trainer.batch_shardings[k]) for k, v in batch.items()}
    with jax.set_mesh(self.mesh):
      start = time.perf_counter()
      lowered = step.lower(self.state, self.batch)
      self.lower_seconds = time.perf_counter() - start
      start = time.perf_counter()
      self.compiled = lowered.compile()
      self.compile_seconds = time.perf_counter() - start
    self.params = count_params(self.state.params)

  def run(self, steps: int) -> list[float]:
    """`steps` steps back to back, one wait at the end (`timing.block_times`)."""
    def one():
      self.state, self.metrics = self.compiled(self.state, self.batch)
      return self.metrics["loss"]
    return timing.block_times(one, jax.block_until_ready, steps)

  def compiled_flops(self) -> tuple[float, float | None]:
    """(dot FLOPs of the optimized program through loop trips, all devices; cost_analysis)."""
    devices = self.mesh.size
    stats = hlo.analyze_hlo(self.compiled.as_text())
    cost = self.compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float(cost["flops"]) * devices if cost and "flops" in cost else None
    return stats.matmul_flops * devices, xla

  def memory(self) -> dict[str, float | None]:
    mem = self.compiled.memory_analysis()
    per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                  - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    stats = self.mesh.devices.flat[0].memory_stats() or {}
    return {"compiled_peak_bytes_per_device": float(per_device),
            "temp_bytes_per_device": float(mem.temp_size_in_bytes),
            "device_peak_bytes_in_use": (float(stats["peak_bytes_in_use"])
                                         if "peak_bytes_in_use" in stats else None)}


def machine() -> dict[str, Any]:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  device = jax.local_devices()[0]
  return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "device_kind": device.device_kind,
          "platform": device.platform, "devices": jax.device_count(),
          "python": platform.python_version(), "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          # Both steps run in this process under them (bertjax/__main__.py sets them).
          "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


PRECISIONS = ("float32", "bfloat16")


def _with_dtype(config: ml_collections.ConfigDict, dtype: str) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.dtype = dtype
  return config


def _block_times(run: Callable[[int], list[float]], steps: int) -> list[float]:
  run(1)  # one untimed step: the previous block's runner may have left caches cold
  return run(steps)


def run_benchmark(config: ml_collections.ConfigDict, *, steps: int = 5, pairs: int = 3,
                  compare: str | None = None, best: bool = False, peak_size: int | None = None,
                  profile_dir: str | None = None, reference_compile: bool = False,
                  profile_reference: bool = False,
                  exclusive: Callable[[], contextlib.AbstractContextManager] | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
  """Benchmarks `config`'s train step (and the reference, alternately); returns the record.

  `best`: both ours and the reference run in each precision (`PRECISIONS`: float32, and
  bfloat16 — ours with model.dtype=bfloat16, the reference under `torch.autocast`), and the
  fastest of ours is compared with the fastest of the reference, pair by pair.
  `profile_dir`: also profile our step (the config's dtype) there after the timed steps.
  `reference_compile`: the reference through `torch.compile`. `peak_size`: the square matmul
  the peaks are timed at (default `flops.matmul_peak_size`: 2048 on a CPU, 8192 elsewhere).
  `profile_reference`: also profile the reference's kernels (`profiles.torch_profile`).
  `exclusive`: a context manager held from the first peak reading to the last profiled step
  (the compiles and the reference's warm-up, `torch.compile` included, run before it), so
  that processes sharing one device time their steps one at a time (bertjax.tools.gpu_session)."""
  config, choices = defaults.resolve(config, jax.default_backend())
  for choice in choices:
    log(choice.line())
  model = model_config(config)
  b, seq = int(config.batch_size), int(config.seq_length)
  dtypes = list(PRECISIONS) if best else [model.dtype]
  if model.dtype not in dtypes:
    dtypes.insert(0, model.dtype)
  record: dict[str, Any] = {
      "config": {"model": f"{model.family} {model.num_layers}x{model.hidden_size}, "
                          f"{model.num_heads} heads, vocab {model.vocab_size}",
                 "batch_size": b, "seq_length": seq, "dtype": model.dtype,
                 "objective": config.objective, "mesh": dict(config.mesh),
                 "grad_accum_steps": int(config.grad_accum_steps),
                 "predictions_per_seq": predictions_per_seq(config),
                 "dropout": [model.hidden_dropout, model.attention_dropout],
                 "remat": model.remat_policy, "scan_layers": model.scan_layers,
                 "auto": [c.line() for c in choices]},
      "machine": machine(), "steps_per_block": steps, "pairs": pairs, "best": best}

  if peak_size is None:
    peak_size = flops_lib.matmul_peak_size(2048)

  def xla_peaks() -> dict[str, float]:
    return {d: flops_lib.measure_matmul_peak(peak_size, jnp.dtype(d))
            * flops_lib.measured_peak_devices() for d in dtypes}

  record["peak"] = {"nominal_flops": flops_lib.nominal_peak_flops()}
  batch = synthetic_batch(config)
  ours: dict[str, OurStep] = {}
  for dtype in dtypes:
    log(f"compiling our train step ({dtype})")
    ours[dtype] = OurStep(_with_dtype(config, dtype), batch)
  references: dict[str, Any] = {}
  if compare == "hf":
    for dtype in dtypes:
      log(f"building the Hugging Face reference ({bench_hf.PRECISION_NAMES[dtype]})")
      references[dtype] = bench_hf.ReferenceStep(config, batch, precision=dtype,
                                                 compile=reference_compile)
      references[dtype].run(1)  # torch.compile compiles on the first call
  elif compare is not None:
    raise ValueError(f"compare must be 'hf' or None, got {compare!r}")
  with (exclusive or contextlib.nullcontext)():
    times, traced = _timed_section(record, ours, references, dtypes, model.dtype, steps,
                                   pairs, peak_size, xla_peaks, profile_dir,
                                   profile_reference, log)
  if profile_dir:
    try:
      record["profile"] = profiles.summarize_step(ours[model.dtype], traced)
    except Exception as e:  # noqa: BLE001 - the timings stand; the trace is still on disk
      record["profile"] = {"error": f"{type(e).__name__}: {e}", "trace": traced}
  return _finish(record, times, config, model, ours, references, best)


# Per dtype, every timed step of ours and of the reference; each pair's block medians.
_Times = tuple[dict[str, list[float]], dict[str, list[float]],
               list[tuple[dict[str, float], dict[str, float]]]]


def _timed_section(record: dict[str, Any], ours: dict[str, OurStep], references: dict[str, Any],
                   dtypes: list[str], dtype: str, steps: int, pairs: int, peak_size: int,
                   xla_peaks: Callable[[], dict[str, float]], profile_dir: str | None,
                   profile_reference: bool, log: Callable[[str], None]
                   ) -> tuple[_Times, str | None]:
  """The part of `run_benchmark` that reads the device's speed: the peaks before and after
  (into `record`), the alternating blocks, the profiles. Returns the blocks' times and our
  trace's path."""
  log(f"measuring the matmul peak ({peak_size}², {', '.join(dtypes)}, XLA, fastest form)")
  first_peaks = xla_peaks()
  first_torch_peaks = {d: bench_hf.measure_matmul_peak(peak_size, d) for d in references}
  for runner in [*ours.values(), *references.values()]:
    runner.run(2)  # warm: first executions allocate
  ours_times: dict[str, list[float]] = {d: [] for d in ours}
  hf_times: dict[str, list[float]] = {d: [] for d in references}
  pair_medians: list[tuple[dict[str, float], dict[str, float]]] = []
  for i in range(pairs):
    ours_block = {d: _block_times(step.run, steps) for d, step in ours.items()}
    hf_block = {d: _block_times(ref.run, steps) for d, ref in references.items()}
    for d in ours_block:
      ours_times[d] += ours_block[d]
    for d in hf_block:
      hf_times[d] += hf_block[d]
    medians = ({d: statistics.median(t) for d, t in ours_block.items()},
               {d: statistics.median(t) for d, t in hf_block.items()})
    pair_medians.append(medians)
    log(f"pair {i + 1}/{pairs}: " + ", ".join(
        [f"ours {d} {t * 1e3:.1f}" for d, t in medians[0].items()]
        + [f"hf {bench_hf.PRECISION_NAMES[d]} {t * 1e3:.1f}" for d, t in medians[1].items()])
        + " ms/step")

  # The machine drifts (a shared CPU's peak moved 1.5x within an hour): read the peaks again
  # after the timed steps and take the higher reading, so that MFU is never flattered by a
  # slow phase at the start.
  last_peaks = xla_peaks()
  record["peak"]["xla_matmul_flops_by_dtype"] = {
      d: max(first_peaks[d], last_peaks[d]) for d in dtypes}
  record["peak"]["xla_matmul_flops_readings_by_dtype"] = {
      d: [first_peaks[d], last_peaks[d]] for d in dtypes}
  record["peak"]["xla_matmul_flops"] = record["peak"]["xla_matmul_flops_by_dtype"][dtype]
  if references:
    torch_last = {d: bench_hf.measure_matmul_peak(peak_size, d) for d in references}
    record["peak"]["torch_matmul_flops_by_dtype"] = {
        d: max(first_torch_peaks[d], torch_last[d]) for d in references}
    record["peak"]["torch_matmul_flops_readings_by_dtype"] = {
        d: [first_torch_peaks[d], torch_last[d]] for d in references}
    record["peak"]["torch_matmul_flops"] = record["peak"]["torch_matmul_flops_by_dtype"][dtype]
  traced = None
  if profile_dir:
    log(f"profiling 2 steps into {profile_dir}")
    traced = profiles.trace_step(ours[dtype], profile_dir, steps=2)
  if profile_reference and dtype in references:
    log("profiling 2 steps of the reference")
    try:
      record["hf_profile"] = profiles.torch_profile(references[dtype]._step, steps=2)
    except Exception as e:  # noqa: BLE001 - the timings stand without the reference's profile
      record["hf_profile"] = {"error": f"{type(e).__name__}: {e}"}
  return (ours_times, hf_times, pair_medians), traced


def _finish(record: dict[str, Any], times: _Times, config: ml_collections.ConfigDict,
            model: Any, ours: dict[str, OurStep], references: dict[str, Any], best: bool
            ) -> dict[str, Any]:
  """The record's runs, ratios and memory from the timed blocks of `_timed_section`."""
  ours_times, hf_times, pair_medians = times
  b, seq = int(config.batch_size), int(config.seq_length)
  model_flops = flops_lib.run_flops_per_step(model, config)
  nominal = record["peak"]["nominal_flops"]
  runs: dict[str, dict[str, Any]] = {}
  for d, step in ours.items():
    seconds = statistics.median(ours_times[d])
    achieved = model_flops / seconds
    compiled, xla_cost = step.compiled_flops()
    runs[d] = {
        "params": step.params, "lower_seconds": step.lower_seconds,
        "compile_seconds": step.compile_seconds, "model_flops": model_flops,
        "compiled_dot_flops": compiled, "xla_cost_analysis_flops": xla_cost, **step.memory(),
        "step_seconds_median": seconds, "step_seconds": ours_times[d],
        "tokens_per_second": b * seq / seconds, "sequences_per_second": b / seconds,
        "model_flops_per_second": achieved,
        # MFU against the peak of the dtype the matmuls run in.
        "mfu_vs_xla_matmul_peak": achieved / record["peak"]["xla_matmul_flops_by_dtype"][d],
        "mfu_vs_nominal_peak": achieved / nominal if nominal else None}
    if references:
      runs[d]["mfu_vs_torch_matmul_peak"] = (
          achieved / record["peak"]["torch_matmul_flops_by_dtype"][d])
  record["ours"] = runs[model.dtype]
  record["ours"]["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
  if best:
    record["ours_by_dtype"] = runs
  if references:
    hf_runs = {}
    for d, ref in references.items():
      seconds = statistics.median(hf_times[d])
      hf_flops = ref.model_flops(model, b, seq, decoder_length(config))
      hf_runs[d] = {
          "model": ref.describe(), "params": ref.params, "torch": ref.torch_version,
          "threads": ref.threads, "precision": bench_hf.PRECISION_NAMES[d],
          "model_flops": hf_flops, "step_seconds_median": seconds,
          "step_seconds": hf_times[d], "tokens_per_second": b * seq / seconds,
          "sequences_per_second": b / seconds,
          "mfu_vs_torch_matmul_peak": (hf_flops / seconds
                                       / record["peak"]["torch_matmul_flops_by_dtype"][d]),
          "peak_memory_bytes": ref.peak_memory()}
    record["hf"] = hf_runs[model.dtype]
    if best:
      record["hf_by_precision"] = hf_runs
    # Our throughput over the reference's, each pair: same precision...
    record["pairs_ratio"] = [h[model.dtype] / o[model.dtype] for o, h in pair_medians]
    record["median_ratio"] = statistics.median(record["pairs_ratio"])
    if best:
      # ...and the fastest of ours over the fastest of the reference.
      record["best_pairs_ratio"] = [min(h.values()) / min(o.values()) for o, h in pair_medians]
      record["best_median_ratio"] = statistics.median(record["best_pairs_ratio"])
      record["fastest"] = {
          "ours": min(runs, key=lambda d: runs[d]["step_seconds_median"]),
          "hf": min(hf_runs, key=lambda d: hf_runs[d]["step_seconds_median"])}
  if best:
    record["ours_bf16_over_fp32_pairs"] = [o["float32"] / o["bfloat16"] for o, _ in pair_medians]
    record["ours_bf16_over_fp32"] = statistics.median(record["ours_bf16_over_fp32_pairs"])
  return record


def _fmt_flops(x: float | None) -> str:
  return "n/a" if x is None else f"{x / 1e9:,.1f} GFLOP"


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _readings(values: list[float] | None) -> str:
  if not values:
    return " (measured)"
  return " (higher of " + " and ".join(f"{v / 1e9:,.1f}" for v in values) + ", before and after)"


def _peaks_line(peak: dict[str, Any]) -> str:
  parts = []
  for name, key in (("XLA", "xla_matmul_flops"), ("torch", "torch_matmul_flops")):
    for dtype, value in peak.get(f"{key}_by_dtype", {}).items():
      readings = peak.get(f"{key}_readings_by_dtype", {}).get(dtype)
      parts.append(f"{name} {dtype} {value / 1e9:,.1f} GFLOP/s{_readings(readings)}")
  nominal = peak.get("nominal_flops")
  parts.append(f"nominal {nominal / 1e12:,.1f} TFLOP/s" if nominal
               else "no nominal peak for this device kind")
  return "; ".join(parts)


def format_record(r: dict[str, Any]) -> str:
  c, m, o, peak = r["config"], r["machine"], r["ours"], r["peak"]
  ours_runs = r.get("ours_by_dtype", {c["dtype"]: o})
  hf_runs = r.get("hf_by_precision", {c["dtype"]: r["hf"]} if "hf" in r else {})
  lines = [
      f"model          {c['model']}; batch {c['batch_size']} x {c['seq_length']}, {c['dtype']}, "
      f"mesh {c['mesh']}, dropout {c['dropout'][0]:g}/{c['dropout'][1]:g}, "
      f"remat {c['remat']}, scan_layers={c['scan_layers']}",
      f"machine        {m['cpu']}, {m['cores']} cores; {m['devices']} x {m['device_kind']}; "
      f"jax {m['jax']}; GLIBC_TUNABLES={m.get('glibc_tunables') or '(none)'}",
      f"peak           {_peaks_line(peak)} (matmuls in each dtype's fastest form)"]
  for dtype, run in ours_runs.items():
    lines += [
        f"compile        {dtype}: {run['lower_seconds']:.1f} s trace+lower, "
        f"{run['compile_seconds']:.1f} s XLA compile",
        f"FLOPs/step     {dtype}: model {_fmt_flops(run['model_flops'])} (6·N·tokens + "
        f"attention + computed vocab projection); compiled dots "
        f"{_fmt_flops(run['compiled_dot_flops'])} "
        f"({run['compiled_dot_flops'] / run['model_flops']:.3f}x); XLA cost_analysis "
        f"{_fmt_flops(run['xla_cost_analysis_flops'])} (loop bodies counted once)",
        f"memory         {dtype}: {run['compiled_peak_bytes_per_device'] / 2**20:,.0f} MiB per "
        "device (compiled: arguments + outputs - donated + temporaries)"]
  lines += [f"process        max RSS {o['max_rss_bytes'] / 2**20:,.0f} MiB", "",
            f"{'':26s}{'ms/step':>10s}{'tokens/s':>11s}{'seq/s':>9s}{'MFU (own peak)':>16s}"
            f"{'MFU (torch peak)':>18s}"]
  for dtype, run in ours_runs.items():
    lines.append(
        f"{'bertjax ' + dtype:26s}{run['step_seconds_median'] * 1e3:10.1f}"
        f"{run['tokens_per_second']:11.1f}{run['sequences_per_second']:9.2f}"
        f"{_pct(run['mfu_vs_xla_matmul_peak']):>16s}"
        f"{_pct(run.get('mfu_vs_torch_matmul_peak')):>18s}")
  for h in hf_runs.values():
    lines.append(
        f"{'hf torch ' + h['precision']:26s}{h['step_seconds_median'] * 1e3:10.1f}"
        f"{h['tokens_per_second']:11.1f}{h['sequences_per_second']:9.2f}{'':>16s}"
        f"{_pct(h['mfu_vs_torch_matmul_peak']):>18s}")
  if hf_runs:
    h = r["hf"]
    lines.append("")
    lines.append(f"reference      {h['model']}, torch {h['torch']}, {h['threads']} threads; "
                 f"its model FLOPs {_fmt_flops(h['model_flops'])}/step")
    lines.append(f"ratio          ours/hf throughput per pair, both {c['dtype']}: "
                 + ", ".join(f"{x:.3f}" for x in r["pairs_ratio"])
                 + f"; median {r['median_ratio']:.3f}")
    if "best_median_ratio" in r:
      lines.append(f"best vs best   fastest of ours ({r['fastest']['ours']}) over fastest of the "
                   f"reference ({hf_runs[r['fastest']['hf']]['precision']}) per pair: "
                   + ", ".join(f"{x:.3f}" for x in r["best_pairs_ratio"])
                   + f"; median {r['best_median_ratio']:.3f}")
  if "ours_bf16_over_fp32" in r:
    lines.append("bf16 vs fp32   our bfloat16 step over our float32 step per pair: "
                 + ", ".join(f"{x:.3f}" for x in r["ours_bf16_over_fp32_pairs"])
                 + f"; median {r['ours_bf16_over_fp32']:.3f}")
  if o.get("mfu_vs_nominal_peak") is not None:
    lines.append(f"MFU nominal    {_pct(o['mfu_vs_nominal_peak'])} of the data-sheet peak")
  if "profile" in r and "error" in r["profile"]:
    lines += ["", f"profile        not read: {r['profile']['error']}"]
  elif "profile" in r:
    p = r["profile"]
    rate = p["matmul_flops_per_second"]
    lines += ["", f"profile        {p['op_seconds_per_step'] * 1e3:,.1f} ms/step in ops "
              f"(trace: {p['trace']})" + (f"; matmuls ran at {rate / 1e9:,.1f} GFLOP/s per "
                                          "device" if rate else "")]
    lines += [f"  {k:38s}{v['seconds_per_step'] * 1e3:10.1f} ms/step {_pct(v['share']):>7s}"
              for k, v in p["by_purpose"].items()]
  return "\n".join(lines)


def write_record(record: dict[str, Any], path: str) -> None:
  with open(path, "w") as f:
    json.dump(record, f, indent=2, default=lambda x: None if isinstance(x, float) and
              math.isnan(x) else str(x))
    f.write("\n")
