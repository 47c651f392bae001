"""Where training metrics go: JSON lines, TensorBoard event files, a console line, a plot
(WORKDIR/metrics.png) and the summary at the end of a run.

Only process 0 writes; every other process gets a writer that drops everything.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from bertjax import paths
from bertjax.models.families import Family
from bertjax.training import plot, tracking

log = logging.getLogger(__name__)

# The metrics a person reads first, in the console line and the summary (BERT: MLM and NSP;
# replaced-token detection: the generator's MLM and the discriminator's; GPT: the LM loss,
# accuracy and perplexity).
HEADLINE_KEYS = ("loss", "mlm_loss", "mlm_accuracy", "nsp_accuracy", "sbo_loss", "disc_loss",
                 "disc_accuracy", "soft_loss", "cos_loss", "lm_loss", "lm_accuracy",
                 "perplexity")
# Plotting takes at most about this fraction of the run: frequent evals skip redraws.
_PLOT_TIME_FRACTION = 0.05


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


def headline(metrics: Mapping[str, Any]) -> list[str]:
  """"key value" for each headline metric present."""
  return [f"{key} {float(metrics[key]):.4f}" for key in HEADLINE_KEYS if key in metrics]


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  hours, rem = divmod(seconds, 3600)
  minutes, secs = divmod(rem, 60)
  return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class MetricsWriter:
  """metrics.jsonl + TensorBoard events in `workdir`, and a console line per log interval."""

  def __init__(self, workdir: paths.PathLike, total_steps: int, enabled: bool = True,
               stream=None, config: Any = None) -> None:
    """`config`: the run's, whose `wandb` group (bertjax.training.tracking) adds W&B."""
    self.enabled = enabled
    self.total_steps = total_steps
    self.stream = stream or sys.stdout
    self.start = time.perf_counter()
    self._jsonl = None
    self._tb = None
    self._mirror = None
    self._title = paths.path(workdir).name
    self._next_plot = 0.0  # perf_counter time before which a non-final plot is skipped
    self._plotted = False  # the plot shows every record written so far
    if enabled:
      # On an object store the files are written locally and uploaded at every write.
      self._mirror = paths.LocalMirror(
          workdir, names=("metrics.jsonl", "tensorboard", plot.PLOT_NAME))
      self._jsonl = open(self._mirror.local / "metrics.jsonl", "a", encoding="utf-8")
      from tensorboardX import SummaryWriter  # noqa: PLC0415 - slow (~1.4 s); process 0 only
      self._tb = SummaryWriter(str(self._mirror.local / "tensorboard"))
    self._tracker = None
    if enabled and config is not None:
      self._tracker = tracking.tracker(config, workdir, str(self._mirror.local))

  def write(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
    if not self.enabled:
      return
    record = {"step": step, "split": prefix, **{k: float(v) for k, v in metrics.items()}}
    try:
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
    except OSError as e:  # a full disk fails the write, which names no file
      raise OSError(e.errno, e.strerror, self._jsonl.name) from None
    self._plotted = False
    for key, value in metrics.items():
      self._tb.add_scalar(f"{prefix}/{key}", float(value), step)
    self._tb.flush()
    if self._tracker:
      self._tracker.log(step, metrics, prefix)
    self._mirror.sync()
    self.stream.write(self._console_line(step, metrics, prefix) + "\n")
    self.stream.flush()

  def _console_line(self, step: int, metrics: Mapping[str, Any], prefix: str) -> str:
    # A fine-tune's dev scores (accuracy, f1, exact_match, ...) have no headline: all shown.
    shown = headline(metrics) or [f"{k} {float(v):.4f}" for k, v in metrics.items()]
    parts = [f"{prefix} step {step}/{self.total_steps}", *shown]
    if "tokens_per_sec" in metrics:
      parts.append(f"{float(metrics['tokens_per_sec']):,.0f} tok/s")
    if "mfu" in metrics:
      parts.append(f"MFU {100 * float(metrics['mfu']):.1f}%")
    if "on_track" in metrics:  # checked against the config's reproduction contract
      parts.append("on track" if float(metrics["on_track"]) else "OFF TRACK")
    if prefix == "train" and step > 0 and "step_time" in metrics:
      remaining = (self.total_steps - step) * float(metrics["step_time"])
      parts.append(f"ETA {_duration(remaining)}")
    return " | ".join(parts)

  @property
  def metrics_path(self) -> Path | None:
    """The local metrics.jsonl (on an object store, the mirror's copy), None when disabled."""
    return self._mirror.local / "metrics.jsonl" if self._mirror else None

  def plot(self, final: bool = False) -> bool:
    """Redraws WORKDIR/metrics.png from metrics.jsonl (and uploads it); skipped when the last
    redraw was too recent, unless `final`. True when the plot is up to date."""
    if not self.enabled or self._plotted:
      return self._plotted
    if not final and time.perf_counter() < self._next_plot:
      return False
    start = time.perf_counter()
    drawn = plot.plot_workdir(self.metrics_path, self._mirror.local / plot.PLOT_NAME,
                              self._title)
    elapsed = time.perf_counter() - start
    self._next_plot = time.perf_counter() + elapsed / _PLOT_TIME_FRACTION
    if drawn:
      self._mirror.sync()
    self._plotted = drawn
    return drawn

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()
    if self._tracker:
      self._tracker.close()
    if self._mirror:
      self._mirror.close()


def summary_lines(workdir: str, records: plot.Records, step: int, total_steps: int,
                  family: Family, wall_seconds: float | None = None, params: bool = True,
                  plotted: bool = True) -> list[str]:
  """What `bertjax train` prints at the end: how far the run got (`step`), its last metrics,
  where its files are and what to run next. `wall_seconds`: this invocation's (None: nothing
  trained)."""
  train, evals = records.get("train", []), records.get("eval", [])
  state = "finished" if step >= total_steps else "stopped"
  lines = [f"run {state} at step {step} of {total_steps}"
           + (f" after {_duration(wall_seconds)} in this invocation" if wall_seconds else "")]
  if train:
    last = train[-1]
    speed = [f"{last['tokens_per_sec']:,.0f} tok/s"] if "tokens_per_sec" in last else []
    speed += [f"MFU {100 * last['mfu']:.1f}%"] if "mfu" in last else []
    lines.append(f"  last train (step {last['step']}): " + " | ".join(headline(last) + speed))
  if evals:
    lines.append(f"  last eval (step {evals[-1]['step']}): "
                 + " | ".join(headline(evals[-1])))
  root = workdir.rstrip("/")
  lines += [f"  metrics      {root}/metrics.jsonl",
            (f"  TensorBoard  {root}/tensorboard  (pip install tensorboard && tensorboard "
             f"--logdir {root})")]
  if plotted:
    lines.append(f"  plot         {root}/{plot.PLOT_NAME}  (compare runs: bertjax plot "
                 f"{root} OTHER_WORKDIR --out runs.png)")
  if params and state == "finished":
    prompt = family.sample_prompt
    lines += [f"  parameters   {root}/params",
              "next:",
              f"  bertjax export --params {root}/params --format hf --out {root}/hf",
              f"  bertjax generate --params {root}/params --prompt '{prompt}'"]
    if family.is_encoder:
      lines.append(f"  bertjax finetune --init-from {root}/params --train TRAIN.tsv --dev "
                   f"DEV.tsv --out {root}/finetune  (docs/finetuning.md)")
  elif state == "stopped":
    lines += ["next:", "  the same `bertjax train` command resumes from the last checkpoint"]
  return lines


def print_summary(report: TextIO, workdir: paths.PathLike, step: int, total: int,
                  family: Family, plotted: bool, wall_seconds: float | None = None,
                  extra: Sequence[str] = ()) -> None:
  """The end-of-run summary (process 0) and the workload's `extra` lines: never fails the run
  it describes."""
  workdir = paths.path(workdir)
  metrics_path = workdir / "metrics.jsonl"  # uploaded at every write when remote
  try:
    records = plot.read_metrics(metrics_path) if metrics_path.exists() else {}
    lines = summary_lines(str(workdir), records, step, total, family, wall_seconds,
                          params=(workdir / "params").exists(), plotted=plotted)
  except Exception as e:  # noqa: BLE001 - a summary is not worth a failed run
    log.warning("could not summarise the run from %s: %s", metrics_path, e)
    return
  print("\n".join([*lines, *extra]), file=report, flush=True)
