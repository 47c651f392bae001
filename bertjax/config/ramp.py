"""Batch-size ramps and sequence-length warmup, keyed on the samples consumed (GPT-3, Brown et
al. 2020, App. B; ModernBERT, Warner et al. 2024; Li et al. 2022).

`batch_ramp` states a ramp as Megatron-LM's `--rampup-batch-size START INCREMENT SAMPLES`
does; being keyed on samples, the point on the ramp follows from the step alone
(`BatchRamp.table`). Each distinct batch size is a stage, compiled once, built from the
loader's unit batches (`interleave`, `accum_steps`); the learning-rate schedule counts
full-batch steps (`full_batch_steps`).

The guide: docs/training.md, 'Batch-size ramps and sequence-length warmup'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax.data.schema import objective


@dataclasses.dataclass(frozen=True)
class Stage:
  """Steps `first_step` (0-based) to the next stage's first step train on `batch_size`."""

  first_step: int
  batch_size: int
  samples_before: int  # sequences consumed by the steps before this stage


@dataclasses.dataclass(frozen=True)
class BatchRamp:
  """The stages of a ramp; the last one (the full batch) lasts to the end of training."""

  stages: tuple[Stage, ...]
  unit: int  # rows of every loader batch; each stage's batch is a multiple of it

  def stage_index(self, step: int) -> int:
    """The stage that the step with 0-based index `step` trains in."""
    firsts = [stage.first_step for stage in self.stages]
    return int(np.searchsorted(firsts, step, side="right")) - 1

  def batch_size(self, step: int) -> int:
    return self.stages[self.stage_index(step)].batch_size

  def samples_before(self, step: int) -> int:
    """Sequences consumed by steps 0..step-1."""
    stage = self.stages[self.stage_index(step)]
    return stage.samples_before + (step - stage.first_step) * stage.batch_size

  def full_batches(self, steps: int) -> float:
    """The sequences steps 0..steps-1 consume, in full batches: a ramped run's length as its
    schedule and its compile report count it (the caller rounds)."""
    return self.samples_before(steps) / self.stages[-1].batch_size

  def full_batch_steps(self, count: jnp.ndarray) -> jnp.ndarray:
    """`samples_before(count)` / the full batch, traceable: the optimizer's step count as the
    learning-rate schedule reads it. Float32: exact to 2^24 samples, then within ~1e-7 of the
    count, well inside a schedule's resolution."""
    count = jnp.asarray(count, jnp.float32)
    full = self.stages[-1].batch_size
    samples = jnp.float32(0.0)
    for stage, following in zip(self.stages, [*self.stages[1:], None]):
      steps = count - stage.first_step
      if following is not None:
        steps = jnp.minimum(steps, following.first_step - stage.first_step)
      samples = samples + jnp.maximum(steps, 0.0) * stage.batch_size
    return samples / full

  def table(self, seq_length: int) -> list[str]:
    """One line per stage: its steps, batch and the tokens consumed before it."""
    lines = []
    for index, stage in enumerate(self.stages):
      last = (f"{self.stages[index + 1].first_step}" if index + 1 < len(self.stages)
              else "end")
      lines.append(f"steps {stage.first_step + 1}..{last}: batch {stage.batch_size} "
                   f"({stage.batch_size // self.unit} x {self.unit}) from "
                   f"{stage.samples_before * seq_length:,} tokens")
    return lines


def enabled(config: ml_collections.ConfigDict) -> bool:
  return "batch_ramp" in config and int(config.batch_ramp.start_batch_size) > 0


def from_config(config: ml_collections.ConfigDict) -> BatchRamp | None:
  """The config's ramp (None without one); ValueError naming the key for one that cannot
  run."""
  if not enabled(config):
    return None
  ramp = config.batch_ramp
  return build(int(ramp.start_batch_size), int(ramp.increment), int(ramp.samples),
               int(config.batch_size))


def build(start: int, increment: int, samples: int, batch_size: int) -> BatchRamp:
  """Megatron-LM's ramp: start, start + increment, ... up to batch_size, one increment per
  samples / number-of-increments sequences consumed."""
  if not 0 < start < batch_size:
    raise ValueError(f"batch_ramp.start_batch_size={start} must be in 1..batch_size-1="
                     f"{batch_size - 1} (0: no ramp)")
  if increment <= 0 or (batch_size - start) % increment:
    raise ValueError(f"batch_ramp.increment={increment} must be positive and divide "
                     f"batch_size - start_batch_size = {batch_size - start}")
  increments = (batch_size - start) // increment
  if samples < increments:
    raise ValueError(f"batch_ramp.samples={samples} must be at least the {increments} "
                     "increments of the ramp")
  per_increment = samples / increments
  stages, step, consumed = [], 0, 0
  for index in range(increments):
    size = start + index * increment
    stages.append(Stage(step, size, consumed))
    # Steps of this size until (index + 1) increments' worth of samples are consumed.
    steps = max(math.ceil(((index + 1) * per_increment - consumed) / size), 1)
    step, consumed = step + steps, consumed + steps * size
  stages.append(Stage(step, batch_size, consumed))
  return BatchRamp(tuple(stages), math.gcd(start, increment, batch_size))


def steps_for_samples(ramp: BatchRamp | None, samples: int, batch_size: int) -> int:
  """Steps that consume at least `samples` sequences."""
  if ramp is None:
    return math.ceil(samples / batch_size)
  last = ramp.stages[-1]
  if samples <= last.samples_before:
    return next(stage.first_step + math.ceil((samples - stage.samples_before)
                                             / stage.batch_size)
                for stage in reversed(ramp.stages) if stage.samples_before < samples)
  return last.first_step + math.ceil((samples - last.samples_before) / last.batch_size)


def interleave(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  """m loader batches of this host's rows as this host's rows of one batch of m units: row r of
  part j becomes row r * m + j. Unit batch j is then micro-batch j of the m-way split (rows j,
  j + m, ...), and a device's block of the large batch holds exactly the rows of its blocks of
  the parts."""
  return {key: np.stack([part[key] for part in parts], axis=1).reshape(
      (-1,) + parts[0][key].shape[1:]) for key in parts[0]}


@dataclasses.dataclass(frozen=True)
class SeqWarmup:
  """Sequence-length warmup (Li et al. 2022, "The Stability-Efficiency Dilemma"; DeepSpeed's
  seqlen curriculum): causal-LM rows cut to `length_at(samples consumed)` tokens, growing from
  `start` by `increment` each `per_increment` sequences consumed until `full` (Megatron-LM's
  ramp rule applied to the length). The rows' later tokens are not trained on while a row is
  cut; the data stream is the full-length one."""

  start: int
  increment: int
  per_increment: float
  full: int

  def length_at(self, samples: int) -> int:
    return min(self.start + int(samples / self.per_increment) * self.increment, self.full)

  def lengths(self) -> list[int]:
    return list(range(self.start, self.full, self.increment)) + [self.full]


def seq_warmup_from_config(config: ml_collections.ConfigDict) -> SeqWarmup | None:
  """The config's sequence-length warmup (None without one); ValueError naming the key for one
  that cannot run."""
  if "seq_warmup" not in config or not int(config.seq_warmup.start_length):
    return None
  warmup, full = config.seq_warmup, int(config.seq_length)
  start, increment, samples = (int(warmup.start_length), int(warmup.increment),
                               int(warmup.samples))
  if not 0 < start < full:
    raise ValueError(f"seq_warmup.start_length={start} must be in 1..seq_length-1={full - 1} "
                     "(0: no warmup)")
  if increment <= 0 or (full - start) % increment:
    raise ValueError(f"seq_warmup.increment={increment} must be positive and divide "
                     f"seq_length - start_length = {full - start}")
  if not objective(config.objective).causal:
    raise ValueError(f"seq_warmup cuts causal-LM rows; objective {config.objective!r} has "
                     "positions that a cut row would lose (masked-LM predictions, pairs)")
  increments = (full - start) // increment
  if samples < increments:
    raise ValueError(f"seq_warmup.samples={samples} must be at least the {increments} "
                     "increments of the warmup")
  return SeqWarmup(start, increment, samples / increments, full)


def cut_rows(batch: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
  """A causal-LM batch's rows cut to their first `length` tokens (every field is [B, L])."""
  return {key: value[:, :length] for key, value in batch.items()}


def validate(config: ml_collections.ConfigDict) -> None:
  """Errors naming the key for a ramp that cannot run with the rest of the config."""
  warmup = seq_warmup_from_config(config)
  if warmup is not None and int(config.phase2.start_step) > 0:
    raise ValueError("seq_warmup and phase2 cannot be combined: a warmup keeps one data "
                     "stream, a second phase starts another")
  ramp = from_config(config)
  if ramp is None:
    return
  if int(config.phase2.start_step) > 0:
    raise ValueError("batch_ramp and phase2 cannot be combined: a ramp keeps one data stream, "
                     "a second phase starts another")


def accum_steps(batch_size: int, micro_rows: int, ways: int = 1) -> int:
  """Micro-batches of a stage: the fewest that divide its batch into at most `micro_rows` rows
  each (the full batch's micro-batch: what fits in memory at the full batch fits at every
  stage), each a multiple of the mesh's `ways` data-parallel ways."""
  for accum in range(max(math.ceil(batch_size / micro_rows), 1), batch_size + 1):
    if batch_size % accum == 0 and (batch_size // accum) % ways == 0:
      return accum
  raise ValueError(f"batch_ramp: a batch of {batch_size} sequences cannot be split over the "
                   f"mesh's {ways} data-parallel ways (make batch_ramp.start_batch_size and "
                   "increment multiples of them)")
