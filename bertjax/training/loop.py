"""`bertjax train`: the outer loop around the jitted step — data, logging, eval, profiling.

Each iteration loads a batch, dispatches the step, runs the step hooks (bertjax/hooks.py:
bookkeeping, first-step timing, profile, train metrics, eval) and then what changes the run's
course: a phase switch, a checkpoint save, a preemption. The host never waits on the device at
a log step (its metrics are read after the next step is dispatched); it waits at evals, saves,
a phase's first step and the end (async dispatch keeps the host building the next batch while
the device runs this one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm
from etils import epath
from flax.traverse_util import flatten_dict
from tqdm.contrib.logging import logging_redirect_tqdm

from bertjax.checkpoints import weights as weights_lib
from bertjax.models.params import shape_mismatches
from bertjax import paths

from bertjax.checkpoints import params as checkpoint

from bertjax.parallel import distributed, sharding

from bertjax.training import flops, hooks, plot

from bertjax.config import phases
from bertjax.data import make_batches
from bertjax.data.prepare import ensure_dataset
from bertjax.training.metrics import MetricsWriter, summary_lines
from bertjax.training.trainer import Trainer, TrainState
from bertjax.checkpoints.train_state import CheckpointWriteError, TrainCheckpoints
from bertjax.checkpoints.workdir import WorkdirLock, check_resume_config

log = logging.getLogger(__name__)


class _TqdmStream:
  """Console lines printed above the progress bar instead of through it."""

  def write(self, text: str) -> None:
    if text.strip():
      tqdm.tqdm.write(text.rstrip("\n"))

  def flush(self) -> None:
    pass


def _predictions_per_seq(config: ml_collections.ConfigDict) -> int | None:
  return None if config.objective == "causal_lm" else int(config.max_predictions)


class _PhaseData:
  """The data iterator, batch shape and model FLOPs of the phase that step `step` trains in
  (bertjax.config.phases): a two-phase run builds a new one at the switch, and the step is jitted
  again for its batch shape at its first batch (`compiled`)."""

  def __init__(self, config: ml_collections.ConfigDict, trainer: Trainer, dataset: str,
               step: int) -> None:
    self.index = phases.phase_of(config, step)
    self.config = phases.config_at(config, step)
    self.batch_size = int(self.config.batch_size)
    self.seq_length = int(self.config.seq_length)
    self.accum_steps = int(self.config.grad_accum_steps)
    sharding.check_batch(self.batch_size, self.accum_steps, trainer.mesh, trainer.rules)
    # This host's rows of every global batch follow from the batch sharding (on a TPU slice
    # they interleave with other hosts' rows); the data of a row is the same wherever loaded.
    self.layout = distributed.row_layout(trainer.data_sharding(), self.batch_size)
    self.rows = distributed.local_rows(trainer.data_sharding(), self.batch_size)
    self.batches = make_batches(self.config, "train", self.rows, dataset)
    # Finite epochs: a row stream that runs out ends the run for every process at once.
    self.finite = self.config.data.source == "corpus" and int(self.config.data.num_epochs) > 0
    self.flops_per_step = flops.train_flops_per_step(
        trainer.model_config, self.batch_size, self.seq_length,
        _predictions_per_seq(self.config))
    self.compiled = False

  def global_batch(self, trainer: Trainer, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return distributed.global_batch(local, trainer.batch_shardings, self.rows, self.batch_size)

  def next_batch(self) -> dict[str, np.ndarray] | None:
    """This host's rows of the next batch, or None when the data has run out on any host
    (finite epochs; every process gets the same answer at the same step)."""
    try:
      local, exhausted = next(self.batches), False
    except StopIteration:
      local, exhausted = None, True
    if self.finite:
      exhausted = distributed.any_process(exhausted)
    elif exhausted:
      raise RuntimeError("the training data ended although data.num_epochs=0 (repeat forever)")
    return None if exhausted else local

  def describe(self) -> str:
    return (f"phase {self.index + 1}: batch {self.batch_size} x {self.seq_length} tokens, "
            f"{self.accum_steps} micro-batch(es)")


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: paths.PathLike) -> dict[str, Any]:
  """Trains `config.num_train_steps` steps in `workdir` (a local path or an object store such
  as gs://); returns the last logged train metrics."""
  distributed.initialize(config.distributed)
  phases.validate(config)
  workdir = paths.path(workdir)
  is_main = jax.process_index() == 0
  lock = _lock_workdir(workdir, is_main)
  try:
    return _train(config, workdir, is_main, lock)
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


def _check_resume(config: ml_collections.ConfigDict, checkpoints: TrainCheckpoints) -> None:
  """A resumed run's config against the one its checkpoint was written with."""
  requested = int(config.restore_step)
  steps = [requested] if requested >= 0 else checkpoints.steps()[::-1]
  current = json.loads(config.to_json_best_effort())
  for step in steps:
    try:
      saved = checkpoints.saved_config(step)
    except Exception:  # noqa: BLE001 - a damaged step: the restore's fallback reports it
      continue
    check_resume_config(saved, current, step, bool(config.resume_with_changes))
    return


def _train(config: ml_collections.ConfigDict, workdir: epath.Path, is_main: bool,
           lock: WorkdirLock) -> dict[str, Any]:
  started = time.perf_counter()
  mesh = sharding.mesh_from_config(config)
  trainer = Trainer(config, mesh)
  total = int(config.num_train_steps)
  checkpoints = TrainCheckpoints(workdir, config)
  if checkpoints.latest_step() is not None:
    _check_resume(config, checkpoints)
  if is_main:
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    log.info("mesh %s on %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
             jax.process_count())

  dataset = ""
  if config.data.source == "corpus":
    # Built on first use by process 0 (small corpora; pod runs set data.dataset), the others
    # read it once it is there (the workdir is shared by all hosts).
    if is_main or config.data.dataset:
      dataset = ensure_dataset(config, workdir)
    distributed.barrier("dataset ready")
    if not dataset:
      dataset = ensure_dataset(config, workdir, build=False)
  # The data state in a checkpoint belongs to the phase of the step it resumes at.
  requested = int(config.restore_step)
  resume_at = requested if requested >= 0 else (checkpoints.latest_step() or 0)
  phase = _PhaseData(config, trainer, dataset, resume_at)
  state = _initial_state(config, trainer, checkpoints, phase.batches)
  if phases.phase_of(config, int(state.step)) != phase.index:
    # A damaged latest step made the restore fall back across the phase switch.
    phase.batches.close()
    phase = _PhaseData(config, trainer, dataset, int(state.step))
    state, _ = checkpoints.restore(trainer.abstract_state(), phase.batches, int(state.step))
  if int(state.step) >= total:
    log.info("%s: the run already finished (step %d of %d)", workdir, int(state.step), total)
    _write_final_params(workdir, state, trainer, dataset, is_main)
    phase.batches.close()
    checkpoints.close()
    if is_main:
      _print_summary(workdir, int(state.step), total, trainer,
                     plotted=(workdir / plot.PLOT_NAME).exists())
    return {}

  # MFU is against the peak of the dtype the model's matmuls run in.
  peak = flops.run_peak(trainer.model_config.dtype)
  if is_main:
    log.info("%s; model FLOPs/step %.3g; %s", phase.describe(), phase.flops_per_step,
             peak.describe())
    log.info("%s", phase.layout.summary())

  # A progress bar only where a person watches; log files get the periodic lines alone.
  progress = (tqdm.tqdm(total=total, initial=int(state.step), unit="step", dynamic_ncols=True)
              if is_main and sys.stdout.isatty() else None)
  writer = MetricsWriter(workdir, total, enabled=is_main,
                         stream=_TqdmStream() if progress else None)
  # Log records too go above the progress bar while it is drawn, not into it.
  quiet_bar = contextlib.ExitStack()
  if progress:
    quiet_bar.enter_context(logging_redirect_tqdm())
  watchdog = distributed.StepWatchdog(float(config.distributed.step_timeout_s))
  step = first_step = saved_step = int(state.step)
  train_metrics = hooks.TrainMetrics(writer, peak, step)
  profiler = hooks.Profiler(config.profile, workdir, enabled=is_main)
  step_hooks = _step_hooks(config, trainer, dataset, writer, train_metrics, profiler,
                           progress, watchdog, lock, is_main)
  info = None  # the last step's StepInfo
  preemption = _Preemption(checkpoints)
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
          checkpoints.save(step, state, phase.batches, config)
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
        phase = _switch_phase(config, trainer, dataset, phase, step, train_metrics, is_main)
      preempted = preemption.requested(step)
      if preempted or checkpoints.due(step, total):
        # Counted in step time: what a save costs the run is part of its throughput. A
        # diverged step is never saved: its pending metrics (NaN check) are read first.
        train_metrics.read_pending()
        checkpoints.save(step, state, phase.batches, config)
        saved_step = step
      if preempted:
        checkpoints.wait()
        log.warning("stopped at step %d on %s; checkpoint committed, exiting (the same command "
                    "resumes)", step, preemption.reason)
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
  if step >= total:
    _write_final_params(workdir, state, trainer, dataset, is_main, replace=True)
  if is_main:
    _print_summary(workdir, step, total, trainer, plotted, time.perf_counter() - started)
  return train_metrics.last


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


def _step_hooks(config: ml_collections.ConfigDict, trainer: Trainer, dataset: str,
                writer: MetricsWriter, train_metrics: hooks.TrainMetrics,
                profiler: hooks.Profiler, progress: tqdm.tqdm | None,
                watchdog: distributed.StepWatchdog, lock: WorkdirLock,
                is_main: bool) -> hooks.Hooks:
  """What runs after every step, in this order: bookkeeping, the first step's timing, the
  profile's end, train metrics, eval."""
  step_hooks = hooks.Hooks()

  def alive(info: hooks.StepInfo) -> None:
    watchdog.tick()
    lock.heartbeat()
    if progress:
      progress.update(1)

  def evaluate_step(info: hooks.StepInfo) -> None:
    # This step's train record comes first; the eval waits for the step anyway.
    train_metrics.read_pending()
    jax.block_until_ready(info.metrics)
    eval_start = time.perf_counter()
    phase = info.phase
    eval_batches = make_batches(phase.config, "eval", phase.rows, dataset)
    try:
      writer.write(info.step, evaluate(trainer, info.state, (phase.global_batch(
          trainer, next(eval_batches)) for _ in iter(int, 1)), int(config.eval_steps)),
                   prefix="eval")
    finally:
      eval_batches.close()
    writer.plot()
    # Time spent evaluating is not training time: keep it out of step time and tokens/s.
    train_metrics.exclude(time.perf_counter() - eval_start)

  step_hooks.add(alive, every=1)
  step_hooks.add(hooks.FirstStepTimer(train_metrics, is_main), every=1, name="first_step")
  if profiler.enabled:
    step_hooks.add(profiler.stop, steps=[profiler.stop_step], name="profile_stop")
  step_hooks.add(train_metrics, every=int(config.log_every), last=True, name="train_metrics")
  if config.eval_every:
    step_hooks.add(evaluate_step, every=int(config.eval_every), last=True, name="eval")
  return step_hooks


def _switch_phase(config: ml_collections.ConfigDict, trainer: Trainer, dataset: str,
                  phase: _PhaseData, step: int, train_metrics: hooks.TrainMetrics,
                  is_main: bool) -> _PhaseData:
  """The data of the phase that starts after `step`; its step compiles at its first batch."""
  train_metrics.read_pending()  # the old phase's last record, before the new one compiles
  phase.batches.close()
  phase = _PhaseData(config, trainer, dataset, step)
  if is_main:
    log.info("step %d: switching to %s; model FLOPs/step %.3g", step, phase.describe(),
             phase.flops_per_step)
  return phase


def _print_summary(workdir: epath.Path, step: int, total: int, trainer: Trainer,
                   plotted: bool, wall_seconds: float | None = None) -> None:
  """The end-of-run summary on stdout (process 0): never fails the run it describes."""
  metrics_path = workdir / "metrics.jsonl"  # uploaded at every write when remote
  try:
    records = plot.read_metrics(metrics_path) if metrics_path.exists() else {}
    lines = summary_lines(str(workdir), records, step, total, trainer.model_config.family,
                          wall_seconds, params=(workdir / "params").exists(), plotted=plotted)
  except Exception as e:  # noqa: BLE001 - a summary is not worth a failed run
    log.warning("could not summarise the run from %s: %s", metrics_path, e)
    return
  print("\n".join(lines), flush=True)


def _initial_state(config: ml_collections.ConfigDict, trainer: Trainer,
                   checkpoints: TrainCheckpoints, train_batches) -> TrainState:
  """The latest (or `restore_step`) checkpoint with the data position, or a fresh state,
  optionally with the weights of `init_from`."""
  latest = checkpoints.latest_step()
  if latest is not None:
    requested = None if int(config.restore_step) < 0 else int(config.restore_step)
    state, step = checkpoints.restore(trainer.abstract_state(), train_batches, requested)
    later = [s for s in checkpoints.steps() if s > step]
    if later:
      # Training on from an earlier step rewrites history: the later steps are gone (and a
      # damaged step in the way would stop the new saves).
      why = (f"restore_step={step}" if requested is not None else
             f"the later step(s) could not be restored; resuming from step {step}")
      log.warning("%s: deleting the later checkpoints %s", why, later)
      for s in later:
        checkpoints.manager.delete(s)
    log.info("resumed from %s step %d", checkpoints.directory, step)
    return state
  if int(config.restore_step) >= 0:
    raise ValueError(f"restore_step={config.restore_step} but {checkpoints.directory} holds "
                     "no checkpoint")
  state = trainer.init_state(int(config.seed))
  if config.init_from:
    state = start_from(config.init_from, trainer, state)
  return state


def start_from(path: str, trainer: Trainer, state: TrainState) -> TrainState:
  """`state` with the weights of `init_from` (params-only, fine-tuned, workdir or Hugging
  Face; local or an object store) in the trainer's shardings; what is not loaded follows
  from the model (`Trainer.with_weights`)."""
  source = paths.path(path)
  if (source / "model.json").is_file() and not (source / weights_lib.FINETUNE_FILE).is_file():
    saved = checkpoint.abstract_params_of(checkpoint.load_model_config(source))
    if not shape_mismatches(flatten_dict(saved, sep="/"),
                                       flatten_dict(state.params, sep="/"), "model"):
      # The same model: restored straight into its shardings, no host copy (pod scale).
      params, _ = checkpoint.load_params(source, trainer.state_shardings.params)
      log.info("initialised the parameters from %s", path)
      return state.replace(params=params)
  weights = weights_lib.load_weights(path, scan_layers=trainer.model_config.scan_layers)
  state, fresh, dropped = trainer.with_weights(state, weights.params, f"init_from={path}")
  log.info("initialised the parameters from %s%s%s", weights.source,
           f"; fresh: {', '.join(fresh)}" if fresh else "",
           f"; not loaded (the model has no such head): {', '.join(dropped)}" if dropped else "")
  return state


def _write_final_params(workdir: epath.Path, state: TrainState, trainer: Trainer,
                        dataset: str, is_main: bool, replace: bool = False) -> None:
  """The product of the run: params-only, what `bertjax export` and fine-tuning start from.
  `replace`: this invocation trained to the end (perhaps again, from an earlier step)."""
  existed = (workdir / "params").exists()
  # Every process looks before any process writes: save_params creates the directory, and a
  # process that looked after a faster peer began saving would take the replace branch alone
  # and deadlock the barriers (seen in CI with 2 processes).
  distributed.barrier("final params checked")
  if existed:
    if not replace:
      return
    if is_main:
      (workdir / "params").rmtree()
    distributed.barrier("final params replaced")
  params_dir = checkpoint.save_params(workdir / "params", state.params, trainer.model_config)
  if is_main and dataset:
    # The ids mean nothing without the tokenizer: it travels with the parameters.
    paths.copy_tree(paths.path(dataset) / "tokenizer", params_dir / "tokenizer")
  if is_main:
    log.info("final parameters written to %s", params_dir)


class _Preemption:
  """SIGTERM (how TPU VMs announce preemption) or Ctrl-C: finish the step, save, exit 0.

  One process: a Python handler sets a flag; a second signal while saving changes nothing
  (Orbax commits a step atomically, so even a kill leaves the previous step intact). Several
  processes: JAX's preemption sync point, so that every process stops at the same step."""

  def __init__(self, checkpoints: TrainCheckpoints):
    self._checkpoints = checkpoints
    self.reason = ""
    self._previous = {}
    self._multi = jax.process_count() > 1
    if not self._multi and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame) -> None:
    if not self.reason:
      self.reason = signal.Signals(signum).name
      log.warning("%s received: saving a checkpoint after this step, then exiting",
                  self.reason)
      # Further notices (TPU VMs and schedulers repeat SIGTERM) are ignored by the OS from
      # now on: a Python handler would be reset to the default by the interpreter's own
      # shutdown, and a repeat landing then would kill the run before it exits 0.
      for sig in self._previous:
        signal.signal(sig, signal.SIG_IGN)

  def requested(self, step: int) -> bool:
    if self._multi:
      if self._checkpoints.manager.reached_preemption(step):
        self.reason = "preemption notice"
        return True
      return False
    return bool(self.reason)

  def uninstall(self) -> None:
    if self.reason:
      return  # preempted: the process is on its way out, still ignoring further notices
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def evaluate(trainer: Trainer, state: TrainState, batches, num_batches: int) -> dict[str, float]:
  """Mean metrics over the first `num_batches` held-out batches (the same ones every time)."""
  totals: dict[str, float] = {}
  for _ in range(num_batches):
    metrics = jax.device_get(trainer.evaluate(state.params, next(batches)))
    for key, value in metrics.items():
      totals[key] = totals.get(key, 0.0) + float(value) / num_batches
  if "lm_loss" in totals:
    totals["perplexity"] = float(np.exp(totals["lm_loss"]))
  return totals
