"""The one training loop of every run, pre-training and fine-tuning alike.

A run's workload says what it trains on and how it is judged (bertjax.training.pretraining,
bertjax.training.finetuning); the loop does the rest for both: the workdir's lock, resume or
initialise, the jitted step, the hooks after each step (bertjax.training.hooks), then what
changes the run's course (a phase switch, a checkpoint save, an early stop, a preemption) and
the end-of-run summary. The host never waits on the device at a log step.

The guide: docs/training.md, 'The loop: workloads, step hooks and when metrics are read'.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

import jax
import ml_collections
import numpy as np
import tqdm
from etils import epath
from tqdm.contrib.logging import logging_redirect_tqdm

from bertjax import paths
from bertjax.checkpoints.train_state import (
  CheckpointWriteError,
  TrainCheckpoints,
  restore_or_initialize,
)
from bertjax.checkpoints.workdir import WorkdirLock, check_resume_config
from bertjax.config import phases, ramp
from bertjax.parallel import distributed, sharding
from bertjax.training import defaults, flops, hooks, plot
from bertjax.training.finetuning import FineTuning
from bertjax.training.metrics import MetricsWriter, summary_lines
from bertjax.training.preemption import Preemption
from bertjax.training.pretraining import Pretraining
from bertjax.training.trainer import Trainer, TrainState

log = logging.getLogger(__name__)


class Workload(Protocol):
  """What a run trains on and how it is judged (Pretraining, FineTuning)."""

  config: ml_collections.ConfigDict  # the run config, resolved
  checkpoint_items: tuple[str, ...]  # what it adds to a checkpoint (TrainCheckpoints' extras)
  stopped: bool  # it asked the run to end (an early stop)

  def prepare(self) -> None: ...  # what it reads, once the run's config is known to resume

  def batches(self, phase_config: ml_collections.ConfigDict, rows: Sequence[int]) -> Any: ...

  def initial_state(self, trainer: Trainer) -> TrainState: ...

  def add_hooks(self, step_hooks: hooks.Hooks, trainer: Trainer, writer: MetricsWriter,
                train_metrics: hooks.TrainMetrics) -> None: ...

  def evaluated_at(self, step: int) -> bool: ...

  def saved(self, state: TrainState) -> dict[str, Any]: ...

  def restore(self, checkpoints: TrainCheckpoints, step: int, trainer: Trainer) -> None: ...

  def finish(self, state: TrainState, trainer: Trainer, trained: bool) -> dict[str, Any]: ...

  def summary_lines(self, result: dict[str, Any]) -> list[str]: ...


class _TqdmStream:
  """Console lines printed above the progress bar instead of through it."""

  def __init__(self, file: TextIO) -> None:
    self.file = file

  def write(self, text: str) -> None:
    if text.strip():
      tqdm.tqdm.write(text.rstrip("\n"), file=self.file)

  def flush(self) -> None:
    pass


class _PhaseData:
  """The data iterator, batch shape and model FLOPs of the phase that step `step` trains in
  (bertjax.config.phases): a two-phase run builds a new one at the switch, and the step is
  jitted again for its batch shape at its first batch (`compiled`). With a batch ramp or a
  sequence-length warmup (bertjax.config.ramp) the iterator delivers unit batches of full rows
  for the whole run and each stage takes as many of them per step as it needs, its rows cut to
  its length (`set_stage`)."""

  def __init__(self, workload: Workload, trainer: Trainer, step: int) -> None:
    config = workload.config
    self.index = phases.phase_of(config, step)
    self.base_config = phases.config_at(config, step)
    self.ramp = ramp.from_config(self.base_config)
    self.warmup = ramp.seq_warmup_from_config(self.base_config)
    self.full_length = int(self.base_config.seq_length)  # a warmup's rows are cut from these
    self.trainer = trainer
    self.stage: tuple[int, int] | None = None
    self.set_stage(step)
    if self.ramp is None:
      self.batches = workload.batches(self.base_config, self.rows)
    else:
      unit = self.base_config.copy_and_resolve_references()
      unit.batch_size = self.ramp.unit
      self.batches = workload.batches(
          unit, distributed.local_rows(trainer.data_sharding(), self.ramp.unit))
    # Finite epochs: a row stream that runs out ends the run for every process at once.
    self.finite = (self.config.data.source == "corpus" and int(self.config.data.num_epochs) > 0
                   and not self.config.finetune.task)

  @property
  def staged(self) -> bool:
    return self.ramp is not None or self.warmup is not None

  def samples_before(self, step: int) -> int:
    """Sequences consumed by steps 0..step-1 (0-based)."""
    if self.ramp is not None:
      return self.ramp.samples_before(step)
    return step * int(self.base_config.batch_size)

  def stage_of(self, step: int) -> tuple[int, int]:
    """(ramp stage, row length) of the step with 0-based index `step`."""
    return (self.ramp.stage_index(step) if self.ramp else 0,
            self.warmup.length_at(self.samples_before(step)) if self.warmup
            else self.full_length)

  def set_stage(self, step: int) -> bool:
    """Takes the batch and row length of the stage that step `step` (0-based) trains in;
    whether they changed (the step then compiles again at its next batch)."""
    stage = self.stage_of(step)
    if stage == self.stage:
      return False
    self.stage = stage
    self.config = self.base_config
    if self.staged:
      self.config = self.base_config.copy_and_resolve_references()
      self.config.seq_length = stage[1]
    if self.ramp is not None:
      self.config.batch_size = self.ramp.stages[stage[0]].batch_size
      micro = int(self.base_config.batch_size) // int(self.base_config.grad_accum_steps)
      self.config.grad_accum_steps = ramp.accum_steps(
          int(self.config.batch_size), micro, sharding.batch_ways(self.trainer.mesh,
                                                                  self.trainer.rules))
    # Evaluation reads full rows whatever the warmup's length.
    self.eval_config = self.config
    if self.warmup is not None:
      self.eval_config = self.config.copy_and_resolve_references()
      self.eval_config.seq_length = self.full_length
    self.batch_size = int(self.config.batch_size)
    self.seq_length = int(self.config.seq_length)
    self.accum_steps = int(self.config.grad_accum_steps)
    self.units = self.batch_size // self.ramp.unit if self.ramp else 1
    trainer = self.trainer
    sharding.check_batch(self.batch_size, self.accum_steps, trainer.mesh, trainer.rules)
    # This host's rows of every global batch follow from the batch sharding (on a TPU slice
    # they interleave with other hosts' rows); the data of a row is the same wherever loaded.
    self.layout = distributed.row_layout(trainer.data_sharding(), self.batch_size)
    self.rows = distributed.local_rows(trainer.data_sharding(), self.batch_size)
    self.flops_per_step = flops.run_flops_per_step(trainer.model_config, self.config,
                                                   self.batch_size, self.seq_length)
    self.compiled = False
    return True

  def global_batch(self, trainer: Trainer, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return distributed.global_batch(local, trainer.batch_shardings, self.rows, self.batch_size)

  def next_batch(self) -> dict[str, np.ndarray] | None:
    """This host's rows of the next batch, or None when the data has run out on any host
    (finite epochs; every process gets the same answer at the same step)."""
    parts = []
    try:
      for _ in range(self.units):
        parts.append(next(self.batches))
      exhausted = False
    except StopIteration:
      exhausted = True
      if parts:  # a ramp stage's step needs every unit: the rows of a partial step are dropped
        log.info("the data ran out inside a step of %d units: the %d unit batch(es) taken are "
                 "not trained on", self.units, len(parts))
    if self.finite:
      exhausted = distributed.any_process(exhausted)
    elif exhausted:
      raise RuntimeError("the training data ended although data.num_epochs=0 (repeat forever)")
    if exhausted:
      return None
    batch = parts[0] if self.units == 1 else ramp.interleave(parts)
    if self.seq_length < self.full_length:
      batch = ramp.cut_rows(batch, self.seq_length)
    return batch

  def describe(self) -> str:
    staged = (f", ramp stage {self.stage[0] + 1} of {len(self.ramp.stages)}" if self.ramp
              else "")
    if self.seq_length < self.full_length:
      staged += f", rows cut to {self.seq_length} of {self.full_length} tokens"
    return (f"phase {self.index + 1}: batch {self.batch_size} x {self.seq_length} tokens, "
            f"{self.accum_steps} micro-batch(es){staged}")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: paths.PathLike,
                       report: TextIO | None = None) -> dict[str, Any]:
  """Runs `config` in `workdir` (a local path or an object store such as gs://): pre-training,
  or fine-tuning when `config.finetune.task` is set. Returns the last logged train metrics of a
  pre-training run, the summary of a fine-tuning run. Process 0 writes its console lines and
  the end-of-run summary to `report` (default: stdout)."""
  distributed.initialize(config.distributed)
  phases.validate(config)
  workdir = paths.path(workdir)
  is_main = jax.process_index() == 0
  lock = _lock_workdir(workdir, is_main)
  try:
    return _run(config, workdir, is_main, lock, report or sys.stdout)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() > 1:  # a collective with a dead peer: out now, in one line
      lock.release()
      distributed.abandon(e)
    raise
  finally:
    lock.release()


def _lock_workdir(workdir: epath.Path, is_main: bool) -> WorkdirLock:
  """Process 0 takes the workdir's lock; every process learns whether it could."""
  lock = WorkdirLock(workdir)
  failure = None
  if is_main:
    try:
      lock.acquire()
    except ValueError as e:
      failure = e
  if distributed.any_process(failure is not None):
    raise failure or ValueError(f"process 0 could not lock {workdir} (its message says why)")
  return lock


def _check_resume(config: ml_collections.ConfigDict, checkpoints: TrainCheckpoints,
                  choices: Sequence[defaults.Choice] = ()) -> None:
  """A resumed run's config against the one its checkpoint was written with (an "auto"
  setting this machine resolves otherwise is named as such)."""
  current = json.loads(config.to_json_best_effort())
  hints = {c.key: f"{c.line()} here; --config.{c.key}=<the checkpoint's> continues as it was"
           for c in choices}
  for step in checkpoints.resume_candidates(int(config.restore_step)):
    try:
      saved = checkpoints.saved_config(step)
    except Exception:  # noqa: BLE001 - a damaged step: the restore's fallback reports it
      continue
    check_resume_config(saved, current, step, bool(config.resume_with_changes), hints)
    return


def _run(config: ml_collections.ConfigDict, workdir: epath.Path, is_main: bool,
         lock: WorkdirLock, report: TextIO) -> dict[str, Any]:
  started = time.perf_counter()
  mesh = sharding.mesh_from_config(config)
  # The config's "auto" settings for this backend, once, the same on every process: what the
  # run computes with, in config.json and in the resume check.
  config, choices = defaults.resolve(config, mesh.devices.flat[0].platform,
                                     agree=defaults.all_processes_agree)
  if is_main:
    for choice in choices:
      log.info("%s", choice.line())
  workload: Workload = (FineTuning if config.finetune.task else Pretraining)(
      config, workdir, is_main)
  config = workload.config
  trainer = Trainer(config, mesh)
  total = int(config.num_train_steps)
  checkpoints = TrainCheckpoints(workdir, config, workload.checkpoint_items,
                                trainer.teacher.load if trainer.teacher else None)
  try:
    if checkpoints.latest_step() is not None:
      _check_resume(config, checkpoints, choices)
    if is_main:
      (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
      log.info("mesh %s on %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
               jax.process_count())
    workload.prepare()
    state, phase = _restore_or_initialize(workload, trainer, checkpoints)
  except BaseException:
    checkpoints.close()  # its background threads would outlive the error
    raise
  if int(state.step) >= total or workload.stopped:
    log.info("%s: the run already finished (step %d of %d)", workdir, int(state.step), total)
    phase.batches.close()
    checkpoints.close()
    result = workload.finish(state, trainer, trained=False)
    if is_main:  # an early stop ended the run where it stopped
      _print_summary(report, workdir, int(state.step),
                     int(state.step) if workload.stopped else total, trainer,
                     plotted=(workdir / plot.PLOT_NAME).exists(),
                     extra=[*(f"  {c.line()}" for c in choices),
                            *workload.summary_lines(result)])
    return result

  # MFU is against the peak of the dtype the model's matmuls run in.
  peak = flops.run_peak(trainer.model_config.dtype)
  if is_main:
    log.info("%s; model FLOPs/step %.3g; %s", phase.describe(), phase.flops_per_step,
             peak.describe())
    log.info("%s", phase.layout.summary())
    if phase.ramp is not None:
      log.info("batch ramp, %d stages (each compiles once):\n  %s", len(phase.ramp.stages),
               "\n  ".join(phase.ramp.table(phase.full_length)))
    if phase.warmup is not None:
      log.info("sequence-length warmup: rows of %s tokens (each length compiles once), one "
               "more step of the increment every %.0f sequences", phase.warmup.lengths(),
               phase.warmup.per_increment)

  # A progress bar only where a person watches; log files get the periodic lines alone.
  progress = (tqdm.tqdm(total=total, initial=int(state.step), unit="step", dynamic_ncols=True,
                        file=sys.stderr) if is_main and report.isatty() else None)
  writer = MetricsWriter(workdir, total, enabled=is_main,
                         stream=_TqdmStream(report) if progress else report, config=config)
  # Log records too go above the progress bar while it is drawn, not into it.
  quiet_bar = contextlib.ExitStack()
  if progress:
    quiet_bar.enter_context(logging_redirect_tqdm())
  watchdog = distributed.StepWatchdog(float(config.distributed.step_timeout_s))
  step = first_step = saved_step = int(state.step)
  train_metrics = hooks.TrainMetrics(writer, peak, step)
  profiler = hooks.Profiler(config.profile, workdir, enabled=is_main)
  step_hooks = _step_hooks(config, train_metrics, profiler, progress, watchdog, lock, is_main)
  workload.add_hooks(step_hooks, trainer, writer, train_metrics)

  def save(at: int) -> None:
    checkpoints.save(at, state, phase.batches, config, workload.saved(state))

  info = None  # the last step's StepInfo
  preemption = Preemption(checkpoints)
  try:
    while step < total:
      profiler.maybe_start(step)
      local = phase.next_batch()
      if local is None:
        # Finite epochs: the data ran out, on every process at the same step (next_batch).
        total = step
        log.info("the training data ran out (data.num_epochs=%d) after step %d: the run ends "
                 "here on every process", int(config.data.num_epochs), step)
        train_metrics.write_final(info)
        if saved_step != step and step > first_step:
          save(step)
        break
      # The step is (re)jitted for the phase's batch shape when its first batch arrives.
      compiling = not phase.compiled
      if compiling:
        trainer.compile_step(local, phase.accum_steps)
        phase.compiled = True
      begun = time.perf_counter()
      state, metrics = _dispatch(trainer, phase, state, local)
      step += 1
      # The previous step's metrics, if it was a log step, while the device runs this one.
      train_metrics.read_pending()
      info = hooks.StepInfo(step, total, state, metrics, phase, compiling, begun)
      step_hooks.run(info)
      if step < total and phases.phase_of(config, step) != phase.index:
        # Switch before any save: a checkpoint of this step holds the new phase's position.
        phase = _switch_phase(workload, trainer, phase, step, train_metrics, is_main)
      elif step < total and phase.staged and phase.stage_of(step) != phase.stage:
        train_metrics.read_pending()  # the last record of the old stage's batch
        phase.set_stage(step)
        if is_main:
          log.info("step %d: next stage: %s; model FLOPs/step %.3g", step,
                   phase.describe(), phase.flops_per_step)
      preempted = preemption.requested(step)
      if (preempted or workload.stopped
          or checkpoints.due(step, total, workload.evaluated_at(step))):
        # Counted in step time: what a save costs the run is part of its throughput. A
        # diverged step is never saved: its pending metrics (NaN check) are read first.
        train_metrics.read_pending()
        save(step)
        saved_step = step
      if preempted:
        checkpoints.wait()
        log.warning("stopped at step %d on %s; checkpoint committed, exiting (the same command "
                    "resumes)", step, preemption.reason)
        break
      if workload.stopped:
        total = step
        break
    train_metrics.read_pending()  # nothing is left pending whatever ended the loop
    if info is not None:
      profiler.stop(info)  # a run that ended inside the profiled steps
    checkpoints.wait()
  finally:
    preemption.uninstall()
    phase.batches.close()
    checkpoints.close()
    watchdog.stop()
    # Drawn whatever ended the run (the curves of a diverged run are the ones to look at),
    # except a failed checkpoint write: the store is full or gone, and its one error line says so.
    plotted = (False if isinstance(sys.exc_info()[1], CheckpointWriteError)
               else writer.plot(final=True))
    writer.close()
    if progress:
      progress.close()
    quiet_bar.close()
  result = train_metrics.last
  if step >= total:
    result = workload.finish(state, trainer, trained=True) or result
  if is_main:
    _print_summary(report, workdir, step, total, trainer, plotted, time.perf_counter() - started,
                   [*(f"  {c.line()}" for c in choices), *workload.summary_lines(result)])
  return result


def _restore_or_initialize(workload: Workload, trainer: Trainer, checkpoints: TrainCheckpoints
                           ) -> tuple[TrainState, _PhaseData]:
  """The state to train on from and the data of its phase: the latest (or `restore_step`)
  checkpoint with the data position and the workload's own items, or a new state."""
  config = workload.config
  # The data state in a checkpoint belongs to the phase of the step it resumes at.
  candidates = checkpoints.resume_candidates(int(config.restore_step))
  phase = _PhaseData(workload, trainer, candidates[0] if candidates else 0)
  state, restored = restore_or_initialize(checkpoints, trainer.abstract_state(), phase.batches,
                                          int(config.restore_step),
                                          lambda: workload.initial_state(trainer))
  if phases.phase_of(config, int(state.step)) != phase.index:
    # A damaged latest step made the restore fall back across the phase switch.
    phase.batches.close()
    phase = _PhaseData(workload, trainer, int(state.step))
    state, restored = checkpoints.restore(trainer.abstract_state(), phase.batches,
                                          int(state.step))
  # A ramp's unit stream is one across stages: a fallback to an earlier stage needs only its
  # batch.
  phase.set_stage(int(state.step))
  if restored is not None:
    workload.restore(checkpoints, restored, trainer)
  return state, phase


def _dispatch(trainer: Trainer, phase: _PhaseData, state: TrainState,
              local: dict[str, np.ndarray]) -> tuple[TrainState, dict[str, jax.Array]]:
  """Places this host's rows of the batch on the devices and dispatches the step, without
  waiting for it. Batch and state are on the devices before the step is called: inside it an
  implicit transfer (a NumPy array or a Python scalar reaching a jitted function, a device value
  read by float()) is an error rather than a silent copy or a sync with the device."""
  # Placed explicitly, outside the guard: JAX (0.10) counts make_array_from_callback's
  # per-device copies as implicit transfers.
  batch = phase.global_batch(trainer, local)
  with jax.transfer_guard("disallow"):
    return trainer.step(state, batch)


def _step_hooks(config: ml_collections.ConfigDict, train_metrics: hooks.TrainMetrics,
                profiler: hooks.Profiler, progress: tqdm.tqdm | None,
                watchdog: distributed.StepWatchdog, lock: WorkdirLock,
                is_main: bool) -> hooks.Hooks:
  """What runs after every step, in this order: bookkeeping, the first step's timing, the
  profile's end, train metrics (the workload adds its evaluation after these)."""
  step_hooks = hooks.Hooks()

  def alive(info: hooks.StepInfo) -> None:
    watchdog.tick()
    lock.heartbeat()
    if progress:
      progress.update(1)

  step_hooks.add(alive, every=1)
  step_hooks.add(hooks.FirstStepTimer(train_metrics, is_main), every=1, name="first_step")
  if profiler.enabled:
    step_hooks.add(profiler.stop, steps=[profiler.stop_step], name="profile_stop")
  step_hooks.add(train_metrics, every=int(config.log_every), last=True, name="train_metrics")
  return step_hooks


def _switch_phase(workload: Workload, trainer: Trainer, phase: _PhaseData, step: int,
                  train_metrics: hooks.TrainMetrics, is_main: bool) -> _PhaseData:
  """The data of the phase that starts after `step`; its step compiles at its first batch."""
  train_metrics.read_pending()  # the old phase's last record, before the new one compiles
  phase.batches.close()
  phase = _PhaseData(workload, trainer, step)
  if is_main:
    log.info("step %d: switching to %s; model FLOPs/step %.3g", step, phase.describe(),
             phase.flops_per_step)
  return phase


def _print_summary(report: TextIO, workdir: epath.Path, step: int, total: int,
                   trainer: Trainer, plotted: bool, wall_seconds: float | None = None,
                   extra: Sequence[str] = ()) -> None:
  """The end-of-run summary (process 0) and the workload's `extra` lines: never fails the run
  it describes."""
  metrics_path = workdir / "metrics.jsonl"  # uploaded at every write when remote
  try:
    records = plot.read_metrics(metrics_path) if metrics_path.exists() else {}
    lines = summary_lines(str(workdir), records, step, total, trainer.model_config.family_record,
                          wall_seconds, params=(workdir / "params").exists(), plotted=plotted)
  except Exception as e:  # noqa: BLE001 - a summary is not worth a failed run
    log.warning("could not summarise the run from %s: %s", metrics_path, e)
    return
  print("\n".join([*lines, *extra]), file=report, flush=True)
