"""Where training metrics go: JSON lines, TensorBoard event files and a console line.

Only process 0 writes; every other process gets a writer that drops everything.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Mapping

from bertjax import paths


class TrainingDiverged(RuntimeError):
  """The loss became NaN or Inf."""


def check_finite(step: int, metrics: Mapping[str, float]) -> None:
  loss = metrics.get("loss")
  if loss is not None and not math.isfinite(loss):
    raise TrainingDiverged(
        f"loss is {loss} at step {step}; stopping (metrics: "
        + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()) + "). Lower the learning "
        "rate, check the data, or raise optimizer.clip_norm; checkpoints already written are "
        "intact.")


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  hours, rem = divmod(seconds, 3600)
  minutes, secs = divmod(rem, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsWriter:
  """metrics.jsonl + TensorBoard events in `workdir`, and a console line per log interval."""

  def __init__(self, workdir: paths.PathLike, total_steps: int, enabled: bool = True,
               stream=None) -> None:
    self.enabled = enabled
    self.total_steps = total_steps
    self.stream = stream or sys.stdout
    self.start = time.perf_counter()
    self._jsonl = None
    self._tb = None
    self._mirror = None
    if enabled:
      # On an object store the files are written locally and uploaded at every write.
      self._mirror = paths.LocalMirror(workdir, names=("metrics.jsonl", "tensorboard"))
      self._jsonl = open(self._mirror.local / "metrics.jsonl", "a", encoding="utf-8")
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self._mirror.local / "tensorboard"))

  def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
    if not self.enabled:
      return
    record = {"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    for key, value in metrics.items():
      self._tb.add_scalar(f"{prefix}/{key}", float(value), step)
    self._tb.flush()
    self._mirror.sync()
    self.stream.write(self._console_line(step, metrics, prefix) + "\n")
    self.stream.flush()

  def _console_line(self, step: int, metrics: Mapping[str, Any], prefix: str) -> str:
    parts = [f"{prefix} step {step}/{self.total_steps}"]
    for key in ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy", "lm_loss", "perplexity"):
      if key in metrics:
        parts.append(f"{key} {float(metrics[key]):.4f}")
    if "tokens_per_sec" in metrics:
      parts.append(f"{float(metrics['tokens_per_sec']):,.0f} tok/s")
    if "mfu" in metrics:
      parts.append(f"MFU {100 * float(metrics['mfu']):.1f}%")
    if prefix == "train" and step > 0 and "step_time" in metrics:
      remaining = (self.total_steps - step) * float(metrics["step_time"])
      parts.append(f"ETA {_duration(remaining)}")
    return " | ".join(parts)

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()
    if self._mirror:
      self._mirror.close()
