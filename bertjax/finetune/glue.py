"""GLUE (Wang et al. 2019) as the papers report it: the nine tasks in GLUE's directory layout,
their metrics, several fine-tuning seeds per task and a rule that turns the seeds' dev scores
into the task's number (`bertjax eval glue`, bertjax.cli.evaluate, runs the fine-tunes).

The layout is the one GLUE's download script writes (`GLUE_DIR/CoLA/train.tsv`, ...): CoLA
without a header row (label in column 1, sentence in column 3); MRPC's `Quality`, `#1 String`,
`#2 String`; STS-B's `sentence1`, `sentence2`, `score`; QQP's `question1`, `question2`,
`is_duplicate`; MNLI's `sentence1`, `sentence2`, `gold_label` with `dev_matched.tsv` and
`dev_mismatched.tsv`; QNLI's `question`, `sentence`; SST-2, RTE and WNLI as named below.

Selection rules (`RULES`): a seed's dev score is its best evaluation's (the fine-tune keeps the
parameters of its best epoch by the task's first metric); a task's number is the median of the
seeds' (RoBERTa, Liu et al. 2019: "median over five random initializations"; ELECTRA's README
scores are medians too), their best (BERT, Devlin et al. 2019: restarts "selected the best
model on the Dev set"; ALBERT's single best-dev runs) or their mean.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class GlueTask:
  """One GLUE task: where its files are, which columns hold what, what it reports."""

  name: str
  directory: str
  kind: str  # classification | regression
  text_a: str
  text_b: str
  label: str
  # GLUE's reported metrics; the first selects the best epoch of each seed and is the rule's.
  metrics: tuple[str, ...] = ("accuracy",)
  header: bool = True
  dev: str = "dev.tsv"
  second_dev: str = ""  # MNLI's mismatched dev set, scored beside the matched one

  def files(self, root: Path) -> dict[str, Path]:
    files = {"train": root / self.directory / "train.tsv",
             "dev": root / self.directory / self.dev}
    if self.second_dev:
      files["second_dev"] = root / self.directory / self.second_dev
    return files


TASKS: dict[str, GlueTask] = {task.name: task for task in (
    GlueTask("cola", "CoLA", "classification", "3", "", "1", ("matthews",), header=False),
    GlueTask("sst2", "SST-2", "classification", "sentence", "", "label"),
    GlueTask("mrpc", "MRPC", "classification", "#1 String", "#2 String", "Quality",
             ("f1", "accuracy")),
    GlueTask("stsb", "STS-B", "regression", "sentence1", "sentence2", "score",
             ("pearson", "spearman")),
    GlueTask("qqp", "QQP", "classification", "question1", "question2", "is_duplicate",
             ("f1", "accuracy")),
    GlueTask("mnli", "MNLI", "classification", "sentence1", "sentence2", "gold_label",
             dev="dev_matched.tsv", second_dev="dev_mismatched.tsv"),
    GlueTask("qnli", "QNLI", "classification", "question", "sentence", "label"),
    GlueTask("rte", "RTE", "classification", "sentence1", "sentence2", "label"),
    GlueTask("wnli", "WNLI", "classification", "sentence1", "sentence2", "label"),
)}

RULES = {"median": statistics.median, "best": max, "mean": statistics.fmean}

# Fine-tuning settings a task decides (a user's value for one of them is refused).
TASK_SETTINGS = ("task", "text_a", "text_b", "label", "header", "metric", "second_dev")


def parse_tasks(text: str) -> list[GlueTask]:
  """"cola,mnli" (or "all") -> the tasks, in GLUE's order."""
  names = list(TASKS) if text in ("", "all") else [t.strip().lower() for t in text.split(",")]
  unknown = [n for n in names if n not in TASKS]
  if unknown:
    raise ValueError(f"--tasks: unknown GLUE task(s) {', '.join(unknown)}; tasks: "
                     f"{', '.join(TASKS)}")
  return [TASKS[n] for n in TASKS if n in names]


def present(tasks: Sequence[GlueTask], root: Path) -> tuple[list[GlueTask], list[str]]:
  """The tasks whose files are all under `root`, and a line for each one that is missing."""
  found, missing = [], []
  for task in tasks:
    absent = [str(p) for p in task.files(root).values() if not p.is_file()]
    if absent:
      missing.append(f"{task.name}: {', '.join(absent)} not found")
    else:
      found.append(task)
  return found, missing


def settings(task: GlueTask, root: Path, seed: int) -> dict[str, Any]:
  """The fine-tuning settings (bertjax.config.finetune.SETTINGS) the task fixes for one seed."""
  files = task.files(root)
  values: dict[str, Any] = {
      "task": task.kind, "text_a": task.text_a, "text_b": task.text_b, "label": task.label,
      "header": task.header, "metric": task.metrics[0], "seed": seed,
      "train": str(files["train"]), "dev": str(files["dev"])}
  if "second_dev" in files:
    values["second_dev"] = str(files["second_dev"])
  return values


def seed_scores(summary: Mapping[str, Any]) -> dict[str, float]:
  """A finished fine-tune's dev scores at its best evaluation (by the task's first metric)."""
  best = [h for h in summary["history"] if h["step"] == summary["best_step"]]
  if not best:
    raise ValueError(f"the fine-tune summary has no evaluation at its best step "
                     f"{summary['best_step']}")
  return {key[len("dev_"):]: float(value) for key, value in best[0].items()
          if key.startswith("dev_")}


def task_result(task: GlueTask, per_seed: Mapping[int, Mapping[str, float]],
                rule: str) -> dict[str, Any]:
  """Every reported metric under `rule` over the seeds (each metric on its own: the median F1
  and the median accuracy of MRPC may come from different seeds, as the papers' tables do)."""
  combine = RULES[rule]
  reported = list(task.metrics) + [f"second_{m}" for m in task.metrics if task.second_dev]
  scores = {metric: combine([seed[metric] for seed in per_seed.values()])
            for metric in reported}
  return {"task": task.name, "metrics": reported, "rule": rule, "scores": scores,
          "seeds": {str(seed): dict(values) for seed, values in per_seed.items()},
          # GLUE's task score: the mean of its reported metrics (matched and mismatched too).
          "task_score": statistics.fmean(scores.values())}


def table(results: Sequence[Mapping[str, Any]]) -> list[str]:
  """The results as text: a line per task and metric, the seeds' scores and the rule's."""
  lines = [f"{'task':<6} {'metric':<20} {'rule':<6} {'score':>7}  seeds"]
  for result in results:
    for metric in result["metrics"]:
      seeds = " ".join(f"{values[metric]:.4f}" for values in result["seeds"].values())
      name = metric.replace("second_", "mismatched ") if result["task"] == "mnli" else metric
      lines.append(f"{result['task']:<6} {name:<20} {result['rule']:<6} "
                   f"{result['scores'][metric]:>7.4f}  {seeds}")
  if results:
    average = statistics.fmean(r["task_score"] for r in results)
    lines.append(f"average of the {len(results)} task score(s) (GLUE's: each task's metrics "
                 f"averaged first): {average:.4f}")
  return lines
