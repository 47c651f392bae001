"""Running the golden runs (bertjax.reproduction.golden): recording a family's curve over
several seeds into configs/golden/, and checking one run against it.

    bertjax reproduce --record bert_tiny --seeds 0,1,2 --workdir /tmp/golden
    bertjax reproduce --check bert_tiny --workdir /tmp/golden_check [--config.KEY=VALUE ...]

Every run trains in this process through the training loop, as `bertjax train` would. The
guide: docs/reproducing.md, "Golden curves".
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import logging
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path

from bertjax import config as config_lib
from bertjax.reproduction import golden, on_track, registry
from bertjax.training import loop, plot

log = logging.getLogger(__name__)

Overrides = Sequence[tuple[str, str]]


def _pairs(texts: Sequence[str]) -> list[tuple[str, str]]:
  return [tuple(text.split("=", 1)) for text in texts]  # type: ignore[misc]


def seed_overrides(seed: int) -> list[tuple[str, str]]:
  """Seed `seed` of a golden run: initialisation and dropout; seed 0 is the config as
  written. The data (its order, its masks, the eval batches) stays the config's: every seed
  is scored on the same held-out examples, so the band measures the model's spread, not the
  eval sample's."""
  return [("seed", str(seed))]


def workdir_of(root: Path, run: golden.GoldenRun, seed: int) -> Path:
  return root / registry.golden_name(run.config) / f"seed-{seed}"


def train(run: golden.GoldenRun, seed: int, root: Path, extra: Overrides = (),
          check: bool = False) -> Path:
  """Trains `run` with `seed` into root/NAME/seed-S (again, from scratch, when there) and
  returns the workdir. `check`: with its golden contract (the loader names it), else none.
  A distillation run's teacher (seed 0 of its golden run) is trained first when missing."""
  workdir = workdir_of(root, run, seed)
  overrides = [*_pairs(run.overrides), *seed_overrides(seed), *extra]
  if run.teacher:
    teacher = workdir_of(root, golden.golden_run(run.teacher), 0)
    if not (teacher / "params").exists():
      train(golden.golden_run(run.teacher), 0, root)
    overrides = [("distillation.teacher", str(teacher / "params")),
                 ("data.dataset", str(teacher / "data" / "dataset")), *overrides]
  if not check:
    overrides.append(("contract", ""))
  config = config_lib.load_config(run.config, overrides)
  if workdir.exists():
    shutil.rmtree(workdir)
  log.info("golden run %s, seed %d: %s", run.config, seed, workdir)
  loop.train_and_evaluate(config, workdir)
  return workdir


def evals(workdir: Path) -> list[dict]:
  return plot.read_metrics(workdir / "metrics.jsonl").get("eval", [])


def _machine() -> str:
  model = ""
  flags: set[str] = set()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name") and not model:
        model = line.split(":", 1)[1].strip()
      if line.startswith("flags"):
        flags.update(line.split(":", 1)[1].split())
  except OSError:
    pass
  wanted = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
  return f"{model or platform.processor()} ({', '.join(wanted) or 'no avx512'})"


def record(name: str, seeds: Sequence[int], root: Path, out_dir: Path) -> Path:
  """Trains the golden run `name` with each seed and writes its contract to
  out_dir/NAME.json: the seeds' mean and band at every eval, and each seed's values."""
  run = golden.golden_run(name)
  if len(set(seeds)) < 3:
    raise ValueError(f"{name}: a golden band needs at least 3 distinct seeds, got {seeds}")
  per_seed = {seed: evals(train(run, seed, root)) for seed in seeds}
  config = config_lib.load_config(run.config, _pairs(run.overrides))
  steps = {int(r["step"]) for records in per_seed.values() for r in records}
  tokens = {step: on_track.tokens_trained(config, step) for step in steps}
  recorded = {
      "command": f"bertjax reproduce --record {name} --seeds {','.join(map(str, seeds))}",
      "config": run.config, "overrides": list(run.overrides), "teacher": run.teacher,
      "seeds": list(seeds), "date": datetime.date.today().isoformat(),
      "machine": _machine(), "jax": importlib.metadata.version("jax"),
      "band": (f"mean ± max({golden.K_SD:g} sd of the seeds, {golden.REL:g} x |mean|, "
               f"{golden.ABS:g})"),
      "runs": {str(seed): [golden.guarded(r) | {"step": int(r["step"])} for r in records]
               for seed, records in per_seed.items()},
  }
  contract = golden.contract_from_runs(run, per_seed, tokens, recorded)
  out = out_dir / f"{registry.golden_name(name)}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(contract.to_json(), indent=1) + "\n")
  return out


@dataclasses.dataclass(frozen=True)
class Deviation:
  step: int
  metric: str
  value: float
  low: float
  high: float
  verdict: int

  def __str__(self) -> str:
    where = "below" if self.verdict < 0 else "above"
    return (f"step {self.step}: {self.metric} {self.value:.4f} {where} its band "
            f"[{self.low:.4f}, {self.high:.4f}]")


def deviations(workdir: Path) -> tuple[int, list[Deviation]]:
  """(evals checked, the (step, metric) pairs outside their band) of a run trained with its
  contract: read from the on-track fields of its eval records."""
  found, checked = [], 0
  for record in evals(workdir):
    verdicts = on_track.verdicts(record)
    checked += bool(verdicts)
    for metric, verdict in verdicts.items():
      if verdict:
        found.append(Deviation(int(record["step"]), metric, float(record[metric]),
                               float(record[metric + on_track.LOW]),
                               float(record[metric + on_track.HIGH]), verdict))
  return checked, found


def check(name: str, root: Path, extra: Overrides = ()) -> tuple[int, list[Deviation]]:
  """Trains the golden run `name` with seed 0 (and `extra` overrides: a broken variant) against
  its recorded curve; returns `deviations`. A ValueError when no curve is recorded."""
  run = golden.golden_run(name)
  config = config_lib.load_config(run.config, _pairs(run.overrides))
  if not config.contract:
    raise ValueError(f"{name}: no golden curve recorded (bertjax reproduce --record {name})")
  return deviations(train(run, 0, root, extra, check=True))
