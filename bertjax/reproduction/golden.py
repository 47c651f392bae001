"""Golden curves: each family's tiny run, recorded with several seeds into a contract whose
band is the seeds' spread, so that a change to what a run learns (a schedule, a masking rate,
an initialisation) shows as a curve leaving its band.

The runs are listed here (`GOLDEN_RUNS`), recorded by `bertjax reproduce --record NAME`
(bertjax.tools.golden_runs) into configs/golden/, declared in their config files' CONTRACTS
(`registry.golden_contracts`) and checked by tests/test_golden_curves.py. The guide:
docs/reproducing.md, "Golden curves".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bertjax.reproduction.contract import Contract, Point

# The band around the seeds' mean at each eval: K standard deviations of the seeds, and at
# least REL of the value or ABS (accuracies near 0), so that 3-4 seeds that happen to agree do
# not make a band narrower than the run-to-run noise of another machine's float rounding.
K_SD = 3.0
REL = 0.005
ABS = 0.003
# Eval metrics that are not learned quantities (perplexity repeats lm_loss).
NOT_GUARDED = frozenset({"perplexity"})


@dataclasses.dataclass(frozen=True)
class GoldenRun:
  """One family's guarded tiny run."""

  # The model family as the papers name it.
  family: str
  # The config the run trains (a tiny config, or a paper config's runlocal variant).
  config: str
  # Overrides on top of the config: evaluations often enough to see the curve's shape, on
  # enough held-out batches that the eval sample's noise does not hide a change.
  overrides: tuple[str, ...] = ("eval_every=50", "eval_steps=16")
  # The golden run whose final parameters teach this one (distillation), else "".
  teacher: str = ""
  # The other config files whose learning this run stands for (same family and objective
  # kind), besides its own file's every variant.
  guards: tuple[str, ...] = ()

  @property
  def file(self) -> str:
    return self.config.partition(":")[0]


# Each family's paper config at laptop scale (its `runlocal` variant: 2 layers of 128, 200
# steps, float32, the recipe's schedule shape kept): minutes on 2 cores for all ten.
GOLDEN_RUNS: tuple[GoldenRun, ...] = (
    GoldenRun("BERT", "bert_base:runlocal",
              guards=("bert_large", "bert_large_lamb", "roberta_base", "cramming", "mosaicbert")),
    GoldenRun("GPT", "gpt2:size=small,runlocal", guards=("gpt1", "gpt3", "distilgpt2")),
    GoldenRun("ModernBERT", "modernbert:size=base,runlocal"),
    GoldenRun("ELECTRA", "electra:size=small,runlocal"),
    GoldenRun("DeBERTa-v3", "deberta_v3:size=xsmall,runlocal"),
    GoldenRun("ALBERT", "albert:size=base,runlocal"),
    GoldenRun("SpanBERT", "spanbert:size=base,runlocal"),
    # The paper's teacher is BERT-base from the Hub; here the BERT golden run's own weights,
    # on the data that run built (the same tokenizer), and a fresh student (a 2-layer teacher
    # has no "one layer out of two" to give).
    GoldenRun("DistilBERT", "distilbert:runlocal",
              ("eval_every=50", "eval_steps=16", "distillation.init_from_teacher=false"),
              teacher="bert_base:runlocal"),
    GoldenRun("T5", "t5:size=small,runlocal"),
    GoldenRun("BART", "bart:size=base,runlocal"),
)


def guard_of(config_file: str) -> GoldenRun | None:
  """The golden run that guards the learning of a config file's configs."""
  for run in GOLDEN_RUNS:
    if config_file == run.file or config_file in run.guards:
      return run
  return None


def golden_run(config: str) -> GoldenRun:
  for run in GOLDEN_RUNS:
    if run.config == config:
      return run
  raise ValueError(f"no golden run for {config!r} (golden runs: "
                   f"{', '.join(r.config for r in GOLDEN_RUNS)})")


def band(values: Sequence[float]) -> tuple[float, float, float]:
  """(mean, low, high) of one metric at one eval across seeds (module constants)."""
  mean = statistics.fmean(values)
  sd = statistics.stdev(values) if len(values) > 1 else 0.0
  half = max(K_SD * sd, REL * abs(mean), ABS)
  return mean, mean - half, mean + half


def guarded(record: Mapping[str, Any]) -> dict[str, float]:
  """The metrics of an eval record a golden curve guards."""
  return {key: float(value) for key, value in record.items()
          if key not in ("step", "split") and key not in NOT_GUARDED
          and isinstance(value, (int, float)) and math.isfinite(float(value))}


def contract_from_runs(run: GoldenRun, evals: Mapping[int, Sequence[Mapping[str, Any]]],
                       tokens_per_step: Mapping[int, float], recorded: Mapping[str, Any]
                       ) -> Contract:
  """The golden contract of `run` from each seed's eval records (seed -> records in step
  order, every seed evaluating at the same steps); `tokens_per_step`: step -> tokens trained
  by then."""
  seeds = sorted(evals)
  if len(seeds) < 3:
    raise ValueError(f"{run.config}: a golden band needs at least 3 seeds, got {len(seeds)}")
  steps = [int(r["step"]) for r in evals[seeds[0]]]
  for seed in seeds[1:]:
    if [int(r["step"]) for r in evals[seed]] != steps:
      raise ValueError(f"{run.config}: seed {seed} evaluated at other steps than seed "
                       f"{seeds[0]}")
  source = f"golden curve: bertjax reproduce --record {run.config} (seeds {seeds})"
  points = []
  per_seed = {seed: [guarded(r) for r in evals[seed]] for seed in seeds}
  for i, step in enumerate(steps):
    for metric in per_seed[seeds[0]][i]:
      values = [per_seed[seed][i][metric] for seed in seeds]
      mean, low, high = band(values)
      points.append(Point(tokens_per_step[step], metric, mean, low, high, source, step))
  return Contract(paper=f"golden curve of {run.config} ({run.family})", points=tuple(points),
                  conditions=("the embedded Wikipedia sample, its tokenizer trained on first "
                              "use, float32 unless the config says otherwise, one process"),
                  recorded=dict(recorded))
