"""The spike guard's rule (bertjax.resilience.guard) against recorded healthy runs and injected
spikes: the losses and gradient norms of runs trained with the guard off and every step logged
(the README main job, gpt_tiny, bert_tiny, the golden runs, the README fine-tune and a
fine-tune of a freshly initialised bert_tiny; tests/golden/healthy_guard_series.npz, written by
the command on docs/results/2026-12-02-spike-guard-calibration.md). Replayed by the step's
own `judge` (bertjax.tools.guard_replay), a healthy run must skip nothing at the default
settings: with nothing skipped the guarded run is the same program, bit for bit. A poisoned
batch (loss and so gradient norm × 50, the fault lab's) in a pre-training run is caught."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bertjax import config as config_lib
from bertjax.resilience.guard import GuardSettings
from bertjax.tools import guard_replay

SERIES = Path(__file__).parent / "golden" / "healthy_guard_series.npz"


def _runs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  data = np.load(SERIES)
  names = sorted({key.split("/")[0] for key in data.files})
  return {name: (data[f"{name}/loss"], data[f"{name}/grad_norm"]) for name in names}


RUNS = _runs()
DEFAULTS = GuardSettings.from_config(config_lib.load_config("bert_tiny"))


def test_the_recorded_runs_cover_every_kind_of_healthy_run():
  kinds = {name.rsplit("_s", 1)[0] for name in RUNS if not name.startswith("golden")}
  assert kinds >= {"main", "gpt", "bert", "ftfresh", "ftreadme"}, sorted(RUNS)
  for name, (losses, norms) in RUNS.items():
    assert len(losses) == len(norms) > DEFAULTS.min_history, name


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_healthy_run_skips_nothing_at_the_defaults(name):
  losses, norms = RUNS[name]
  result = guard_replay.replay(losses, norms, DEFAULTS)
  assert result.skipped == [] and result.alarm == 0, (name, result)
  # Both signals must be outliers for a skip: the pair's margin stays below zero.
  assert result.both_margin < 0, (name, result)


@pytest.mark.parametrize("name", sorted(n for n in RUNS if n.split("_s")[0] in
                                         ("main", "gpt", "bert")))
def test_a_poisoned_batch_in_a_pretraining_run_is_caught(name):
  """The fault lab's models and the main job. (Some golden runs' gradient norms wander too
  widely for a × 50 batch to stand out at 6 sigmas, ELECTRA's most; the results page counts
  them.)"""
  losses, norms = RUNS[name]
  # Past the first statistics and the warmup's steepest fall, spread over the run.
  steps = np.linspace(max(DEFAULTS.min_history + 20, len(losses) // 5), len(losses) - 1,
                      4).astype(int)
  for step in steps:
    poisoned = guard_replay.with_spikes(losses, norms, [step], 50.0)
    result = guard_replay.replay(*poisoned, DEFAULTS)
    assert result.skipped == [step], (name, step, result)
