"""Evaluation suites as the papers report them (`bertjax eval glue|squad`; bertjax.cli.finetune
runs the fine-tunes): GLUE (Wang et al. 2019), the nine tasks in GLUE's directory layout, and
SQuAD v1.1 / v2.0 (Rajpurkar et al. 2016, 2018) by their file names; each task's metrics,
several fine-tuning seeds per task and a rule (`RULES`) that turns the seeds' dev scores into
the task's number: the median (RoBERTa, Liu et al. 2019), the best (BERT, Devlin et al. 2019)
or the mean.

The guide: docs/finetuning.md, 'GLUE and SQuAD as the papers report them (`bertjax eval`)'.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class SuiteTask:
  """One task of a suite: where its files are, which columns hold what, what it reports."""

  name: str
  directory: str
  kind: str  # classification | regression | question_answering
  text_a: str
  text_b: str
  label: str
  # The reported metrics; the first selects the best epoch of each seed and is the rule's.
  metrics: tuple[str, ...] = ("accuracy",)
  header: bool = True
  dev: str = "dev.tsv"
  second_dev: str = ""  # MNLI's mismatched dev set, scored beside the matched one
  train: str = "train.tsv"
  recipe: str = "glue"  # the fine-tuning recipe (bertjax.finetune.recipes) it starts from

  def files(self, root: Path) -> dict[str, Path]:
    files = {"train": root / self.directory / self.train,
             "dev": root / self.directory / self.dev}
    if self.second_dev:
      files["second_dev"] = root / self.directory / self.second_dev
    return files


# The layout GLUE's download script writes (GLUE_DIR/CoLA/train.tsv, ...): CoLA without a header
# row (label in column 1, sentence in column 3), every other task's columns by header name.
GLUE: dict[str, SuiteTask] = {task.name: task for task in (
    SuiteTask("cola", "CoLA", "classification", "3", "", "1", ("matthews",), header=False),
    SuiteTask("sst2", "SST-2", "classification", "sentence", "", "label"),
    SuiteTask("mrpc", "MRPC", "classification", "#1 String", "#2 String", "Quality",
             ("f1", "accuracy")),
    SuiteTask("stsb", "STS-B", "regression", "sentence1", "sentence2", "score",
              ("pearson", "spearman"), recipe="sts"),
    SuiteTask("qqp", "QQP", "classification", "question1", "question2", "is_duplicate",
             ("f1", "accuracy")),
    SuiteTask("mnli", "MNLI", "classification", "sentence1", "sentence2", "gold_label",
             dev="dev_matched.tsv", second_dev="dev_mismatched.tsv"),
    SuiteTask("qnli", "QNLI", "classification", "question", "sentence", "label"),
    SuiteTask("rte", "RTE", "classification", "sentence1", "sentence2", "label"),
    SuiteTask("wnli", "WNLI", "classification", "sentence1", "sentence2", "label"),
)}
# SQuAD's files in one directory, as SQuAD's site and `bertjax data qa-task` name them; scored by
# the official scripts' exact match and F1.
SQUAD: dict[str, SuiteTask] = {task.name: task for task in (
    SuiteTask(f"squad{version}", ".", "question_answering", "", "", "", ("f1", "exact_match"),
              train=f"train-v{version}.json", dev=f"dev-v{version}.json", recipe="squad")
    for version in ("1.1", "2.0"))}
SUITES = {"glue": GLUE, "squad": SQUAD}

# A seed's dev score is its best evaluation's (the fine-tune keeps its best epoch by the task's
# first metric). median: RoBERTa's "median over five random initializations" (ELECTRA's README
# scores are medians too); best: BERT's restarts "selected the best model on the Dev set"
# (ALBERT's single best-dev runs).
RULES = {"median": statistics.median, "best": max, "mean": statistics.fmean}

# Fine-tuning settings a task decides (a user's value for one of them is refused).
TASK_SETTINGS = ("task", "text_a", "text_b", "label", "header", "metric", "second_dev")


def parse_tasks(suite: str, text: str) -> list[SuiteTask]:
  """"cola,mnli" (or "all") -> the suite's tasks, in the suite's order."""
  tasks = SUITES[suite]
  names = list(tasks) if text in ("", "all") else [t.strip().lower() for t in text.split(",")]
  unknown = [n for n in names if n not in tasks]
  if unknown:
    raise ValueError(f"--tasks: unknown {suite} task(s) {', '.join(unknown)}; tasks: "
                     f"{', '.join(tasks)}")
  return [tasks[n] for n in tasks if n in names]


def present(tasks: Sequence[SuiteTask], root: Path) -> tuple[list[SuiteTask], list[str]]:
  """The tasks whose files are all under `root`, and a line for each one that is missing."""
  found, missing = [], []
  for task in tasks:
    absent = [str(p) for p in task.files(root).values() if not p.is_file()]
    if absent:
      missing.append(f"{task.name}: {', '.join(absent)} not found")
    else:
      found.append(task)
  return found, missing


def settings(task: SuiteTask, root: Path, seed: int) -> dict[str, Any]:
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


def task_result(task: SuiteTask, per_seed: Mapping[int, Mapping[str, float]],
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
