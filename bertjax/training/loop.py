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
from bertjax.checkpoints.workdir import WorkdirLock
from bertjax.config import phases
from bertjax.parallel import distributed, sharding
from bertjax.resilience.faults import Faults
from bertjax.resilience.ledger import Ledger, read_attempts
from bertjax.resilience.policy import Policy
from bertjax.resilience.replicas import IntegrityCheck
from bertjax.resilience.watchdog import HangWatchdog, SlowHosts, clear_exit
from bertjax.training import defaults, hooks, plot, run_start
from bertjax.training.finetuning import FineTuning
from bertjax.training.metrics import MetricsWriter, print_summary
from bertjax.training.phase_data import PhaseData
from bertjax.training.preemption import Preemption
from bertjax.training.pretraining import Pretraining
from bertjax.training.recovery import Recovery
from bertjax.training.shutdown import Shutdown
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
  lock = run_start.lock_workdir(workdir, is_main)
  try:
    return _run(config, workdir, is_main, lock, report or sys.stdout)
  except jax.errors.JaxRuntimeError as e:
    if jax.process_count() > 1:  # a collective with a dead peer: out now, in one line
      lock.release()
      distributed.abandon(e)
    raise
  finally:
    lock.release()


def _run(config: ml_collections.ConfigDict, workdir: epath.Path, is_main: bool,
         lock: WorkdirLock, report: TextIO) -> dict[str, Any]:
  started = time.perf_counter()
  mesh = sharding.mesh_from_config(config)
  # The config's "auto" settings for this backend, once, the same on every process: what the
  # run computes with, in config.json and in the resume check.
  config, choices = defaults.resolve(config, mesh.devices.flat[0].platform,
                                     agree=defaults.all_processes_agree,
                                     recorded=run_start.recorded_settings(workdir, config))
  if is_main:
    for choice in choices:
      log.info("%s", choice.line())
  # Where this attempt's time goes, from the process's start (bertjax.resilience.ledger).
  ledger = Ledger(workdir, run_start.attempt_number(workdir), enabled=is_main)
  if is_main:
    clear_exit(workdir)
  workload: Workload = (FineTuning if config.finetune.task else Pretraining)(
      config, workdir, is_main)
  config = workload.config
  trainer = Trainer(config, mesh)
  family = trainer.model_config.family_record
  total = int(config.num_train_steps)
  checkpoints = TrainCheckpoints(workdir, config, workload.checkpoint_items,
                                trainer.teacher.load if trainer.teacher else None)
  faults = Faults.from_config(config, ledger.attempt)
  policy = Policy(config, workdir, is_main, ledger)
  recovery = Recovery(config, workload, trainer, checkpoints, policy, ledger, faults, _dispatch)
  integrity = IntegrityCheck(config.resilience, trainer, lambda m: Trainer(config, m), ledger,
                             policy.record)
  try:
    resuming = checkpoints.latest_step() is not None
    if resuming:
      run_start.check_resume(config, checkpoints, choices)
    if is_main:
      (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
      log.info("mesh %s on %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
               jax.process_count())
    workload.prepare()
    with ledger.timing("restore" if resuming else "startup"):
      state, phase = _restore_or_initialize(workload, trainer, checkpoints)
      ledger.step = int(state.step)
      ledger.restored_step = ledger.step if resuming else None
      recovery.resumed(phase, ledger.step)
      policy.resumed(state)
  except BaseException:
    # Its background threads would outlive the error, which stands.
    with contextlib.suppress(CheckpointWriteError):
      checkpoints.close()
    raise
  if int(state.step) >= total or workload.stopped:
    log.info("%s: the run already finished (step %d of %d)", workdir, int(state.step), total)
    phase.batches.close()
    checkpoints.close()
    result = workload.finish(state, trainer, trained=False)
    if is_main:  # an early stop ended the run where it stopped
      print_summary(report, workdir, int(state.step),
                    int(state.step) if workload.stopped else total, family,
                    plotted=(workdir / plot.PLOT_NAME).exists(),
                    extra=[*(f"  {c.line()}" for c in choices),
                           *workload.summary_lines(result)])
    return result

  # MFU is against the peak of the dtype the model's matmuls run in.
  peak = run_start.run_peak(workdir, trainer.model_config.dtype, resuming, is_main)
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
  r = config.resilience
  watchdog = HangWatchdog(ledger, workdir, float(config.distributed.step_timeout_s),
                          float(r.hang_factor), float(r.hang_floor_s))
  slow_hosts = SlowHosts(float(r.slow_host_fraction), ledger)
  earlier_attempts = read_attempts(workdir)[:ledger.attempt - 1]

  def on_read(at: int, values: dict[str, float]) -> bool:
    """Every train record as it is read: the guard's alarm, slow hosts, goodput so far."""
    trouble = policy.observe(at, values)
    slow_hosts.check(values.get("step_time", 0.0))
    values["goodput"] = ledger.goodput(earlier_attempts)
    ledger.flush()
    return trouble

  step = first_step = saved_step = int(state.step)
  train_metrics = hooks.TrainMetrics(writer, peak, step, on_read)
  profiler = hooks.Profiler(config.profile, workdir, enabled=is_main)
  step_hooks = _step_hooks(config, train_metrics, profiler, progress, watchdog, lock, is_main)
  workload.add_hooks(step_hooks, trainer, writer, train_metrics)

  def save(at: int) -> None:
    with ledger.timing("checkpoint"):
      checkpoints.save(at, state, phase.batches, config, workload.saved(state))
    ledger.flush()

  info = None  # the last step's StepInfo
  preemption = Preemption(checkpoints)
  interval, last_dispatch = 0.0, time.monotonic()
  try:
    watchdog.start()
    while step < total:
      profiler.maybe_start(step)
      own_began = time.monotonic()
      ledger.switch("data_wait")
      local = recovery.next_batch(phase, step + 1)
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
      ledger.switch("compile" if compiling else "productive")
      if compiling:
        if faults:
          faults.delay_compile()
        trainer.compile_step(local, phase.accum_steps)
        phase.compiled = True
      if faults:
        state = faults.flip(state, step + 1)
        faults.before_step(step + 1, interval)
      begun = time.perf_counter()
      state, metrics = _dispatch(trainer, phase, state, local)
      now = time.monotonic()
      slow_hosts.add(now - own_began)
      interval, last_dispatch = now - last_dispatch, now
      step += 1
      ledger.step = step
      if not compiling:
        ledger.steps += 1
        slow_hosts.step()
      # The previous step's metrics, if it was a log step, while the device runs this one.
      train_metrics.read_pending()
      info = hooks.StepInfo(step, total, state, metrics, phase, compiling, begun)
      step_hooks.run(info, ledger.timing)
      ledger.switch("productive")
      if faults:
        faults.after_step(step)
      integrity.after_step(state, step, phase, local)
      due = checkpoints.due(step, total, workload.evaluated_at(step))
      if policy.enabled and due and train_metrics.logged_step != step:
        # A step about to be saved is read first: trouble is never saved.
        train_metrics.read_pending()
        policy.observe(step, {k: float(v) for k, v in jax.device_get(metrics).items()})
      if policy.trouble is not None:
        state, phase, step = recovery.recover(state, phase, step)
        saved_step = step
        train_metrics.rewound(step)
        watchdog.tick(steady=False)
        if progress:
          progress.reset(total)
          progress.update(step)
        continue
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
      if preempted or workload.stopped or due:
        # Counted in step time: what a save costs the run is part of its throughput. A
        # diverged step is never saved: its pending metrics (NaN check) are read first.
        train_metrics.read_pending()
        save(step)
        saved_step = step
      if preempted:
        with ledger.timing("checkpoint"):
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
    with ledger.timing("checkpoint"):
      checkpoints.wait()
  finally:
    ledger.switch("shutdown")
    preemption.uninstall()
    shutdown = Shutdown()  # each part runs whatever the one before raised
    shutdown.run(phase.batches.close)
    shutdown.run(checkpoints.close)
    watchdog.stop()
    # Drawn whatever ended the run (the curves of a diverged run are the ones to look at),
    # except a failed checkpoint write: the store is full or gone, and its one error line says so.
    plotted = False if shutdown.write_failed else shutdown.run(writer.plot, final=True)
    shutdown.run(writer.close)
    if progress:
      shutdown.run(progress.close)
    shutdown.run(quiet_bar.close)
    shutdown.run(ledger.flush)
    error = shutdown.error()
    if error is not None:
      raise error
  result = train_metrics.last
  if step >= total:
    result = workload.finish(state, trainer, trained=True) or result
  if is_main:
    goodput = ledger.goodput(earlier_attempts)
    print_summary(
        report, workdir, step, total, family, plotted, time.perf_counter() - started,
        [*(f"  {c.line()}" for c in choices), *workload.summary_lines(result),
         f"  goodput      {100 * goodput:.1f}% of the wall clock was training steps "
         f"(bertjax goodput {workdir})"])
  ledger.flush()
  return result


def _restore_or_initialize(workload: Workload, trainer: Trainer, checkpoints: TrainCheckpoints
                           ) -> tuple[TrainState, PhaseData]:
  """The state to train on from and the data of its phase: the latest (or `restore_step`)
  checkpoint with the data position and the workload's own items, or a new state."""
  config = workload.config
  # The data state in a checkpoint belongs to the phase of the step it resumes at.
  candidates = checkpoints.resume_candidates(int(config.restore_step))
  phase = PhaseData(workload, trainer, candidates[0] if candidates else 0)
  state, restored = restore_or_initialize(checkpoints, trainer.abstract_state(), phase.batches,
                                          int(config.restore_step),
                                          lambda: workload.initial_state(trainer))
  if phases.phase_of(config, int(state.step)) != phase.index:
    # A damaged latest step made the restore fall back across the phase switch.
    phase.batches.close()
    phase = PhaseData(workload, trainer, int(state.step))
    state, restored = checkpoints.restore(trainer.abstract_state(), phase.batches,
                                          int(state.step))
  # A ramp's unit stream is one across stages: a fallback to an earlier stage needs only its
  # batch.
  phase.set_stage(int(state.step))
  if restored is not None:
    workload.restore(checkpoints, restored, trainer)
  return state, phase


def _dispatch(trainer: Trainer, phase: PhaseData, state: TrainState,
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
                watchdog: HangWatchdog, lock: WorkdirLock,
                is_main: bool) -> hooks.Hooks:
  """What runs after every step, in this order: bookkeeping, the first step's timing, the
  profile's end, train metrics (the workload adds its evaluation after these)."""
  step_hooks = hooks.Hooks()

  def alive(info: hooks.StepInfo) -> None:
    watchdog.tick(steady=not info.compiled)
    lock.heartbeat()
    if progress:
      progress.update(1)

  step_hooks.add(alive, every=1)
  step_hooks.add(hooks.FirstStepTimer(train_metrics, is_main), every=1, name="first_step")
  if profiler.enabled:
    step_hooks.add(profiler.stop, steps=[profiler.stop_step], name="profile_stop")
  step_hooks.add(train_metrics, every=int(config.log_every), last=True, name="train_metrics")
  return step_hooks


def _switch_phase(workload: Workload, trainer: Trainer, phase: PhaseData, step: int,
                  train_metrics: hooks.TrainMetrics, is_main: bool) -> PhaseData:
  """The data of the phase that starts after `step`; its step compiles at its first batch."""
  train_metrics.read_pending()  # the old phase's last record, before the new one compiles
  phase.batches.close()
  phase = PhaseData(workload, trainer, step)
  if is_main:
    log.info("step %d: switching to %s; model FLOPs/step %.3g", step, phase.describe(),
             phase.flops_per_step)
  return phase
