"""Ahead-of-time compilation of the real train step for a named TPU topology, on any machine
(`bertjax compile`, `compile_for_topology`); guide: docs/reproducing.md, 'Compiling for a slice'.

libtpu's compile-only client (`jax.experimental.topologies`) describes the slice's devices, the
config's mesh is laid over them, and `Trainer`'s jitted step (state donated, the config's
shardings) is lowered with abstract inputs and compiled by the TPU compiler: nothing is
allocated. The report reads memory per device (`memory_analysis`), the collectives with their
bytes, and FLOPs counted from the optimized HLO (every dot times its loops' trip counts, times
the devices of the SPMD program), since XLA's `cost_analysis` counts a scanned layer stack once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import re
import time
from typing import Any

import jax
import ml_collections

from bertjax.data import decoder_length, schema
from bertjax.models.params import count_params
from bertjax.parallel import distributed, sharding
from bertjax.tools.hlo import analyze_hlo
from bertjax.tools.topology import TopologySpec, parse_topology, topology_devices, topology_mesh
from bertjax.training import flops as flops_lib
from bertjax.training.trainer import Trainer

GiB = 2 ** 30

def abstract_batch(config: ml_collections.ConfigDict) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch of the config's objective as shapes (bertjax.data.schema)."""
  return schema.abstract_batch(config.objective, int(config.batch_size), int(config.seq_length),
                               int(config.max_predictions),
                               packed=config.data.bert_instances == "packed",
                               decoder_length=decoder_length(config))


@dataclasses.dataclass
class CompileReport:
  """What compiling one train step for a topology says about it (memory per device)."""
  topology: TopologySpec
  mesh: dict[str, int]
  model: str                      # e.g. "bert 24x1024, 336.2M params"
  batch_size: int
  seq_length: int
  grad_accum_steps: int
  sharding_rules: str
  remat_policy: str
  dtype: str
  # Memory per device, bytes (None when the compiler refused the program for memory).
  argument_bytes: float | None
  output_bytes: float | None
  alias_bytes: float | None
  temp_bytes: float | None
  generated_code_bytes: float | None
  total_bytes: float              # peak the device must hold
  hbm_bytes: float
  fits: bool
  shortfall_bytes: float          # 0 when it fits
  compiler_error: str | None      # the TPU compiler's out-of-memory message, if any
  # FLOPs per step, all devices together.
  compiled_flops: float | None
  xla_cost_flops_per_device: float | None  # cost_analysis: loop bodies counted once
  analytic_flops: float
  # kind -> (executions per step, bytes per device per step)
  collectives: dict[str, tuple[int, float]]
  lower_seconds: float
  compile_seconds: float
  # The projection: matmuls at `mfu` of the bf16 peak (compute), collectives at the data
  # sheet's ICI bandwidth (communication; None where unknown), step = the larger (overlapped).
  mfu: float
  compute_seconds: float
  communication_seconds: float | None
  projected_step_seconds: float
  tokens_per_second: float
  attention: str = "xla"
  notes: list[str] = dataclasses.field(default_factory=list)
  # False: compiled_flops were counted on the program before SPMD partitioning (global shapes,
  # so duplicated compute under sharding cannot show), as when the compiler refused it.
  flops_partitioned: bool = True
  # The pre-flight line: hosts, the rows of each global batch each loads, disjoint/complete.
  host_layout: str = ""

  @property
  def flops_ratio(self) -> float | None:
    return None if self.compiled_flops is None else self.compiled_flops / self.analytic_flops


# The TPU compiler's out-of-memory errors, in the forms libtpu releases have used:
# "Ran out of memory in memory space hbm. Used 63.80G of 30.75G hbm. Exceeded hbm capacity by
# 33.05G." and "Ran out of memory on HBM, the total memory required for HLO temporaries
# (29.89G) exceeds available HBM (15.75G)." (available = HBM less what the runtime reserves).
_OOM = (re.compile(r"Used\s+([\d.]+)([KMGT]?)\s+of\s+([\d.]+)([KMGT]?)\s+hbm", re.IGNORECASE),
        re.compile(r"\(([\d.]+)([KMGT]?)\)\s+exceeds available HBM\s+\(([\d.]+)([KMGT]?)\)",
                   re.IGNORECASE))
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _oom_numbers(message: str) -> tuple[float, float] | None:
  """(bytes needed, bytes available) from the TPU compiler's out-of-memory error, or None when
  the message is not one."""
  for pattern in _OOM:
    m = pattern.search(message)
    if m:
      return (float(m.group(1)) * _UNITS[m.group(2).upper()],
              float(m.group(3)) * _UNITS[m.group(4).upper()])
  if "RESOURCE_EXHAUSTED" in message and "memory" in message.lower():
    return (float("nan"), float("nan"))
  return None


def compile_for_topology(config: ml_collections.ConfigDict, topology: str,
                         mfu: float = 0.5, num_slices: int = 1) -> CompileReport:
  """Compiles `config`'s train step for `topology` (e.g. "v4-64") and reports memory per device,
  whether it fits, FLOPs against the analytic model FLOPs, collectives and a step time
  projected at `mfu`. Raises ValueError when the mesh or batch does not divide the slice and
  RuntimeError when libtpu is missing."""
  spec = parse_topology(topology, num_slices)
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu must be in (0, 1], got {mfu}")
  devices = topology_devices(spec)
  mesh = topology_mesh(config, spec, devices)
  trainer = Trainer(config, mesh)
  batch_size, seq_length = int(config.batch_size), int(config.seq_length)
  accum = int(config.grad_accum_steps)
  try:
    sharding.check_batch(batch_size, accum, mesh, trainer.rules)
  except ValueError as e:
    raise ValueError(f"{e} on {spec.name}") from None
  # Pre-flight: the rows of every global batch each host of the slice(s) would load.
  layout = distributed.row_layout(trainer.data_sharding(), batch_size)
  if layout.problems():
    raise ValueError(f"per-host loading cannot work on {spec.name}: {layout.summary()}")

  batch = abstract_batch(config)
  step = trainer.compile_step(batch)
  state = trainer.abstract_state()
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_shardings[k])
           for k, v in batch.items()}
  mc = trainer.model_config
  params = count_params(state.params)
  analytic = flops_lib.run_flops_per_step(mc, config, batch_size, seq_length)
  rules = config.sharding_rules if isinstance(config.sharding_rules, str) else "custom"
  common = {
      "topology": spec, "mesh": dict(mesh.shape),
      "model": f"{mc.family} {mc.num_layers}x{mc.hidden_size}, {params / 1e6:.1f}M params",
      "batch_size": batch_size, "seq_length": seq_length, "grad_accum_steps": accum,
      "sharding_rules": rules, "remat_policy": mc.remat_policy,
      "dtype": f"{mc.dtype}/{mc.param_dtype}", "hbm_bytes": spec.hbm_per_device,
      "analytic_flops": analytic, "mfu": mfu, "attention": mc.attention,
      "host_layout": layout.summary(),
      # Until the program is compiled: the model FLOPs, no collectives known.
      **_projection(spec, analytic, mfu, None, batch_size * seq_length)}

  start = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = step.lower(state, batch)
  lower_seconds = time.perf_counter() - start
  start = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # the TPU compiler reports running out of HBM as a runtime error
    compile_seconds = time.perf_counter() - start
    message = str(e)
    numbers = _oom_numbers(message)
    if numbers is None:
      raise
    used, capacity = numbers
    capacity = spec.hbm_per_device if math.isnan(capacity) else capacity
    # No optimized program to read: count the matmuls of the program before partitioning
    # (global shapes, so duplicated compute under sharding cannot show).
    before = analyze_hlo(lowered.as_text(dialect="hlo"))
    return CompileReport(
        **{**common, "hbm_bytes": capacity}, argument_bytes=None, output_bytes=None,
        alias_bytes=None, temp_bytes=None, generated_code_bytes=None, total_bytes=used,
        fits=False, shortfall_bytes=used - capacity,
        compiler_error=" ".join(message.strip().splitlines()[:2])[:500],
        compiled_flops=before.matmul_flops, xla_cost_flops_per_device=None, collectives={},
        lower_seconds=lower_seconds, compile_seconds=compile_seconds, flops_partitioned=False,
        notes=[("the TPU compiler refused the program for memory: the compiled FLOPs are the "
               "unpartitioned program's, and no collectives or memory breakdown exist")])
  compile_seconds = time.perf_counter() - start

  mem = compiled.memory_analysis()
  # Donated state is aliased to the new state: count it once. Peak = live arguments and
  # outputs + the largest set of temporaries live at once + the program itself.
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
           + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  notes = []
  try:
    stats, partitioned = analyze_hlo(compiled.as_text()), True
  except Exception as e:  # noqa: BLE001 - a libtpu newer than jaxlib can emit unreadable HLO
    stats, partitioned = analyze_hlo(lowered.as_text(dialect="hlo")), False
    notes.append(f"the optimized program could not be read back ({str(e).splitlines()[0][:120]}"
                 "; a libtpu other than jax's pinned one?): FLOPs are the unpartitioned "
                 "program's and no collectives are listed")
  if stats.unknown_trip_counts:
    notes.append(f"{stats.unknown_trip_counts} loop(s) of unknown trip count counted once")
  compiled_flops = stats.matmul_flops * (spec.total_devices if partitioned else 1)
  kernels = compiled.as_text().count("custom_call_target=\"tpu_custom_call\"")
  if kernels:
    notes.append(f"{kernels} Pallas kernel call(s) (attention={mc.attention}): their FLOPs are "
                 "not among the compiled dots, so the ratio is below 1 by the attention core's "
                 "share; the projection uses the larger of compiled and model FLOPs")
  common.update(_projection(spec, max(compiled_flops, analytic), mfu, stats.wire_bytes,
                            batch_size * seq_length))
  return CompileReport(
      **common, argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
      alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
      generated_code_bytes=mem.generated_code_size_in_bytes, total_bytes=total,
      # The compiler is the judge: it fails (above) when the program cannot fit.
      fits=True, shortfall_bytes=0.0,
      compiler_error=None,
      compiled_flops=compiled_flops,
      xla_cost_flops_per_device=float(cost.get("flops", float("nan"))) if cost else None,
      collectives={k: (round(c), b) for k, (c, b) in sorted(stats.collectives.items())},
      lower_seconds=lower_seconds, compile_seconds=compile_seconds, notes=notes,
      flops_partitioned=partitioned)


def _silence_stderr() -> None:
  """In a compiling child: libtpu's start-up warnings and a crash's stack dump go nowhere."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)


def compile_in_child(config: ml_collections.ConfigDict, topology: str, mfu: float = 0.5,
                     num_slices: int = 1, quiet: bool = False) -> CompileReport:
  """`compile_for_topology` in a fresh child process: some libtpu releases crash (SIGSEGV)
  on some programs (0.0.42: bf16 with remat full), and a crash must be a message, not a core
  dump. Raises concurrent.futures.process.BrokenProcessPool when the compiler crashed (a
  RuntimeError subclass: catch it first), and what `compile_for_topology` raises. `quiet`:
  the child's stderr is discarded."""
  with concurrent.futures.ProcessPoolExecutor(
      max_workers=1, mp_context=multiprocessing.get_context("spawn"),
      initializer=_silence_stderr if quiet else None) as pool:
    return pool.submit(compile_for_topology, config, topology, mfu, num_slices).result()


def _projection(spec: TopologySpec, flops: float, mfu: float, wire_bytes: float | None,
                tokens: int) -> dict[str, Any]:
  """Step time from the matmul FLOPs at `mfu` of the bf16 peak and from the bytes each device
  sends for its collectives (ring algorithms, `hlo.HloStats.wire_bytes`) at the slice's ICI
  bandwidth, the two overlapped (XLA schedules collectives beside compute): the step takes
  the longer of the two."""
  compute = flops / (spec.total_devices * spec.peak_flops_per_device * mfu)
  communication = (None if spec.ici_per_device is None or wire_bytes is None
                   else wire_bytes / spec.ici_per_device)
  step = max(compute, communication or 0.0)
  return {"compute_seconds": compute, "communication_seconds": communication,
          "projected_step_seconds": step, "tokens_per_second": tokens / step}


def _ms(seconds: float) -> str:
  ms = seconds * 1e3
  return f"{ms:9.1f} ms" if ms >= 10 else f"{ms:9.4f} ms"


def _gib(x: float | None) -> str:
  return "-" if x is None else f"{x / GiB:8.2f} GiB"


def format_report(report: CompileReport) -> str:
  """The table `bertjax compile` prints."""
  r, t = report, report.topology
  slices = (f" x {t.num_slices} slices over DCN ({t.total_devices} devices)"
            if t.num_slices > 1 else "")
  lines = [
      (f"topology        {t.name}: {t.topology_name} ({t.chips} chips, {t.devices} devices, "
      f"{t.generation}){slices}"),
      f"model           {r.model}",
      f"mesh            {r.mesh}  rules={r.sharding_rules}",
      f"hosts           {r.host_layout.removeprefix('hosts: ')}",
      (f"batch           {r.batch_size} x {r.seq_length} tokens, grad_accum_steps="
      f"{r.grad_accum_steps}, remat={r.remat_policy}, dtype={r.dtype}, "
      f"attention={r.attention}"),
      "memory per device",
      f"  arguments     {_gib(r.argument_bytes)}",
      f"  outputs       {_gib(r.output_bytes)}",
      f"  aliased       {_gib(r.alias_bytes)}  (donated state, counted once)",
      f"  temporaries   {_gib(r.temp_bytes)}",
      f"  code          {_gib(r.generated_code_bytes)}",
      (f"  total         {_gib(r.total_bytes)}  of {r.hbm_bytes / GiB:.2f} GiB "
      f"{'the compiler may use' if r.compiler_error else 'HBM'} "
      f"({100 * r.total_bytes / r.hbm_bytes:.0f}%)"),
      (f"  fits          NO: short by {r.shortfall_bytes / GiB:.2f} GiB per device"
       if not r.fits else
       f"  fits          yes ({(r.hbm_bytes - r.total_bytes) / GiB:.2f} GiB free)"
       if r.total_bytes <= r.hbm_bytes else
       "  fits          only just: the compiler accepted it, "
       f"{(r.total_bytes - r.hbm_bytes) / GiB:.2f} GiB over the table's HBM (no headroom; "
       "prefer a setting with room)"),
  ]
  if r.compiler_error:
    lines.append(f"  compiler      {r.compiler_error}")
  lines.append("FLOPs per step (all devices)")
  lines.append(f"  analytic      {r.analytic_flops:.4g}  (model FLOPs, bertjax.training.flops)")
  if r.compiled_flops is not None:
    how = ("the program before partitioning" if not r.flops_partitioned
           else f"x {t.total_devices} devices")
    lines.append(f"  compiled      {r.compiled_flops:.4g}  (dots/convolutions x loop trips, {how})")
    lines.append(f"  ratio         {r.flops_ratio:.3f}")
  if r.xla_cost_flops_per_device is not None:
    lines.append(f"  xla cost      {r.xla_cost_flops_per_device:.4g} per device (cost_analysis;"
                 " counts each loop body once)")
  if r.collectives:
    lines.append("collectives per step (per device)")
    for kind, (count, size) in r.collectives.items():
      lines.append(f"  {kind:22s}{count:6d} x  {size / GiB:9.3f} GiB")
  peak = t.total_devices * t.peak_flops_per_device
  if r.communication_seconds is None or (r.compiler_error and not r.collectives):
    why = ("the compiler refused the program: no collectives" if r.compiler_error
           else f"no ICI bandwidth on record for {t.generation}")
    communication = f"  communication         -  ({why})"
  else:
    dcn = "; cross-slice DCN traffic not separated" if t.num_slices > 1 else ""
    communication = (f"  communication {_ms(r.communication_seconds)}  (bytes each device sends "
                     f"for its collectives, ring algorithms, at {t.ici_per_device / 1e9:.0f} "
                     f"GB/s ICI{dcn})")
  bound = ("communication" if (r.communication_seconds or 0) > r.compute_seconds
           else "compute")
  lines += [
      f"compile         {r.compile_seconds:.1f} s (+ {r.lower_seconds:.1f} s lowering)",
      "projected step time",
      (f"  compute       {_ms(r.compute_seconds)}  (matmuls at {100 * r.mfu:.0f}% of "
       f"{t.total_devices} x {t.peak_flops_per_device / 1e12:.1f} TFLOP/s bf16; float32 "
       "matmuls run as bf16 passes at JAX's default precision)"),
      communication,
      (f"  step          {_ms(r.projected_step_seconds)}  ({bound}-bound, the two overlapped; "
       f"{r.tokens_per_second:,.0f} tokens/s, MFU "
       f"{100 * r.analytic_flops / (r.projected_step_seconds * peak):.0f}%)"),
  ]
  lines += [f"note            {n}" for n in r.notes]
  return "\n".join(lines)
