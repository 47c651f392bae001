"""`bertjax bench`: how much of the machine one training step turns into model FLOPs.

For one config, in one process:
- the device's matmul peak, measured here (`flops.measure_matmul_peak`), next to the nominal
  data-sheet peak where the device kind has one;
- our jitted, sharded, donated train step (the `Trainer` that `bertjax train` uses, on a
  synthetic batch of the config's shape): compile time, then the median of timed steps;
- tokens/s, sequences/s, model FLOPs per step (`bertjax.flops`, formula in its docstring) next
  to the FLOPs XLA compiled (dots counted through loop trips, `bertjax.hlo`) and XLA's own
  `cost_analysis`; MFU against each peak; memory.
- `compare="hf"`: the same shape, batch, optimizer and dropout in Hugging Face `transformers`
  (PyTorch; bertjax/bench_hf.py), run alternately with ours, block by block; the ratio of
  throughputs of each pair and their median. Machines drift (the project's CPU by up to 1.5x
  over minutes): only ratios taken side by side mean anything.

A benchmark, never a test: the tests run it once at toy size for its plumbing only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import resource
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax import flops as flops_lib
from bertjax import hlo, sharding
from bertjax.models import count_params


def synthetic_batch(config: ml_collections.ConfigDict, seed: int = 0) -> dict[str, np.ndarray]:
  """A global batch of the config's shape with what real data has: BERT rows of two segments,
  round(mask_prob·L) masked positions (capped at max_predictions, padded slots weighing 0),
  random sentence labels; GPT rows of one document with a loss on every token."""
  rng = np.random.RandomState(seed)
  b, l = int(config.batch_size), int(config.seq_length)
  vocab = int(config.model.vocab_size)
  ids = rng.randint(5, vocab, (b, l)).astype(np.int32)
  if config.objective == "causal_lm":
    return {"input_ids": ids, "target_ids": np.roll(ids, -1, axis=1),
            "loss_mask": np.ones((b, l), np.int32), "segment_ids": np.ones((b, l), np.int32),
            "positions": np.tile(np.arange(l, dtype=np.int32), (b, 1))}
  p = int(config.max_predictions)
  masked = min(p, max(1, round(float(config.data.get("mask_prob", 0.15)) * l)))
  positions = np.zeros((b, p), np.int32)
  weights = np.zeros((b, p), np.float32)
  for row in range(b):
    positions[row, :masked] = np.sort(rng.choice(np.arange(1, l - 1), masked, replace=False))
    weights[row, :masked] = 1.0
  segment_ids = np.zeros((b, l), np.int32)
  segment_ids[:, l // 2:] = 1
  return {"input_ids": ids, "input_mask": np.ones((b, l), np.int32), "segment_ids": segment_ids,
          "masked_lm_positions": positions,
          "masked_lm_ids": np.take_along_axis(ids, positions, axis=1),
          "masked_lm_weights": weights,
          "next_sentence_labels": rng.randint(0, 2, (b,)).astype(np.int32)}


def predictions_per_seq(config: ml_collections.ConfigDict) -> int | None:
  """Positions per row whose vocabulary projection the step computes (None: all of them)."""
  return None if config.objective == "causal_lm" else int(config.max_predictions)


def _median_step(run_one: Callable[[], None], steps: int) -> list[float]:
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    run_one()
    times.append(time.perf_counter() - start)
  return times


class OurStep:
  """Our train step on the config's mesh: compiled once, then timed `steps` at a time."""

  def __init__(self, config: ml_collections.ConfigDict, batch: dict[str, np.ndarray]) -> None:
    from bertjax.train import Trainer
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
    def one():
      self.state, metrics = self.compiled(self.state, self.batch)
      jax.block_until_ready(metrics["loss"])
    return _median_step(one, steps)

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


@dataclasses.dataclass
class Pair:
  ours_seconds: float   # median step time of our block
  hf_seconds: float     # median step time of the reference block that followed it

  @property
  def ratio(self) -> float:
    """Our throughput over the reference's."""
    return self.hf_seconds / self.ours_seconds


def profile_step(step: OurStep, directory: str, steps: int = 2) -> dict[str, Any]:
  """Runs `steps` steps under the JAX profiler (trace written to `directory`, viewable in
  Perfetto/TensorBoard) and splits the time of the program's ops by what they do
  (`hlo.instruction_purposes`): ms per step and share for matmuls, dropout, layer norm,
  attention softmax, scan slicing, the optimizer update... The matmul rate (compiled dot
  FLOPs over matmul time) says whether the GEMMs or everything around them is in the way."""
  import glob
  import gzip
  purposes = hlo.instruction_purposes(step.compiled.as_text())
  step.run(1)
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    step.run(steps)
  traces = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True),
                  key=os.path.getmtime)
  if not traces:
    raise RuntimeError(f"the profiler wrote no *.trace.json.gz under {directory}")
  with gzip.open(traces[-1]) as f:
    events = json.load(f)["traceEvents"]
  micros: dict[str, float] = {}
  for event in events:
    if event.get("ph") != "X" or "dur" not in event:
      continue
    name = event.get("args", {}).get("hlo_op", event["name"])
    if name in purposes:
      micros[purposes[name]] = micros.get(purposes[name], 0.0) + float(event["dur"])
  if not micros:
    raise RuntimeError(f"no event in {traces[-1]} names an op of the compiled program")
  # Every local device runs the program and is traced: times are per device, on average.
  per_step = 1e6 * steps * jax.local_device_count()
  total = sum(micros.values())
  compiled_flops, _ = step.compiled_flops()  # all devices'
  matmul_seconds = micros.get("matmul", 0.0) / per_step
  return {"trace": traces[-1], "steps": steps, "op_seconds_per_step": total / per_step,
          "by_purpose": {k: {"seconds_per_step": v / per_step, "share": v / total}
                         for k, v in sorted(micros.items(), key=lambda kv: -kv[1])},
          "matmul_flops_per_second": (compiled_flops / step.mesh.size / matmul_seconds
                                      if matmul_seconds else None)}


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
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def run_benchmark(config: ml_collections.ConfigDict, *, steps: int = 5, pairs: int = 3,
                  compare: str | None = None, peak_size: int = 2048,
                  profile_dir: str | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
  """Benchmarks `config`'s train step (and the reference, alternately); returns the record.
  `profile_dir`: also profile our step there after the timed steps (`profile_step`)."""
  from bertjax.config import model_config
  model = model_config(config)
  b, l = int(config.batch_size), int(config.seq_length)
  dtype = jnp.dtype(model.dtype)
  record: dict[str, Any] = {
      "config": {"model": f"{model.family} {model.num_layers}x{model.hidden_size}, "
                          f"{model.num_heads} heads, vocab {model.vocab_size}",
                 "batch_size": b, "seq_length": l, "dtype": model.dtype,
                 "objective": config.objective, "mesh": dict(config.mesh),
                 "grad_accum_steps": int(config.grad_accum_steps),
                 "predictions_per_seq": predictions_per_seq(config),
                 "dropout": [model.hidden_dropout, model.attention_dropout],
                 "remat": model.remat_policy, "scan_layers": model.scan_layers},
      "machine": machine(), "steps_per_block": steps, "pairs": pairs}

  log(f"measuring the matmul peak ({peak_size}² {dtype.name}, XLA)")
  xla_peak = flops_lib.measure_matmul_peak(peak_size, dtype) * flops_lib.measured_peak_devices()
  record["peak"] = {"xla_matmul_flops": xla_peak, "nominal_flops": flops_lib.nominal_peak_flops()}

  batch = synthetic_batch(config)
  log("compiling our train step")
  ours = OurStep(config, batch)
  compiled, xla_cost = ours.compiled_flops()
  model_flops = flops_lib.train_flops_per_step(model, b, l, predictions_per_seq(config))
  record["ours"] = {"params": ours.params, "lower_seconds": ours.lower_seconds,
                    "compile_seconds": ours.compile_seconds, "model_flops": model_flops,
                    "compiled_dot_flops": compiled, "xla_cost_analysis_flops": xla_cost,
                    **ours.memory()}
  reference = None
  if compare == "hf":
    from bertjax import bench_hf
    log("building the Hugging Face reference")
    reference = bench_hf.ReferenceStep(config, batch)
    record["peak"]["torch_matmul_flops"] = bench_hf.measure_matmul_peak(peak_size, dtype)
    record["hf"] = {"model": reference.describe(), "params": reference.params,
                    "torch": reference.torch_version, "threads": reference.threads,
                    "model_flops": reference.model_flops(model, b, l)}
  elif compare is not None:
    raise ValueError(f"compare must be 'hf' or None, got {compare!r}")

  ours.run(2)  # warm: first executions allocate
  if reference is not None:
    reference.run(2)
  ours_times, hf_times, results = [], [], []
  for i in range(pairs):
    ours.run(1)
    block = ours.run(steps)
    ours_times += block
    line = f"pair {i + 1}/{pairs}: ours {statistics.median(block) * 1e3:.1f} ms/step"
    if reference is not None:
      reference.run(1)
      ref_block = reference.run(steps)
      hf_times += ref_block
      results.append(Pair(statistics.median(block), statistics.median(ref_block)))
      line += (f", hf {statistics.median(ref_block) * 1e3:.1f} ms/step, "
               f"ratio {results[-1].ratio:.3f}")
    log(line)

  # The machine drifts (a shared CPU's peak moved 1.5x within an hour): read the peak again
  # after the timed steps and take the higher reading, so that MFU is never flattered by a
  # slow phase at the start.
  xla_peak = max(xla_peak, flops_lib.measure_matmul_peak(peak_size, dtype)
                 * flops_lib.measured_peak_devices())
  record["peak"]["xla_matmul_flops_readings"] = [record["peak"]["xla_matmul_flops"], xla_peak]
  record["peak"]["xla_matmul_flops"] = xla_peak
  if reference is not None:
    torch_peak = bench_hf.measure_matmul_peak(peak_size, dtype)
    record["peak"]["torch_matmul_flops_readings"] = [record["peak"]["torch_matmul_flops"],
                                                     torch_peak]
    record["peak"]["torch_matmul_flops"] = max(torch_peak, record["peak"]["torch_matmul_flops"])
  if profile_dir:
    log(f"profiling 2 steps into {profile_dir}")
    record["profile"] = profile_step(ours, profile_dir)
  step_seconds = statistics.median(ours_times)
  achieved = model_flops / step_seconds
  record["ours"].update({
      "step_seconds_median": step_seconds, "step_seconds": ours_times,
      "tokens_per_second": b * l / step_seconds, "sequences_per_second": b / step_seconds,
      "model_flops_per_second": achieved,
      "mfu_vs_xla_matmul_peak": achieved / xla_peak,
      "mfu_vs_nominal_peak": (achieved / record["peak"]["nominal_flops"]
                              if record["peak"]["nominal_flops"] else None),
      "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0})
  if reference is not None:
    torch_peak = record["peak"]["torch_matmul_flops"]
    hf_step = statistics.median(hf_times)
    record["ours"]["mfu_vs_torch_matmul_peak"] = achieved / torch_peak
    record["hf"].update({
        "step_seconds_median": hf_step, "step_seconds": hf_times,
        "tokens_per_second": b * l / hf_step, "sequences_per_second": b / hf_step,
        "mfu_vs_torch_matmul_peak": record["hf"]["model_flops"] / hf_step / torch_peak,
        "peak_memory_bytes": reference.peak_memory()})
    record["pairs_ratio"] = [p.ratio for p in results]
    record["median_ratio"] = statistics.median(p.ratio for p in results)
  return record


def decode_benchmark(config: ml_collections.ConfigDict, cache_sizes: list[int],
                     new_tokens: int = 32) -> list[dict[str, float]]:
  """Per-token generation cost of the config's GPT (random weights) at each cache size."""
  from bertjax import generate
  from bertjax.config import model_config
  from bertjax.models import build_model, jit_init
  model = model_config(config)
  if model.family != "gpt":
    raise ValueError(f"--decode needs a GPT config, got model.family={model.family!r}")
  params = jit_init(build_model(model))(jax.random.key(int(config.seed)))
  return generate.benchmark_decode(params, model, cache_sizes, new_tokens=new_tokens)


def _fmt_flops(x: float | None) -> str:
  return "n/a" if x is None else f"{x / 1e9:,.1f} GFLOP"


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _readings(values: list[float] | None) -> str:
  if not values:
    return " (measured)"
  return " (higher of " + " and ".join(f"{v / 1e9:,.1f}" for v in values) + ", before and after)"


def format_record(r: dict[str, Any]) -> str:
  c, m, o, peak = r["config"], r["machine"], r["ours"], r["peak"]
  lines = [
      f"model          {c['model']}; batch {c['batch_size']} x {c['seq_length']}, {c['dtype']}, "
      f"mesh {c['mesh']}, dropout {c['dropout'][0]:g}/{c['dropout'][1]:g}, "
      f"remat {c['remat']}, scan_layers={c['scan_layers']}",
      f"machine        {m['cpu']}, {m['cores']} cores; {m['devices']} x {m['device_kind']}; "
      f"jax {m['jax']}",
      f"peak           XLA matmul {peak['xla_matmul_flops'] / 1e9:,.1f} GFLOP/s"
      f"{_readings(peak.get('xla_matmul_flops_readings'))}"
      + (f"; torch matmul {peak['torch_matmul_flops'] / 1e9:,.1f} GFLOP/s"
         f"{_readings(peak.get('torch_matmul_flops_readings'))}"
         if "torch_matmul_flops" in peak else "")
      + (f"; nominal {peak['nominal_flops'] / 1e12:,.1f} TFLOP/s" if peak["nominal_flops"]
         else "; no nominal peak for this device kind"),
      f"compile        {o['lower_seconds']:.1f} s trace+lower, {o['compile_seconds']:.1f} s "
      "XLA compile",
      f"FLOPs/step     model {_fmt_flops(o['model_flops'])} (6·N·tokens + attention + "
      f"computed vocab projection); compiled dots {_fmt_flops(o['compiled_dot_flops'])} "
      f"({o['compiled_dot_flops'] / o['model_flops']:.3f}x); XLA cost_analysis "
      f"{_fmt_flops(o['xla_cost_analysis_flops'])} (loop bodies counted once)",
      f"memory         {o['compiled_peak_bytes_per_device'] / 2**20:,.0f} MiB per device "
      f"(compiled: arguments + outputs - donated + temporaries); process max RSS "
      f"{o['max_rss_bytes'] / 2**20:,.0f} MiB",
      "",
      f"{'':12s}{'ms/step':>10s}{'tokens/s':>11s}{'seq/s':>9s}{'MFU (own peak)':>16s}"
      f"{'MFU (torch peak)':>18s}",
      f"{'bertjax':12s}{o['step_seconds_median'] * 1e3:10.1f}{o['tokens_per_second']:11.1f}"
      f"{o['sequences_per_second']:9.2f}{_pct(o['mfu_vs_xla_matmul_peak']):>16s}"
      f"{_pct(o.get('mfu_vs_torch_matmul_peak')):>18s}"]
  if "hf" in r:
    h = r["hf"]
    lines.append(
        f"{'hf torch':12s}{h['step_seconds_median'] * 1e3:10.1f}{h['tokens_per_second']:11.1f}"
        f"{h['sequences_per_second']:9.2f}{'':>16s}{_pct(h['mfu_vs_torch_matmul_peak']):>18s}")
    lines.append("")
    lines.append(f"reference      {h['model']}, torch {h['torch']}, {h['threads']} threads; "
                 f"its model FLOPs {_fmt_flops(h['model_flops'])}/step")
    lines.append("ratio          ours/hf throughput per pair: "
                 + ", ".join(f"{x:.3f}" for x in r["pairs_ratio"])
                 + f"; median {r['median_ratio']:.3f}")
  if o.get("mfu_vs_nominal_peak") is not None:
    lines.append(f"MFU nominal    {_pct(o['mfu_vs_nominal_peak'])} of the data-sheet peak")
  if "profile" in r:
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
