"""What a config should reach: the paper's targets with their sources, and reference points on
the way (tokens trained -> a metric our eval logs, with a band).

A contract is written beside its config (`CONTRACTS` in the config file, keyed by variant) or,
for the tiny configs, recorded by running them (`configs/golden/*.json`, bertjax.reproduction
.golden). The guide: docs/reproducing.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Target:
  """A number the paper (or the released model) reports for the finished run."""

  # What is measured, as the source names it ("GLUE dev average", "WikiText-103 perplexity").
  metric: str
  value: float
  # Where the number is printed: paper and table, model card or log URL, as text.
  source: str
  # How it was measured, where the source says more than the metric's name.
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Point:
  """A reference value of an eval metric after `tokens` token positions of training, and the
  band a run on track stays inside."""

  tokens: float
  # A metric the run's eval logs (metrics.jsonl): "loss", "lm_loss", "mlm_accuracy", ...
  metric: str
  value: float
  low: float
  high: float
  # Where the value comes from (a public log's URL, a paper figure, a golden file's command).
  source: str
  # The training step it was read at, where the source counts steps (golden curves); 0: none.
  step: int = 0

  def __post_init__(self) -> None:
    if not self.low <= self.value <= self.high:
      raise ValueError(f"reference point {self.metric} at {self.tokens:g} tokens: the band "
                       f"[{self.low}, {self.high}] does not hold its value {self.value}")
    if self.tokens <= 0:
      raise ValueError(f"reference point {self.metric}: tokens must be positive, got "
                       f"{self.tokens}")


@dataclasses.dataclass(frozen=True)
class Reference:
  """The contract's value and band for one metric at some tokens (interpolated)."""

  metric: str
  value: float
  low: float
  high: float

  def verdict(self, observed: float) -> int:
    """-1 below the band, 0 inside, +1 above."""
    return -1 if observed < self.low else 1 if observed > self.high else 0


@dataclasses.dataclass(frozen=True)
class Contract:
  """A config's reproduction contract."""

  # The paper (or model card) the contract is for, as cited in the config's docstring.
  paper: str
  targets: tuple[Target, ...] = ()
  points: tuple[Point, ...] = ()
  # What the points were measured on, where that matters to compare (data, tokenizer, eval).
  conditions: str = ""
  # Where a golden contract came from: the command that recorded it and its seeds.
  recorded: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Why a paper config's contract has no target: what was looked for and not found in a
  # source that could be read (a number nobody can trace is not written down).
  missing: str = ""

  def __post_init__(self) -> None:
    # "the same row" (or table, README): the source of the target before, said once.
    targets: list[Target] = []
    for target in self.targets:
      if target.source.startswith("the same ") and targets:
        target = dataclasses.replace(target, source=f"{targets[-1].source.split(' [')[0]} "
                                                    f"[{target.source}]")
      targets.append(target)
    object.__setattr__(self, "targets", tuple(targets))
    object.__setattr__(self, "points", tuple(sorted(self.points,
                                                    key=lambda p: (p.metric, p.tokens))))
    if not self.targets and not self.points and not self.missing:
      raise ValueError(f"{self.paper}: a contract needs a target, a reference point, or "
                       "`missing` saying why it has neither")
    for target in self.targets:
      if not target.source.strip():
        raise ValueError(f"{self.paper}: target {target.metric!r} has no source")
    for point in self.points:
      if not point.source.strip():
        raise ValueError(f"{self.paper}: reference point {point.metric} at {point.tokens:g} "
                         "tokens has no source")

  @property
  def metrics(self) -> tuple[str, ...]:
    """The eval metrics the points give, in order of first appearance."""
    return tuple(dict.fromkeys(p.metric for p in self.points))

  def curve(self, metric: str) -> list[Point]:
    return [p for p in self.points if p.metric == metric]

  def reference_at(self, metric: str, tokens: float) -> Reference | None:
    """The reference for `metric` after `tokens` token positions: a point's own where the run
    evaluates at it, between two points linear in log(tokens) (loss curves are close to straight
    there), and None before the first point or past the last (no extrapolation)."""
    curve = self.curve(metric)
    if not curve or tokens <= 0:
      return None
    positions = [p.tokens for p in curve]
    i = bisect.bisect_left(positions, tokens)
    if i < len(curve) and math.isclose(curve[i].tokens, tokens, rel_tol=1e-9):
      p = curve[i]
      return Reference(metric, p.value, p.low, p.high)
    if i == 0 or i == len(curve):
      return None
    a, b = curve[i - 1], curve[i]
    w = (math.log(tokens) - math.log(a.tokens)) / (math.log(b.tokens) - math.log(a.tokens))

    def mix(x: float, y: float) -> float:
      return x + w * (y - x)

    return Reference(metric, mix(a.value, b.value), mix(a.low, b.low), mix(a.high, b.high))

  def references(self, tokens: float) -> list[Reference]:
    """Every metric's reference at `tokens` (those the points cover there)."""
    found = (self.reference_at(metric, tokens) for metric in self.metrics)
    return [r for r in found if r is not None]

  def to_json(self) -> dict[str, Any]:
    return {"paper": self.paper, "conditions": self.conditions,
            "recorded": dict(self.recorded), "missing": self.missing,
            "targets": [dataclasses.asdict(t) for t in self.targets],
            "points": [dataclasses.asdict(p) for p in self.points]}


def from_json(data: Mapping[str, Any], where: str = "contract") -> Contract:
  """A Contract from its JSON form (`Contract.to_json`); a missing or unknown field is a
  ValueError naming `where`."""
  try:
    return Contract(paper=str(data["paper"]), conditions=str(data.get("conditions", "")),
                    recorded=dict(data.get("recorded", {})),
                    missing=str(data.get("missing", "")),
                    targets=tuple(Target(**t) for t in data.get("targets", ())),
                    points=tuple(Point(**p) for p in data.get("points", ())))
  except (KeyError, TypeError) as e:
    raise ValueError(f"{where}: not a contract ({type(e).__name__}: {e})") from None


def read(path: Any) -> Contract:
  """A contract from a JSON file (a golden curve, or one written for a test)."""
  from bertjax import paths  # noqa: PLC0415 - kept light for the config files that import us
  target = paths.path(path)
  try:
    data = json.loads(target.read_text())
  except FileNotFoundError:
    raise ValueError(f"contract file {path} not found") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
  return from_json(data, str(path))


def describe(references: Iterable[tuple[Reference, float]]) -> str:
  """'mlm_loss 7.08 in [6.95, 7.21]; lm_accuracy 0.31 above [0.20, 0.30]' for the log."""
  words = {-1: "below", 0: "in", 1: "above"}
  return "; ".join(f"{r.metric} {observed:.4g} {words[r.verdict(observed)]} "
                   f"[{r.low:.4g}, {r.high:.4g}]" for r, observed in references)
