"""What the training loop does around its steps, as hooks over a `StepInfo`.

After every step the loop builds a `StepInfo` (the step number, the state and the metrics still
on the device, the phase, timing) and runs the registered hooks in order, each at its cadence.
The hooks only observe the run; what changes its course (a phase switch, a checkpoint save, a
preemption, the data running out) stays in the loop (bertjax/training/loop.py). Train metrics
are read one step late (`TrainMetrics`), so the host never waits on the device while the device
has nothing queued.

The guide: docs/training.md, 'The loop: workloads, step hooks and when metrics are read'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from bertjax import paths
from bertjax.training.metrics import MetricsWriter, check_finite

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """One step that the loop has dispatched (the device may still be running it)."""

  step: int  # steps done, this one included (the step's 1-based number)
  total: int  # the run's last step
  # The state after the step: donated to the next step, so valid only while the hooks run.
  state: Any
  metrics: Mapping[str, jax.Array]  # on the device, not read
  phase: Any  # the loop's data of the phase the step trained in (batch shape, model FLOPs)
  compiled: bool  # the step compiled the phase's step function (its time is not steady state)
  started: float  # time.perf_counter() just before the step (its batch, compilation) began

  @property
  def last(self) -> bool:
    return self.step >= self.total


@dataclasses.dataclass(frozen=True)
class Cadence:
  """When a hook runs: every `every` steps (0: never by count), at the given `steps`, and at
  the run's last step when `last`."""

  every: int = 0
  steps: frozenset[int] = frozenset()
  last: bool = False

  def due(self, info: StepInfo) -> bool:
    return ((self.every > 0 and info.step % self.every == 0) or info.step in self.steps
            or (self.last and info.last))


@dataclasses.dataclass(frozen=True)
class Hook:
  fn: Callable[[StepInfo], Any]
  cadence: Cadence
  name: str
  # The goodput ledger's category of its time (bertjax.resilience.ledger; None: the step's).
  category: str | None = None


class Hooks:
  """Hooks run in the order they were added, each when its cadence says."""

  def __init__(self) -> None:
    self.hooks: list[Hook] = []

  def add(self, fn: Callable[[StepInfo], Any], *, every: int = 0, steps=(), last: bool = False,
          name: str | None = None, category: str | None = None) -> Hook:
    hook = Hook(fn, Cadence(int(every), frozenset(int(s) for s in steps), last),
                name or getattr(fn, "__name__", type(fn).__name__), category)
    self.hooks.append(hook)
    return hook

  def run(self, info: StepInfo,
          timing: Callable[[str], contextlib.AbstractContextManager] | None = None) -> None:
    """Runs the due hooks; `timing(category)` wraps a hook that has a ledger category."""
    for hook in self.hooks:
      if hook.cadence.due(info):
        if hook.category and timing:
          with timing(hook.category):
            hook.fn(info)
        else:
          hook.fn(info)

  def names(self) -> list[str]:
    return [hook.name for hook in self.hooks]


class TrainMetrics:
  """The train-metrics hook: at a log step it keeps the step's metrics on the device; they are
  read (`read_pending`, after the loop dispatched the next step) one step late, or at once
  where there is no next step to overlap with, and written with step time, tokens/s and MFU.

  Time is measured between reads: each read is taken right after the device_get returns, that
  is when the step it reads has finished on the device, so an interval is the device time of
  its steps. Excluded: evals (`exclude`) and a phase's first, compiling step (`restart`)."""

  def __init__(self, writer: MetricsWriter, peak: Any, step: int,
               on_read: Callable[[int, dict[str, float]], bool] | None = None) -> None:
    """`on_read(step, values)`: sees (and may add to) every record before it is written; True
    when the run recovers from the step's trouble itself (bertjax.resilience.policy), so a
    non-finite loss is not a divergence."""
    self.writer = writer
    self.peak = peak
    self.on_read = on_read
    self.last: dict[str, float] = {}  # the last train metrics written
    self.logged_step: int | None = None
    self._pending: StepInfo | None = None
    self.restart(step)

  def restart(self, step: int) -> None:
    """The next interval starts now, after `step`."""
    self._since, self._since_step, self._excluded = time.perf_counter(), step, 0.0

  def rewound(self, step: int) -> None:
    """The run went back to `step` (bertjax.training.recovery): a record still pending is of
    steps undone, never written."""
    self._pending = None
    self.restart(step)

  def exclude(self, seconds: float) -> None:
    """Time spent on something other than training (an eval): not step time."""
    self._excluded += seconds

  def __call__(self, info: StepInfo) -> None:
    self._pending = info
    if info.last:
      self.read_pending()

  def read_pending(self) -> None:
    """Reads and writes the pending log step's metrics, if any (idempotent)."""
    if self._pending is None:
      return
    info, self._pending = self._pending, None
    values = {k: float(v) for k, v in jax.device_get(info.metrics).items()}
    now = time.perf_counter()
    steps = info.step - self._since_step
    if steps > 0:  # none right after a compiling step
      step_time = (now - self._since - self._excluded) / steps
      values.update(step_time=step_time,
                    tokens_per_sec=info.phase.batch_size * info.phase.seq_length / step_time,
                    mfu=self.peak.mfu(info.phase.flops_per_step / step_time))
    if getattr(info.phase, "staged", False):
      # A batch ramp or a sequence-length warmup (bertjax.config.ramp): the step's batch and
      # row length, and the sequences consumed through it.
      values.update(batch_size=info.phase.batch_size, seq_length=info.phase.seq_length,
                    samples=info.phase.samples_before(info.step))
    # Corrupt dataset records this process's loader skipped (bertjax.data.records).
    corrupt = getattr(getattr(info.phase, "batches", None), "corrupt_records", 0)
    if corrupt:
      values["data_corrupt_records"] = float(corrupt)
    # The next interval starts when this step ended on the device: the write below overlaps
    # the step already queued.
    self._since, self._since_step, self._excluded = now, info.step, 0.0
    self._write(info.step, values)

  def _write(self, step: int, values: dict[str, float]) -> None:
    if not (self.on_read and self.on_read(step, values)):
      check_finite(step, values)
    self.writer.write(step, values)
    self.last, self.logged_step = values, step

  def write_final(self, info: StepInfo | None) -> None:
    """The last step's metrics when the run ends early (the data ran out): the pending ones,
    or, when that step was no log step, its metrics without timing."""
    if self._pending is not None:
      self.read_pending()
    elif info is not None and self.logged_step != info.step:
      self._write(info.step, {k: float(v) for k, v in jax.device_get(info.metrics).items()})


class FirstStepTimer:
  """The hook that times a phase's first step (compile + run) apart from the steady state."""

  def __init__(self, train_metrics: TrainMetrics, is_main: bool) -> None:
    self.train_metrics = train_metrics
    self.is_main = is_main

  def __call__(self, info: StepInfo) -> None:
    if not info.compiled:
      return
    jax.block_until_ready(info.metrics)
    if self.is_main:
      log.info("first step of phase %d (compile + run) took %.1f s", info.phase.index + 1,
               time.perf_counter() - info.started)
    self.train_metrics.restart(info.step)


class Profiler:
  """A jax.profiler trace of `num_steps` steps from `start_step` (process 0), written locally
  and mirrored to the workdir's profile/ (an object store gets it when the trace stops)."""

  def __init__(self, cfg: Any, workdir: Any, enabled: bool) -> None:
    self.start_step = int(cfg.start_step)
    self.stop_step = self.start_step + int(cfg.num_steps)
    self.enabled = enabled and self.start_step >= 0
    self._workdir = workdir
    self._mirror = None

  def maybe_start(self, step: int) -> None:
    """Before step `step` + 1 (0-based `step`): starts the trace at the start step."""
    if self.enabled and step == self.start_step and self._mirror is None:
      self._mirror = paths.LocalMirror(self._workdir / "profile")
      jax.profiler.start_trace(str(self._mirror.local))

  def stop(self, info: StepInfo) -> None:
    """The hook at the stop step; the loop also calls it when the run ends before then."""
    if self._mirror is None:
      return
    jax.block_until_ready(info.state)
    jax.profiler.stop_trace()
    self._mirror.close()
    log.info("profile of steps %d..%d written to %s", self.start_step, info.step - 1,
             self._mirror.remote)
    self._mirror = None
