"""`bertjax train`: the outer loop around the jitted step — data, logging, eval, profiling.

The loop never waits on the device except at log and eval steps (async dispatch keeps the
host building the next batch while the device runs this one).
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm

from bertjax import checkpoint, distributed, flops, sharding
from bertjax.data import make_batches
from bertjax.data.prepare import ensure_dataset
from bertjax.metrics import MetricsWriter, check_finite
from bertjax.train import Trainer, TrainState

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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
  """Trains `config.num_train_steps` steps; returns the last logged train metrics."""
  distributed.initialize(config.distributed)
  workdir = Path(workdir)
  is_main = jax.process_index() == 0
  if (workdir / "params" / "params").exists():
    raise FileExistsError(f"{workdir} already holds the final parameters of a finished run; "
                          "choose a new --workdir")
  mesh = sharding.make_mesh(dict(config.mesh))
  trainer = Trainer(config, mesh)
  total = int(config.num_train_steps)
  batch_size, seq_length = int(config.batch_size), int(config.seq_length)
  if batch_size % (jax.device_count() // mesh.shape["tensor"]):
    raise ValueError(f"batch_size={batch_size} is not divisible by the "
                     f"{jax.device_count() // mesh.shape['tensor']} data-parallel devices")
  if is_main:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    log.info("mesh %s on %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
             jax.process_count())

  dataset = ensure_dataset(config, workdir, jax.process_count()) \
      if config.data.source == "corpus" else ""
  state: TrainState = trainer.init_state(int(config.seed))
  # This host's rows of every global batch follow from the batch sharding.
  rows = distributed.local_rows(trainer.data_sharding(), batch_size)
  train_batches = make_batches(config, "train", rows, dataset)
  first_batch = next(train_batches)
  trainer.compile_step(first_batch)

  def global_batch(local):
    return distributed.global_batch(local, trainer.batch_shardings, batch_size)

  def eval_batches():
    batches = make_batches(config, "eval", rows, dataset)
    return (global_batch(next(batches)) for _ in iter(int, 1))

  flops_per_step = flops.train_flops_per_step(trainer.model_config, batch_size, seq_length,
                                              _predictions_per_seq(config))
  peak, peak_source = flops.peak_flops_per_device()
  # Simulated CPU devices share one host's cores: the measured matmul peak is the host's.
  total_peak = peak if jax.default_backend() == "cpu" else peak * jax.device_count()
  if is_main:
    log.info("model FLOPs/step %.3g; peak %.3g FLOP/s (%s)", flops_per_step, total_peak,
             peak_source)

  # A progress bar only where a person watches; log files get the periodic lines alone.
  progress = (tqdm.tqdm(total=total, initial=int(state.step), unit="step", dynamic_ncols=True)
              if is_main and sys.stdout.isatty() else None)
  writer = MetricsWriter(workdir, total, enabled=is_main,
                         stream=_TqdmStream() if progress else None)
  watchdog = distributed.StepWatchdog(float(config.distributed.step_timeout_s))
  profile_dir = str(workdir / "profile")
  tracing = False
  last_log_time, last_log_step = time.perf_counter(), int(state.step)
  train_metrics: dict[str, Any] = {}
  step = first_step = int(state.step)
  try:
    while step < total:
      if config.profile.start_step >= 0 and step == config.profile.start_step and is_main:
        jax.profiler.start_trace(profile_dir)
        tracing = True
      local = first_batch if step == first_step else next(train_batches)
      state, metrics = trainer.step(state, global_batch(local))
      step += 1
      watchdog.tick()
      if progress:
        progress.update(1)
      if step == first_step + 1:
        # The first step includes compilation: time it apart from the steady state.
        jax.block_until_ready(metrics)
        if is_main:
          log.info("first step (compile + run) took %.1f s",
                   time.perf_counter() - last_log_time)
        last_log_time, last_log_step = time.perf_counter(), step
      if tracing and step >= config.profile.start_step + config.profile.num_steps:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        tracing = False
        log.info("profile of steps %d..%d written to %s", config.profile.start_step, step - 1,
                 profile_dir)
      if step % config.log_every == 0 or step == total:
        train_metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        steps_done = step - last_log_step
        if steps_done:  # none right after the (compiling) first step
          step_time = (now - last_log_time) / steps_done
          train_metrics.update(step_time=step_time,
                               tokens_per_sec=batch_size * seq_length / step_time,
                               mfu=flops_per_step / step_time / total_peak)
        check_finite(step, train_metrics)
        writer.write(step, train_metrics)
        last_log_time, last_log_step = time.perf_counter(), step
      if config.eval_every and (step % config.eval_every == 0 or step == total):
        eval_start = time.perf_counter()
        writer.write(step, evaluate(trainer, state, eval_batches(), int(config.eval_steps)),
                     prefix="eval")
        # Time spent evaluating is not training time: keep it out of step time and tokens/s.
        last_log_time += time.perf_counter() - eval_start
  finally:
    train_batches.close()
    watchdog.stop()
    writer.close()
    if progress:
      progress.close()
  # The product of the run: params-only, what `bertjax export` and fine-tuning start from.
  params_dir = checkpoint.save_params(workdir / "params", state.params, trainer.model_config)
  if is_main and dataset:
    # The ids mean nothing without the tokenizer: it travels with the parameters.
    shutil.copytree(Path(dataset) / "tokenizer", params_dir / "tokenizer", dirs_exist_ok=True)
  if is_main:
    log.info("final parameters written to %s", params_dir)
  return train_metrics


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
