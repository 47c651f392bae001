"""Loss and accuracy curves from metrics.jsonl, as a PNG: one run's (written by `bertjax train`
into WORKDIR/metrics.png at each eval) or several runs' side by side (`bertjax plot`), with the
band of a run's reproduction contract where its evals were checked against one.

Drawn with matplotlib's Agg canvas directly, never pyplot: no window, no global figure state,
nothing changed for a program that imports bertjax.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bertjax import paths

if TYPE_CHECKING:  # matplotlib is imported when a plot is drawn, not with bertjax
  from matplotlib.figure import Figure

log = logging.getLogger(__name__)

PLOT_NAME = "metrics.png"
# Panels after the loss, each drawn when any run logged the key (BERT: MLM and NSP; GPT: LM).
ACCURACY_KEYS = ("mlm_accuracy", "nsp_accuracy", "lm_accuracy")
_TITLES = {"loss": "loss", "mlm_accuracy": "MLM accuracy", "nsp_accuracy": "NSP accuracy",
           "lm_accuracy": "next-token accuracy"}

Records = dict[str, list[dict]]  # split ("train", "eval") -> records in step order


def read_metrics(metrics_jsonl: paths.PathLike) -> Records:
  """The records of a metrics.jsonl by split, one per step in step order: where a resumed run
  logged a step again, its later line wins."""
  by_split: dict[str, dict[int, dict]] = {}
  for line in paths.path(metrics_jsonl).read_text().splitlines():
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except ValueError:
      continue  # a line cut short by a crash mid-write
    by_split.setdefault(record.get("split", "train"), {})[int(record["step"])] = record
  return {split: [steps[s] for s in sorted(steps)] for split, steps in by_split.items()}


def _panels(runs: dict[str, Records]) -> list[str]:
  logged = {key for records in runs.values() for split in records.values() for r in split
            for key in r}
  return ["loss"] + [key for key in ACCURACY_KEYS if key in logged]


def plot_runs(runs: dict[str, Records], out: Path, title: str = "") -> Figure:
  """One figure of `runs` (label -> records) into the PNG `out`, and returned: a panel for the
  loss and one per accuracy logged; a colour per run, train solid, eval dashed with markers."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - when drawing
  from matplotlib.figure import Figure  # noqa: PLC0415 - when drawing

  panels = _panels(runs)
  # Up to three panels in a row; more (BERT and GPT runs compared) wrap to keep them legible.
  cols = len(panels) if len(panels) <= 3 else 2
  rows = -(-len(panels) // cols)
  width, height = 5.2 * cols, 4.2 * rows
  fig = Figure(figsize=(width, height))
  # Fixed margins (in inches, for tick labels and titles): a layout engine would draw the
  # figure twice, doubling the cost of a redraw.
  fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                      top=1 - 0.6 / height, wspace=0.22, hspace=0.3)
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for unused in axes[len(panels):]:
    unused.set_visible(False)
  colours = [f"C{i % 10}" for i in range(len(runs))]
  for ax, key in zip(axes, panels):
    for colour, (label, records) in zip(colours, runs.items()):
      prefix = f"{label} " if len(runs) > 1 else ""
      for split, style in (("train", {"linestyle": "-", "linewidth": 1.4}),
                           ("eval", {"linestyle": "--", "marker": "o", "markersize": 4})):
        points = [(r["step"], r[key]) for r in records.get(split, []) if key in r]
        if points:
          steps, values = zip(*points)
          ax.plot(steps, values, color=colour, label=f"{prefix}{split}", **style)
      _draw_contract(ax, key, records.get("eval", []), colour, prefix)
    ax.set_title(_TITLES[key])
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if key != "loss":
      ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize="small")
  if title:
    fig.suptitle(title)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=100)
  return fig


def _draw_contract(ax, key: str, evals: list[dict], colour: str, prefix: str) -> None:
  """The contract's band and reference at the run's evals, where the run checked them
  (bertjax.reproduction.on_track wrote `<key>_ref`, `_ref_low`, `_ref_high`)."""
  band = [(r["step"], r[f"{key}_ref_low"], r[f"{key}_ref"], r[f"{key}_ref_high"])
          for r in evals if f"{key}_ref" in r]
  if not band:
    return
  steps, low, ref, high = zip(*band)
  ax.fill_between(steps, low, high, color=colour, alpha=0.15, linewidth=0,
                  label=f"{prefix}contract band")
  ax.plot(steps, ref, color=colour, linestyle=":", linewidth=1.2, label=f"{prefix}contract")


def plot_workdir(metrics_jsonl: Path, out: Path, title: str) -> bool:
  """The run's own plot, for the training loop: never raises (a plot is not worth a failed
  run); False, after one warning line, when it could not be drawn."""
  try:
    records = read_metrics(metrics_jsonl)
    if not any(records.values()):
      return False
    plot_runs({title: records}, out, title)
    return True
  except Exception as e:  # noqa: BLE001 - any failure to plot, matplotlib's included
    log.warning("could not write the metrics plot %s: %s: %s", out, type(e).__name__, e)
    return False


def _labels(workdirs: Iterable[str]) -> list[str]:
  """Each run by its workdir's name, or by the path as given where names repeat."""
  workdirs = list(workdirs)
  names = [os.path.basename(os.path.normpath(w)) or w for w in workdirs]
  return [n if names.count(n) == 1 else w for n, w in zip(names, workdirs)]


def cmd_plot(args: argparse.Namespace) -> int:
  """`bertjax plot WORKDIR... [--out FILE]`: every run's curves in one figure."""
  runs = {}
  for label, workdir in zip(_labels(args.workdirs), args.workdirs):
    metrics = paths.path(workdir) / "metrics.jsonl"
    if not metrics.exists():
      raise ValueError(f"{workdir}: no metrics.jsonl (is it a `bertjax train` workdir?)")
    runs[label] = read_metrics(metrics)
  out = args.out or (os.path.join(args.workdirs[0], PLOT_NAME) if len(args.workdirs) == 1
                     else PLOT_NAME)
  title = next(iter(runs)) if len(runs) == 1 else ""
  target = paths.path(out)
  # Written locally (matplotlib cannot write to an object store), uploaded when remote.
  with paths.local_output(target.parent) as local:
    plot_runs(runs, Path(local) / target.name, title)
  print(f"wrote {out}")
  return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """`bertjax plot`'s arguments."""
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR",
                      help="`bertjax train` workdirs (local or gs://), one line per run")
  parser.add_argument("--out", default="", metavar="FILE",
                      help=f"PNG to write (one workdir: WORKDIR/{PLOT_NAME}; several: "
                           f"./{PLOT_NAME})")
