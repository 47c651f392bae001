"""Pre-training as a workload of the training loop: a corpus's batches, the held-out eval, and
the final parameters with their tokenizer (WORKDIR/params, what export and fine-tuning start
from)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from bertjax import paths
from bertjax.checkpoints.params import save_params
from bertjax.data import make_batches
from bertjax.data.prepare import ensure_dataset
from bertjax.parallel import distributed
from bertjax.reproduction.on_track import OnTrack
from bertjax.training import hooks
from bertjax.training.metrics import MetricsWriter
from bertjax.training.trainer import Trainer, TrainState

log = logging.getLogger(__name__)


class Pretraining:
  """A pre-training run: `data.source` (a built corpus, built on first use, or the synthetic
  test stream), evaluated every `eval_every` steps on `eval_steps` held-out batches."""

  checkpoint_items: tuple[str, ...] = ()
  stopped = False  # pre-training ends at num_train_steps (or when finite data runs out)

  def __init__(self, config: ml_collections.ConfigDict, workdir: epath.Path, is_main: bool):
    self.config = config
    self.workdir = workdir
    self.is_main = is_main
    self.dataset = ""

  def prepare(self) -> None:
    """The corpus: `data.dataset`, or built on first use by process 0 (small corpora; pod runs
    set data.dataset), the others reading it once it is there (the workdir is shared by all
    hosts)."""
    config, workdir = self.config, self.workdir
    if config.data.source != "corpus":
      return
    if self.is_main or config.data.dataset:
      self.dataset = ensure_dataset(config, workdir)
    distributed.barrier("dataset ready")
    if not self.dataset:
      self.dataset = ensure_dataset(config, workdir, build=False)

  def batches(self, phase_config: ml_collections.ConfigDict, rows: Sequence[int]) -> Any:
    return make_batches(phase_config, "train", rows, self.dataset)

  def initial_state(self, trainer: Trainer) -> TrainState:
    state = trainer.init_state(int(self.config.seed))
    if self.config.init_from:
      step = int(self.config.init_step)
      state, _ = trainer.start_from(state, self.config.init_from, None if step < 0 else step)
    return state

  def add_hooks(self, step_hooks: hooks.Hooks, trainer: Trainer, writer: MetricsWriter,
                train_metrics: hooks.TrainMetrics) -> None:
    if not self.config.eval_every:
      return
    on_track = OnTrack(self.config)  # the config's contract, checked at every eval

    def evaluate_step(info: hooks.StepInfo) -> None:
      # This step's train record comes first; the eval waits for the step anyway.
      train_metrics.read_pending()
      jax.block_until_ready(info.metrics)
      eval_start = time.perf_counter()
      phase = info.phase
      eval_batches = make_batches(phase.eval_config, "eval", phase.rows, self.dataset)
      try:
        batches = (phase.global_batch(trainer, next(eval_batches)) for _ in iter(int, 1))
        metrics = evaluate(trainer, info.state, batches, int(self.config.eval_steps))
        writer.write(info.step, metrics | on_track.check(info.step, metrics), prefix="eval")
      finally:
        eval_batches.close()
      writer.plot()
      # Time spent evaluating is not training time: keep it out of step time and tokens/s.
      train_metrics.exclude(time.perf_counter() - eval_start)

    step_hooks.add(evaluate_step, every=int(self.config.eval_every), last=True, name="eval",
                   category="evaluation")

  def evaluated_at(self, step: int) -> bool:
    every = int(self.config.eval_every)
    return bool(every) and step % every == 0

  def saved(self, state: TrainState) -> dict[str, Any]:
    return {}

  def restore(self, checkpoints: Any, step: int, trainer: Trainer) -> None:
    pass

  def finish(self, state: TrainState, trainer: Trainer, trained: bool) -> dict[str, Any]:
    """The product of the run: WORKDIR/params (params-only) with the tokenizer. `trained`:
    this invocation trained to the end (perhaps again, from an earlier step), so an existing
    params/ is replaced."""
    workdir = self.workdir
    existed = (workdir / "params").exists()
    # Every process looks before any process writes: save_params creates the directory, and a
    # process that looked after a faster peer began saving would take the replace branch alone
    # and deadlock the barriers (seen in CI with 2 processes).
    distributed.barrier("final params checked")
    if existed:
      if not trained:
        return {}
      if self.is_main:
        (workdir / "params").rmtree()
      distributed.barrier("final params replaced")
    params_dir = save_params(workdir / "params", state.params, trainer.model_config)
    if self.is_main and self.dataset:
      # The ids mean nothing without the tokenizer: it travels with the parameters.
      paths.copy_tree(paths.path(self.dataset) / "tokenizer", params_dir / "tokenizer")
    if self.is_main:
      log.info("final parameters written to %s", params_dir)
    return {}

  def summary_lines(self, result: dict[str, Any]) -> list[str]:
    return []  # the loop's summary says it all: params/ and what to run next


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
