"""`bertjax bench --compare guard`: what the in-step spike guard (bertjax.resilience.guard)
costs the train step: the config's step without the guard, with its detector alone
(`skip_spikes=False`) and with detector and skip, compiled side by side and timed in rotating
blocks in one process (only ratios taken side by side mean anything on a drifting machine);
guide: docs/resilience.md, 'What the guard costs'.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import ml_collections

from bertjax.tools import bench

VARIANTS = {"plain": (0.0, True), "detector": (6.0, False), "skip": (6.0, True)}


def guard_overhead(config: ml_collections.ConfigDict, *, steps: int = 5, pairs: int = 5,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
  """Median step times of each variant and, per round, each guarded variant's ratio to the
  plain step of the same round."""
  batch = bench.synthetic_batch(config)
  variants = {}
  for name, (sigmas, skip) in VARIANTS.items():
    variant = ml_collections.ConfigDict(config.to_dict())
    variant.resilience.spike_sigmas = sigmas
    variant.resilience.skip_spikes = skip
    variants[name] = bench.OurStep(variant, batch)
    log(f"{name}: compiled in {variants[name].compile_seconds:.1f} s")
  for name in variants:  # one untimed block each: caches and thread pools warm
    bench._block_times(variants[name].run, steps)
  names = list(variants)
  times: dict[str, list[float]] = {name: [] for name in names}
  ratios: dict[str, list[float]] = {"detector": [], "skip": []}
  for round_ in range(pairs):
    # Rotate the order, so that no variant always follows the same one.
    order = names[round_ % len(names):] + names[:round_ % len(names)]
    block = {}
    for name in order:
      block[name] = statistics.median(bench._block_times(variants[name].run, steps))
      times[name].append(block[name])
    for name in ratios:
      ratios[name].append(block[name] / block["plain"])
    log(f"round {round_ + 1}/{pairs}: " + ", ".join(
        f"{n} {block[n] * 1e3:.1f} ms" for n in names) + "; ratios " + ", ".join(
        f"{n} {ratios[n][-1]:.4f}" for n in ratios))
  return {"machine": bench.machine(), "config": {
              "family": config.model.family, "batch_size": int(config.batch_size),
              "seq_length": int(config.seq_length),
              "dtype": variants["plain"].trainer.model_config.dtype},
          "steps": steps, "rounds": pairs,
          "seconds": {n: statistics.median(times[n]) for n in names},
          "ratios": ratios,
          "median_ratio": {n: statistics.median(r) for n, r in ratios.items()}}


def format_record(record: dict[str, Any]) -> str:
  c = record["config"]
  m = record["median_ratio"]
  return (f"{c['family']} batch {c['batch_size']} x {c['seq_length']} ({c['dtype']}) on "
          f"{record['machine']['cpu']} ({record['machine']['platform']}): "
          + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in record["seconds"].items())
          + " per step (medians); against plain, per round: detector "
          + ", ".join(f"{r:.4f}" for r in record["ratios"]["detector"]) + ", skip "
          + ", ".join(f"{r:.4f}" for r in record["ratios"]["skip"])
          + f"; medians: detector {m['detector']:.4f} ({100 * (m['detector'] - 1):+.2f}%), "
          f"skip {m['skip']:.4f} ({100 * (m['skip'] - 1):+.2f}%)")
