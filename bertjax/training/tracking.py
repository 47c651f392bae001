"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases (`config.wandb`).

Process 0 logs every record the run writes (`train/loss`, `eval/mlm_accuracy`, ... at the
run's step) and the resolved config once. The W&B run id is kept in WORKDIR/wandb.json, so a
run resumed after preemption — any number of times, on any host — continues the same W&B run
(`resume="allow"`); W&B ignores the steps a resume trains again (it takes each step once, in
increasing order), which metrics.jsonl keeps. Guide: docs/training.md, "Metrics".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import ml_collections

from bertjax import paths

RUN_FILE = "wandb.json"
MODES = ("online", "offline", "disabled")


class WandbTracker:
  """One W&B run per workdir."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: paths.PathLike,
               local_dir: str) -> None:
    c = config.wandb
    if str(c.mode) not in MODES:
      raise ValueError(f"wandb.mode must be one of {', '.join(MODES)}, got {c.mode!r}")
    try:
      import wandb  # noqa: PLC0415 - optional (the wandb extra)
    except ImportError:
      raise ValueError("wandb.project is set but the wandb package is not installed: "
                       "pip install wandb (or pip install 'bertjax[wandb]')") from None
    self._wandb = wandb
    record = paths.path(workdir) / RUN_FILE
    if record.exists():
      run_id = json.loads(record.read_text())["id"]
    else:
      run_id = uuid.uuid4().hex[:8]  # W&B's form: 8 lowercase letters and digits
      record.write_text(json.dumps({"id": run_id, "project": str(c.project)}) + "\n")
    tags = [t for t in str(c.tags).split(",") if t]
    self.run = wandb.init(project=str(c.project), entity=str(c.entity) or None,
                          name=str(c.name) or paths.path(workdir).name, id=run_id,
                          resume="allow", mode=str(c.mode), tags=tags or None,
                          dir=local_dir, config=json.loads(config.to_json_best_effort()))
    self.run_id = run_id

  def log(self, step: int, metrics: Mapping[str, Any], prefix: str) -> None:
    self.run.log({f"{prefix}/{k}": float(v) for k, v in metrics.items()}, step=step)

  def close(self) -> None:
    self.run.finish()


def tracker(config: ml_collections.ConfigDict, workdir: paths.PathLike,
            local_dir: str) -> WandbTracker | None:
  """The run's tracker, or None when `wandb.project` is empty."""
  group = config.get("wandb")
  if group is None or not str(group.project):
    return None
  return WandbTracker(config, workdir, local_dir)
