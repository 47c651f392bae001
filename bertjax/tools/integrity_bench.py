"""`bertjax bench --compare integrity`: what the integrity check (bertjax.resilience.replicas)
costs a run: the config's step on the config's mesh, and the check as the loop runs it every
`resilience.replica_check_every` steps (the copy after the step before, the replica comparison
and, where blocks have one copy, the replay after the check step), timed in alternating
rounds in one process: each round a block of steps and one check, their order swapped every
round, and the check's time over `every` of that round's steps. The time is what the run's
ledger counts as `integrity_check`; the first check, which compiles the replay's step and the
fingerprints, is reported apart. Guide: docs/resilience.md, 'What the integrity check costs'.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from bertjax.resilience.ledger import Ledger
from bertjax.resilience.replicas import CATEGORY, IntegrityCheck
from bertjax.tools import bench
from bertjax.training.trainer import Trainer


class _WholeBatch:
  """The loop's phase as the check reads it, for one process holding the whole batch."""

  accum_steps = 1

  def global_batch(self, trainer: Trainer, local: dict[str, np.ndarray]
                   ) -> dict[str, jax.Array]:
    return {k: jax.device_put(v, trainer.batch_shardings[k]) for k, v in local.items()}


def integrity_overhead(config: ml_collections.ConfigDict, *, steps: int = 3, pairs: int = 4,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
  """Median step time, the check's seconds per round and their ratio to `every` steps of the
  same round."""
  every = int(config.resilience.replica_check_every)
  if every < 2:
    raise ValueError("--compare integrity times the check at its cadence: "
                     f"resilience.replica_check_every must be 2 or more, not {every}")
  batch = bench.synthetic_batch(config)
  ours = bench.OurStep(config, batch)
  log(f"step compiled in {ours.compile_seconds:.1f} s on mesh {dict(ours.mesh.shape)}")
  ledger = Ledger(tempfile.gettempdir(), 0, enabled=False)
  faults: list[dict[str, Any]] = []
  check = IntegrityCheck(ours.trainer.config.resilience, ours.trainer,
                         lambda mesh: Trainer(ours.trainer.config, mesh), ledger, faults.append)
  phase = _WholeBatch()

  def one_check() -> tuple[float, float]:
    """(seconds after the step before the check step, seconds after the check step), as the
    ledger counts them; the check step's own time is the step's."""
    start = ledger.seconds[CATEGORY]
    check.after_step(ours.state, every - 1, phase, batch)
    before = ledger.seconds[CATEGORY] - start
    ours.run(1)
    check.after_step(ours.state, every, phase, batch)
    return before, ledger.seconds[CATEGORY] - start - before

  record: dict[str, Any] = {
      "machine": bench.machine(), "mesh": dict(ours.mesh.shape), "every": every,
      "config": {"family": config.model.family, "batch_size": int(config.batch_size),
                 "seq_length": int(config.seq_length),
                 "dtype": ours.trainer.model_config.dtype},
      "steps": steps, "rounds": pairs, "checks": check.enabled}
  if not check.enabled:
    log("one device: nothing to compare, the check does nothing")
    start = ledger.seconds[CATEGORY]
    check.after_step(ours.state, every, phase, batch)
    return {**record, "first_check_seconds": ledger.seconds[CATEGORY] - start,
            "seconds": {"step": None, "check": 0.0}, "ratios": [], "median_ratio": 0.0}
  first = sum(one_check())
  log(f"first check (compiles the fingerprints{' and the replay step' if check.replays else ''}"
      f"): {first:.1f} s; replays: {check.replays}")
  bench._block_times(ours.run, steps)  # one untimed block: caches and thread pools warm
  step_times, checks, parts, ratios = [], [], [], []
  for round_ in range(pairs):
    block = None
    if round_ % 2 == 0:
      block = statistics.median(bench._block_times(ours.run, steps))
    part = one_check()
    if block is None:
      block = statistics.median(bench._block_times(ours.run, steps))
    step_times.append(block)
    checks.append(sum(part))
    parts.append(part)
    ratios.append(sum(part) / (every * block))
    log(f"round {round_ + 1}/{pairs}: step {block * 1e3:.1f} ms, check {sum(part) * 1e3:.1f} ms "
        f"(copy {part[0] * 1e3:.1f} + check {part[1] * 1e3:.1f}); over {every} steps "
        f"{ratios[-1]:.6f}")
  if faults:
    raise RuntimeError(f"the integrity check found a difference in a healthy step: {faults}")
  return {**record, "first_check_seconds": first, "replays": check.replays,
          "seconds": {"step": statistics.median(step_times), "check": statistics.median(checks),
                      "copy": statistics.median(p[0] for p in parts),
                      "compare": statistics.median(p[1] for p in parts)},
          "ratios": ratios, "median_ratio": statistics.median(ratios)}


def format_record(record: dict[str, Any]) -> str:
  c, s = record["config"], record["seconds"]
  where = (f"{c['family']} batch {c['batch_size']} x {c['seq_length']} ({c['dtype']}) on mesh "
           f"{record['mesh']} of {record['machine']['cpu']} ({record['machine']['platform']})")
  if not record["checks"]:
    return f"{where}: one device, the check does nothing (0 s)"
  return (f"{where}, every {record['every']} steps: step {s['step'] * 1e3:.1f} ms, check "
          f"{s['check'] * 1e3:.1f} ms (copy {s['copy'] * 1e3:.1f} ms, fingerprints"
          f"{' and replay' if record['replays'] else ''} {s['compare'] * 1e3:.1f} ms; the first "
          f"{record['first_check_seconds']:.1f} s with its compiles); over {record['every']} "
          "steps, per round: " + ", ".join(f"{r:.6f}" for r in record["ratios"])
          + f"; median {record['median_ratio']:.6f} ({100 * record['median_ratio']:+.3f}%)")
