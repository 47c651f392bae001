"""Reading profiles of a train step: where its device time goes.

`profile_step` runs our compiled step under the JAX profiler and `summarize_trace` reads the
trace it writes: on a GPU (or TPU) each kernel's time attributed to the instruction that
launched it and to what that instruction does, and how busy the device was; on a CPU the op
time by purpose only. `torch_profile` summarises the PyTorch reference's kernels the same way,
and `kernel_class` sorts any kernel name into the few kinds (GEMMs, fused attention, the rest)
by which the two steps compare.

The guide: docs/performance.md (`bertjax bench --profile DIR`, and 'GPU').
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from bertjax.tools import hlo

# A gap between two kernels shorter than this is the launch itself, not idleness.
GAP_US = 5.0
# How many kernels (or instructions) the summaries list, longest first.
TOP = 15

# Kernel names by kind, first match wins (lower-cased): cuBLAS/CUTLASS GEMMs (sm90_xmma, nvjet
# on Hopper), Triton GEMM fusions XLA emits, cuDNN and flash attention, NCCL collectives.
_KERNEL_CLASSES = (
    ("attention (fused)", ("flash", "fmha", "attention", "cudnn_generated", "cudnn::", "sdpa")),
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "matmul", "cublas", "triton_gemm", "dot",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter")),
    ("memcpy/memset", ("memcpy", "memset")),
)


def kernel_class(name: str) -> str:
  """"gemm", "attention (fused)", "collective", "memcpy/memset" or "other (elementwise,
  reductions)" for a kernel's (or a fused instruction's) name."""
  lowered = name.lower()
  for label, keys in _KERNEL_CLASSES:
    if any(k in lowered for k in keys):
      return label
  return "other (elementwise, reductions)"


def latest_trace(directory: str) -> str:
  traces = sorted(glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True),
                  key=os.path.getmtime)
  if not traces:
    raise RuntimeError(f"the profiler wrote no *.trace.json.gz under {directory}")
  return traces[-1]


def _names(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
  """The trace's process and thread names, from its metadata events."""
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name":
      processes[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  return processes, threads


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  merged: list[tuple[float, float]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def timeline(kernels: list[tuple[float, float]], steps: int,
             executions: list[tuple[float, float]] | None = None) -> dict[str, Any]:
  """How busy the device was over `kernels` ((start, end) in µs) of `steps` steps: the window
  from the first kernel's start to the last one's end, the union of the kernels in it (busy),
  the gaps of at least `GAP_US` inside each execution of the program (`executions`: the
  program's own spans, where the trace has them) and between executions, per step."""
  busy = _union(kernels)
  if not busy:
    return {}
  window = busy[-1][1] - busy[0][0]
  busy_us = sum(end - start for start, end in busy)
  gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
  gaps = [(s, e) for s, e in gaps if e - s >= GAP_US]

  def inside(gap: tuple[float, float]) -> bool:
    return not executions or any(s <= gap[0] and gap[1] <= e for s, e in executions)

  within = [e - s for s, e in gaps if inside((s, e))]
  between = [e - s for s, e in gaps if not inside((s, e))]
  durations = [end - start for start, end in kernels]
  return {
      "kernels_per_step": len(kernels) / steps,
      "window_us_per_step": window / steps,
      "busy_us_per_step": busy_us / steps,
      "busy_share": busy_us / window if window else None,
      "idle_gaps_per_step": len(within) / steps,
      "idle_in_step_us_per_step": sum(within) / steps,
      "idle_between_steps_us_per_step": sum(between) / steps,
      "largest_gaps_us": sorted(within + between, reverse=True)[:5],
      "kernels_under_10us_per_step": sum(d < 10 for d in durations) / steps,
      "median_kernel_us": sorted(durations)[len(durations) // 2],
  }


def _top(times: dict[str, float], counts: dict[str, int], steps: int, total: float,
         extra: Callable[[str], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
  rows = []
  for name, micros in sorted(times.items(), key=lambda kv: -kv[1])[:TOP]:
    rows.append({"name": name, "us_per_step": micros / steps, "calls_per_step": counts[name]
                 / steps, "share": micros / total if total else None,
                 **(extra(name) if extra else {})})
  return rows


def _by(rows: Iterable[tuple[str, float]], steps: int) -> dict[str, dict[str, float]]:
  sums: dict[str, float] = collections.defaultdict(float)
  for key, micros in rows:
    sums[key] += micros
  total = sum(sums.values())
  return {k: {"seconds_per_step": v / 1e6 / steps, "share": v / total if total else 0.0}
          for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}


def summarize_trace(path: str, purposes: dict[str, str], steps: int,
                    devices: int = 1) -> dict[str, Any]:
  """The device time of a profiled `steps` steps (trace at `path`, the JAX profiler's
  *.trace.json.gz) by what it was spent on. `purposes`: instruction name -> purpose
  (`hlo.instruction_purposes` of the compiled program). With device kernels in the trace
  (GPU streams, TPU ops): by purpose, by kernel kind, the top instructions and kernels, and
  the timeline (`timeline`) of the first device. Otherwise (a CPU): the op time by purpose,
  averaged over the `devices` that ran it."""
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  processes, threads = _names(events)
  device_pids = sorted(pid for pid, name in processes.items()
                       if name.startswith("/device:") and "CUSTOM" not in name)
  if device_pids:
    return _device_summary(path, events, threads, device_pids[0], purposes, steps)
  micros: dict[str, float] = collections.defaultdict(float)
  for event in events:
    if event.get("ph") != "X" or "dur" not in event:
      continue
    name = event.get("args", {}).get("hlo_op", event["name"])
    if name in purposes:
      micros[purposes[name]] += float(event["dur"])
  if not micros:
    raise RuntimeError(f"no event in {path} names an op of the compiled program")
  per_step = 1e6 * steps * devices
  total = sum(micros.values())
  return {"trace": path, "steps": steps, "device": "host", "op_seconds_per_step": total / per_step,
          "by_purpose": {k: {"seconds_per_step": v / per_step, "share": v / total}
                         for k, v in sorted(micros.items(), key=lambda kv: -kv[1])}}


def _device_summary(path: str, events: list[dict[str, Any]], threads: dict, pid: int,
                    purposes: dict[str, str], steps: int) -> dict[str, Any]:
  """`summarize_trace` where the device's kernels are events of their own: on a GPU the
  threads named "Stream #…" (the "XLA Ops"/"XLA Modules" lines beside them are derived from
  the same kernels and would count them twice), on a TPU the "XLA Ops" line."""
  lines = {tid for (p, tid), name in threads.items() if p == pid}
  streams = {tid for tid in lines if threads[(pid, tid)].startswith("Stream")}
  ops_line = {tid for tid in lines if threads[(pid, tid)] == "XLA Ops"}
  modules_line = {tid for tid in lines if threads[(pid, tid)] == "XLA Modules"}
  kernel_lines = streams or ops_line
  kernels, executions = [], []
  for e in events:
    if e.get("ph") != "X" or e.get("pid") != pid or "dur" not in e:
      continue
    if e.get("tid") in kernel_lines:
      kernels.append(e)
    elif e.get("tid") in modules_line:
      executions.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
  if not kernels:
    raise RuntimeError(f"{path}: no kernel events on the device's streams")
  by_op: dict[str, float] = collections.defaultdict(float)
  op_calls: dict[str, int] = collections.Counter()
  by_kernel: dict[str, float] = collections.defaultdict(float)
  kernel_calls: dict[str, int] = collections.Counter()
  op_of_kernel: dict[str, str] = {}
  for e in kernels:
    op = e.get("args", {}).get("hlo_op", "") or e["name"]
    by_op[op] += float(e["dur"])
    op_calls[op] += 1
    by_kernel[e["name"]] += float(e["dur"])
    kernel_calls[e["name"]] += 1
    op_of_kernel.setdefault(e["name"], op)
  total = sum(by_op.values())
  # Kernels replayed from a command buffer (a CUDA graph) carry the buffer's name as their
  # instruction; XLA names a fusion's kernel after the fusion ("loop_add_fusion.3" runs
  # "loop_add_fusion_3"), and library calls (cuBLAS, cuDNN) have kernels of their own kind.
  by_kernel_name = {name.replace(".", "_"): label for name, label in purposes.items()}
  library = {"gemm": "matmul", "attention (fused)": "attention: fused kernel",
             "memcpy/memset": "copies and fills"}

  def purpose(op: str, kernel: str | None = None) -> str:
    if op in purposes:
      return purposes[op]
    if kernel is not None and kernel in by_kernel_name:
      return by_kernel_name[kernel]
    return library.get(kernel_class(kernel or op), "unattributed")

  by_purpose: dict[str, float] = collections.defaultdict(float)
  for e in kernels:
    by_purpose[purpose(e.get("args", {}).get("hlo_op", "") or e["name"], e["name"])] += float(
        e["dur"])
  return {
      "trace": path, "steps": steps, "device": threads.get((pid, next(iter(kernel_lines))), ""),
      "op_seconds_per_step": total / 1e6 / steps,
      "by_purpose": _by(by_purpose.items(), steps),
      "by_kernel_class": _by(((kernel_class(k), us) for k, us in by_kernel.items()), steps),
      "top_instructions": _top(by_op, op_calls, steps, total,
                               lambda op: {"purpose": purpose(op)}),
      "top_kernels": _top(by_kernel, kernel_calls, steps, total,
                          lambda k: {"class": kernel_class(k), "instruction": op_of_kernel[k]}),
      "timeline": timeline([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels],
                           steps, executions or None),
      "host": host_dispatch(events, steps)}


# Host-side spans of a step's dispatch in a JAX trace (seen with jax 0.11 on a GPU): the
# jitted call's handling of its arguments (the state's leaves), and the command buffer's update
# (a CUDA graph whose buffer addresses changed since its last execution).
_HOST_SPANS = {"argument handling": "ParseArguments",
               "command buffer updates": "command_buffer::update"}


def host_dispatch(events: list[dict[str, Any]], steps: int) -> dict[str, float]:
  """µs per step the host spent in the `_HOST_SPANS` of dispatching the program: with each
  step waited for, device idle time; with steps dispatched back to back, hidden behind the
  previous step."""
  sums = {label: 0.0 for label in _HOST_SPANS}
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      for label, prefix in _HOST_SPANS.items():
        if e["name"].startswith(prefix):
          sums[label] += float(e["dur"])
  return {f"{label}_us_per_step": us / steps for label, us in sums.items() if us}


def trace_step(step: Any, directory: str, steps: int = 2) -> str:
  """Runs `steps` of `step` (bench.OurStep) under the JAX profiler, after one untimed step;
  the trace (viewable in Perfetto/TensorBoard) and the optimized program (program.hlo.txt.gz)
  are written under `directory`. Returns the trace's *.trace.json.gz."""
  import jax  # noqa: PLC0415 - the trace readers load no jax
  step.run(1)
  with jax.profiler.trace(directory):
    step.run(steps)
  # The optimized program beside it: the trace names its instructions.
  with gzip.open(os.path.join(directory, "program.hlo.txt.gz"), "wt") as f:
    f.write(step.compiled.as_text())
  return latest_trace(directory)


def summarize_step(step: Any, trace: str, steps: int = 2) -> dict[str, Any]:
  """`summarize_trace` of `step`'s trace (`trace_step`), with the matmul rate: the compiled
  dot FLOPs over the matmuls' time, which says whether the GEMMs or everything around them is
  in the way."""
  import jax  # noqa: PLC0415 - the trace readers load no jax
  purposes = hlo.instruction_purposes(step.compiled.as_text())
  summary = summarize_trace(trace, purposes, steps, devices=jax.local_device_count())
  compiled_flops, _ = step.compiled_flops()  # all devices'
  matmul = summary["by_purpose"].get("matmul", {}).get("seconds_per_step", 0.0)
  summary["matmul_flops_per_second"] = (compiled_flops / step.mesh.size / matmul
                                        if matmul else None)
  return summary


def profile_step(step: Any, directory: str, steps: int = 2) -> dict[str, Any]:
  """`steps` of `step` profiled into `directory` and summarized: device time by purpose —
  matmuls, dropout, layer norm, attention, scan slicing, the optimizer update... — and, on a
  device with kernels of its own, by kernel kind, the top kernels and the timeline."""
  return summarize_step(step, trace_step(step, directory, steps), steps)


def torch_profile(run_one: Callable[[], None], steps: int = 2) -> dict[str, Any]:
  """The PyTorch reference's kernels over `steps` calls of `run_one` (torch.profiler on CUDA):
  by kernel kind, the top kernels, and the timeline, as `summarize_trace` gives ours."""
  import torch  # noqa: PLC0415 - optional (the hf extra)
  activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
  with torch.profiler.profile(activities=activities) as prof:
    for _ in range(steps):
      run_one()
  kernels = [e for e in prof.events()
             if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
  if not kernels:
    # On a CPU the operators are the work: their own (self) time, no timeline.
    ops = [(a.key, float(a.self_cpu_time_total), int(a.count)) for a in prof.key_averages()
           if a.self_cpu_time_total > 0]
    if not ops:
      raise RuntimeError("torch.profiler recorded no kernel and no operator time")
    times = {k: us for k, us, _ in ops}
    counts = {k: n for k, _, n in ops}
    total = sum(times.values())
    return {"steps": steps, "device": "host", "op_seconds_per_step": total / 1e6 / steps,
            "by_kernel_class": _by(((kernel_class(k), us) for k, us in times.items()), steps),
            "top_kernels": _top(times, counts, steps, total,
                                lambda k: {"class": kernel_class(k)})}
  by_kernel: dict[str, float] = collections.defaultdict(float)
  calls: dict[str, int] = collections.Counter()
  spans = []
  for e in kernels:
    start, end = float(e.time_range.start), float(e.time_range.end)
    by_kernel[e.name] += end - start
    calls[e.name] += 1
    spans.append((start, end))
  total = sum(by_kernel.values())
  return {"steps": steps, "op_seconds_per_step": total / 1e6 / steps,
          "by_kernel_class": _by(((kernel_class(k), us) for k, us in by_kernel.items()), steps),
          "top_kernels": _top(by_kernel, calls, steps, total,
                              lambda k: {"class": kernel_class(k)}),
          "timeline": timeline(spans, steps)}


def _short(name: str, width: int = 70) -> str:
  name = re.sub(r"\s+", " ", name)
  return name if len(name) <= width else name[:width - 1] + "…"


def format_summary(summary: dict[str, Any], title: str) -> list[str]:
  """Markdown lines: a profile's timeline, time by kind and by purpose, and its top kernels."""
  lines = [f"**{title}**: {summary['op_seconds_per_step'] * 1e3:,.2f} ms of kernels per step"]
  t = summary.get("timeline")
  if t:
    lines[0] += (f" over a {t['window_us_per_step'] / 1e3:,.2f} ms window "
                 f"({t['busy_share']:.1%} busy); {t['kernels_per_step']:,.0f} kernels a step "
                 f"(median {t['median_kernel_us']:.1f} µs, {t['kernels_under_10us_per_step']:,.0f}"
                 f" under 10 µs); idle gaps ≥ {GAP_US:g} µs: {t['idle_gaps_per_step']:,.0f} a "
                 f"step, {t['idle_in_step_us_per_step'] / 1e3:,.2f} ms inside the program, "
                 f"{t['idle_between_steps_us_per_step'] / 1e3:,.2f} ms between steps")
  for label, us in summary.get("host", {}).items():
    lines[0] += f"; host {label.removesuffix('_us_per_step')} {us / 1e3:,.2f} ms a step"
  lines.append("")
  for key, label in (("by_kernel_class", "kind"), ("by_purpose", "purpose")):
    if key in summary:
      lines += [f"| {label} | ms/step | share |", "|---|---|---|"]
      lines += [f"| {k} | {v['seconds_per_step'] * 1e3:,.2f} | {v['share']:.1%} |"
                for k, v in summary[key].items()]
      lines.append("")
  if "top_kernels" in summary:
    lines += ["| kernel | kind | µs/step | calls/step | share |", "|---|---|---|---|---|"]
    lines += [f"| `{_short(k['name'])}` | {k['class']} | {k['us_per_step']:,.0f} | "
              f"{k['calls_per_step']:,.0f} | {k['share']:.1%} |" for k in summary["top_kernels"]]
    lines.append("")
  return lines
