"""Training phases: BERT's two-phase schedule as one run.

Devlin et al. (2019, App. A.2) train 90% of the steps at sequence length 128 and the last 10%
at 512; You et al. (2020) and NVIDIA's LAMB recipe also change the global batch and restart
the learning-rate schedule at the switch. The config's `phase2` group says what changes from
`phase2.start_step` on; `config_at(config, step)` is the config the step runs with, and the
training loop switches its data iterator and compiled step by itself.

The guide: docs/training.md, 'Two phases in one run'.
"""

from __future__ import annotations

import ml_collections

from bertjax.config import ramp

# Keys of `phase2` that replace the top-level key of the same name (0 keeps phase 1's value).
SWITCHED_KEYS = ("seq_length", "batch_size", "max_predictions", "grad_accum_steps")


def num_phases(config: ml_collections.ConfigDict) -> int:
  return 2 if int(config.phase2.start_step) > 0 else 1


def phase_of(config: ml_collections.ConfigDict, step: int) -> int:
  """0 or 1: the phase that the step with 0-based index `step` trains in."""
  start = int(config.phase2.start_step)
  return 1 if 0 < start <= step else 0


def config_at(config: ml_collections.ConfigDict, step: int) -> ml_collections.ConfigDict:
  """The config the step with 0-based index `step` trains with (phase 2's values replaced).

  Phase 2 reads a corpus with seed `data.seed + 1`: its order and masks are its own, not a
  replay of phase 1's first batches (google-research/bert builds phase 2's data separately).
  (The synthetic test stream keeps its seed: there the seed is the language itself.)"""
  if phase_of(config, step) == 0:
    return config
  switched = config.copy_and_resolve_references()
  for key in SWITCHED_KEYS:
    value = int(config.phase2[key])
    if value:
      switched[key] = value
  if config.data.source == "corpus":
    switched.data.seed = int(config.data.seed) + 1
  return switched


def validate(config: ml_collections.ConfigDict) -> None:
  """Errors naming the key for a phase 2 (or a batch ramp) that cannot run."""
  ramp.validate(config)
  start, total = int(config.phase2.start_step), int(config.num_train_steps)
  if start < 0 or (start and start >= total):
    raise ValueError(f"phase2.start_step={start} must be in 1..num_train_steps-1={total - 1} "
                     "(0: one phase)")
  if not start:
    return
  seq = int(config.phase2.seq_length) or int(config.seq_length)
  if seq > int(config.model.max_positions):
    raise ValueError(f"phase2.seq_length={seq} exceeds model.max_positions="
                     f"{config.model.max_positions}")
  batch = int(config.phase2.batch_size) or int(config.batch_size)
  accum = int(config.phase2.grad_accum_steps) or int(config.grad_accum_steps)
  if batch % accum:
    raise ValueError(f"phase 2: batch_size={batch} is not divisible by grad_accum_steps={accum}")
  if int(config.phase2.warmup_steps) > total - start:
    raise ValueError(f"phase2.warmup_steps={config.phase2.warmup_steps} exceeds phase 2's "
                     f"{total - start} steps")
