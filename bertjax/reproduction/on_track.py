"""The on-track check of a run whose config has a contract: at each evaluation, the contract's
reference at the tokens trained so far, and whether each eval metric is inside its band.

Written into the eval record of metrics.jsonl (`<metric>_ref`, `_ref_low`, `_ref_high`,
`<metric>_on_track`: -1 below, 0 inside, +1 above; `on_track`: 1 when every metric is inside,
`tokens`) and one log line; `bertjax plot` draws the bands from those records. The guide:
docs/reproducing.md, "Is my run on track?".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import ml_collections

from bertjax.config import phases, ramp
from bertjax.reproduction import contract as contract_lib
from bertjax.reproduction.registry import load_contract

log = logging.getLogger(__name__)

REF, LOW, HIGH, VERDICT = "_ref", "_ref_low", "_ref_high", "_on_track"


def tokens_trained(config: ml_collections.ConfigDict, steps: int) -> float:
  """Token positions the first `steps` steps train on (rows x sequence length, padding
  included): each phase at its own batch and length, a batch-size ramp's smaller steps at their
  size. A sequence-length warmup's shorter rows count at the full length."""
  start2 = int(config.phase2.start_step) if phases.num_phases(config) == 2 else steps
  first = min(steps, start2)
  batch_ramp = ramp.from_config(config)
  rows = (batch_ramp.samples_before(first) if batch_ramp is not None
          else first * int(config.batch_size))
  tokens = float(rows) * int(config.seq_length)
  if steps > first:
    second = phases.config_at(config, start2)
    tokens += float(steps - first) * int(second.batch_size) * int(second.seq_length)
  return tokens


class OnTrack:
  """The check of one run (checks nothing when its config names no contract)."""

  def __init__(self, config: ml_collections.ConfigDict) -> None:
    self.config = config
    self.ref = str(config.get("contract", "") or "")
    self.contract = load_contract(self.ref) if self.ref else None

  def check(self, step: int, metrics: Mapping[str, float]) -> dict[str, float]:
    """The fields to add to the eval record of `step` (empty when the contract has no
    reference for any logged metric at these tokens), after one log line."""
    if self.contract is None:
      return {}
    tokens = tokens_trained(self.config, step)
    pairs = [(r, float(metrics[r.metric])) for r in self.contract.references(tokens)
             if r.metric in metrics]
    if not pairs:
      return {}
    fields: dict[str, float] = {"tokens": tokens}
    for reference, observed in pairs:
      fields[reference.metric + REF] = reference.value
      fields[reference.metric + LOW] = reference.low
      fields[reference.metric + HIGH] = reference.high
      fields[reference.metric + VERDICT] = float(reference.verdict(observed))
    inside = all(r.verdict(v) == 0 for r, v in pairs)
    fields["on_track"] = float(inside)
    text = contract_lib.describe(pairs)
    where = f"step {step} ({tokens:,.0f} tokens), contract {self.ref}"
    if inside:
      log.info("on track at %s: %s", where, text)
    else:
      log.warning("OFF TRACK at %s: %s", where, text)
    return fields


def verdicts(record: Mapping[str, float]) -> dict[str, int]:
  """metric -> verdict of an eval record written with the check's fields."""
  return {key[:-len(VERDICT)]: int(value) for key, value in record.items()
          if key.endswith(VERDICT)}
