"""The spike guard replayed over a run's recorded losses and gradient norms: which updates its
rule would have skipped, how close every other step came, and whether injected spikes are
caught. A run logged at every step with the guard off (`--config.log_every=1
--config.resilience.spike_sigmas=0`) gives the series; until the first skip the replay is
exactly what the guard in the step would have decided (the same `guard.judge`, scanned).

  python -m bertjax.tools.guard_replay WORKDIR [WORKDIR ...]   # at the guard's defaults

The guide: docs/resilience.md, 'The spike guard'; the calibration it was used for:
docs/results/2026-12-02-spike-guard-calibration.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import config as config_lib
from bertjax import paths
from bertjax.resilience import guard as spike_guard


@dataclasses.dataclass(frozen=True)
class Replay:
  skipped: list[int]  # 1-based steps whose update the guard skips
  # The largest margin of a step over its thresholds (log units; > 0 is an outlier) among
  # the judged steps: how close a healthy run came to a skip, loss and norm separately and
  # for the pair (the smaller of the two margins: both must be > 0 to skip).
  loss_margin: float
  norm_margin: float
  both_margin: float
  alarm: int  # the guard's alarm at the end (0: none)


def read_series(workdir: paths.PathLike) -> tuple[np.ndarray, np.ndarray]:
  """(loss, grad_norm) of every train step in WORKDIR/metrics.jsonl, step 1 first. Every step
  must have been logged: a gap is an error (the replay would judge other neighbours)."""
  path = paths.path(workdir) / "metrics.jsonl"
  rows = {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    if record.get("split", "train") == "train" and "grad_norm" in record:
      rows[int(record["step"])] = (record["loss"], record["grad_norm"])
  steps = sorted(rows)
  if steps != list(range(1, len(steps) + 1)):
    raise ValueError(f"{path}: train records are not every step from 1 (log_every=1 and one "
                     f"attempt are needed); {len(steps)} records, first {steps[:3]}")
  values = np.asarray([rows[s] for s in steps], np.float64)
  return values[:, 0], values[:, 1]


def replay(losses: Sequence[float], grad_norms: Sequence[float],
           settings: spike_guard.GuardSettings) -> Replay:
  """The guard's verdicts over the series, by the step's own `judge`."""
  losses = jnp.asarray(losses, jnp.float32)
  grad_norms = jnp.asarray(grad_norms, jnp.float32)

  def step(guard, inputs):
    number, loss, norm = inputs
    count = jnp.minimum(guard.accepted, settings.history)
    judged = guard.accepted >= settings.min_history
    newest = (guard.accepted - 1) % settings.history
    margin = lambda ring, value: (spike_guard._log(value) - spike_guard.threshold(  # noqa: E731
        ring, count, newest, settings.sigmas, settings.min_ratio))
    # The loss must also be above its decayed peak (guard.judge).
    peak = jnp.where(guard.accepted > 0, guard.log_loss_peak, spike_guard._log(loss))
    loss_margin = jnp.minimum(margin(guard.log_losses, loss), spike_guard._log(loss) - peak)
    margins = jnp.where(judged, jnp.stack([loss_margin, margin(guard.log_grad_norms, norm)]),
                        -jnp.inf)
    guard, skip = spike_guard.judge(guard, number, loss, norm, settings)
    return guard, (skip, margins)

  numbers = jnp.arange(1, losses.shape[0] + 1, dtype=jnp.int32)
  final, (skips, margins) = jax.jit(lambda: jax.lax.scan(
      step, spike_guard.init(settings), (numbers, losses, grad_norms)))()
  skips, margins = np.asarray(skips), np.asarray(margins)
  return Replay([int(i) + 1 for i in np.flatnonzero(skips)],
                float(margins[:, 0].max()), float(margins[:, 1].max()),
                float(margins.min(axis=1).max()), int(final.alarm))


def with_spikes(losses: np.ndarray, grad_norms: np.ndarray, steps: Sequence[int],
                scale: float) -> tuple[np.ndarray, np.ndarray]:
  """The series with the loss of each of `steps` (1-based) multiplied by `scale`, and so its
  gradient norm: what the fault lab's poisoned batch does to a step."""
  losses, grad_norms = np.array(losses, np.float64), np.array(grad_norms, np.float64)
  index = np.asarray(steps) - 1
  losses[index] *= scale
  grad_norms[index] *= scale
  return losses, grad_norms


def main(argv: Sequence[str]) -> int:
  """Each workdir's replay at the guard's default settings, one line a run."""
  settings = spike_guard.GuardSettings.from_config(config_lib.load_config("bert_tiny"))
  for workdir in argv:
    result = replay(*read_series(workdir), settings)
    print(f"{workdir}: {len(result.skipped)} skipped {result.skipped[:10]}; margins (log) loss "
          f"{result.loss_margin:+.3f}, norm {result.norm_margin:+.3f}, both "
          f"{result.both_margin:+.3f}; alarm {result.alarm}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
