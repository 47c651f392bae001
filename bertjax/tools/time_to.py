"""`bertjax bench --time-to METRIC>=VALUE`: the wall time a config takes from a fresh workdir to
an evaluation metric (MLPerf's time to train), as a user meets it: `bertjax train` in its own
process, tokenizer training, data build and compilation included; guide: docs/performance.md,
'Time to accuracy'.

The run's metrics.jsonl is watched while it trains: the clock stops at the first eval record
that meets the target (the run is then stopped), or the run ends without meeting it. A metric
is met when `>=` (accuracies) or `<=` (losses) its value; the time is when its record appeared
(polled every 0.1 s), so evaluations count, as they would for a user watching the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_TARGET = re.compile(r"^(?:(?P<split>[a-z_]+)/)?(?P<metric>[A-Za-z0-9_]+)\s*"
                     r"(?P<op>>=|<=|=)\s*(?P<value>[-+0-9.eE]+)$")


@dataclasses.dataclass(frozen=True)
class Target:
  split: str  # the metrics.jsonl split whose records count ("eval")
  metric: str
  value: float
  at_least: bool  # True: met at >= value; False: at <= value

  def met(self, value: float) -> bool:
    return value >= self.value if self.at_least else value <= self.value

  def __str__(self) -> str:
    return f"{self.split}/{self.metric}{'>=' if self.at_least else '<='}{self.value:g}"


def parse_target(text: str) -> Target:
  """"eval/mlm_accuracy>=0.26", "mlm_accuracy=0.26" (>=, eval) or "eval/mlm_loss<=5.1"."""
  match = _TARGET.match(text.strip())
  if not match:
    raise ValueError(f"--time-to {text!r}: expected [SPLIT/]METRIC>=VALUE or <=VALUE, e.g. "
                     "eval/mlm_accuracy>=0.26")
  return Target(match["split"] or "eval", match["metric"], float(match["value"]),
                match["op"] != "<=")


def _machine() -> dict[str, Any]:
  cpu = platform.processor()
  try:
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
               if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version()}


def time_to(config: str, overrides: Sequence[tuple[str, str]], target: Target, *,
            workdir: str = "", timeout: float = 0.0,
            log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
  """Trains `config` with `overrides` from the fresh `workdir` (a new temporary one when
  empty) until an eval record meets `target`; the record: whether and when it was met, every
  eval of the metric with its time, the command and the machine."""
  if workdir:
    if Path(workdir).exists() and any(Path(workdir).iterdir()):
      raise ValueError(f"--workdir {workdir} is not empty: the time to accuracy is measured "
                       "from a fresh workdir")
  else:
    workdir = tempfile.mkdtemp(prefix="bertjax-time-to-")
  metrics = Path(workdir) / "metrics.jsonl"
  command = [sys.executable, "-m", "bertjax", "train", "--config", config, "--workdir", workdir,
             *(f"--config.{k}={v}" for k, v in overrides)]
  output = Path(workdir).parent / (Path(workdir).name + ".log")
  evals: list[dict[str, float]] = []
  reached = None
  with open(output, "w") as out:
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    read = 0
    try:
      while reached is None:
        done = proc.poll() is not None
        if metrics.exists():
          text = metrics.read_text()
          complete = text[read:text.rfind("\n") + 1]
          read += len(complete)
          for line in complete.splitlines():
            record = json.loads(line)
            if record.get("split") == target.split and target.metric in record:
              seconds = time.perf_counter() - start
              evals.append({"step": record["step"], "value": record[target.metric],
                            "seconds": round(seconds, 2)})
              log(f"step {record['step']}: {target.split}/{target.metric} "
                  f"{record[target.metric]:.4f} at {seconds:.1f} s")
              if target.met(record[target.metric]) and reached is None:
                reached = evals[-1]
        if done or reached is not None:
          break
        if timeout and time.perf_counter() - start > timeout:
          break
        time.sleep(0.1)
    finally:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
  return {"config": config, "overrides": dict(overrides), "target": str(target),
          "reached": reached is not None, "seconds": reached["seconds"] if reached else None,
          "step": reached["step"] if reached else None, "evals": evals,
          "exit_status": proc.returncode if reached is None else None,
          "command": " ".join(command[1:]), "workdir": workdir, "log": str(output),
          "machine": _machine(), "date": time.strftime("%Y-%m-%d %H:%M")}


def format_record(record: dict[str, Any]) -> str:
  if record["reached"]:
    return (f"{record['target']} reached at step {record['step']} after "
            f"{record['seconds']:.1f} s (from a fresh workdir; {record['machine']['cores']} "
            f"cores of {record['machine']['cpu']})")
  last = record["evals"][-1] if record["evals"] else None
  return (f"{record['target']} not reached" + (
      f": the last eval, step {last['step']}, gave {last['value']:.4f} at {last['seconds']:.1f} s"
      if last else ": no eval record") + f" (run log: {record['log']})")
