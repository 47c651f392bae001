"""What a run settles before its first step: the workdir's lock (process 0 holds it, every
process learns whether it could), the resumed config against its checkpoint's, and which
attempt of the run this start is (bertjax.resilience.ledger counts them).

The guide: docs/training.md, 'One run per workdir'.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.checkpoints.workdir import WorkdirLock, check_resume_config
from bertjax.parallel import distributed
from bertjax.resilience.ledger import attempts_so_far
from bertjax.training import defaults


def lock_workdir(workdir: epath.Path, is_main: bool) -> WorkdirLock:
  """Process 0 takes the workdir's lock; every process learns whether it could."""
  lock = WorkdirLock(workdir)
  failure = None
  if is_main:
    try:
      lock.acquire()
    except ValueError as e:
      failure = e
  if distributed.any_process(failure is not None):
    raise failure or ValueError(f"process 0 could not lock {workdir} (its message says why)")
  return lock


def check_resume(config: ml_collections.ConfigDict, checkpoints: TrainCheckpoints,
                  choices: Sequence[defaults.Choice] = ()) -> None:
  """A resumed run's config against the one its checkpoint was written with (an "auto"
  setting this machine resolves otherwise is named as such)."""
  current = json.loads(config.to_json_best_effort())
  hints = {c.key: f"{c.line()} here; --config.{c.key}=<the checkpoint's> continues as it was"
           for c in choices}
  for step in checkpoints.resume_candidates(int(config.restore_step)):
    try:
      saved = checkpoints.saved_config(step)
    except Exception:  # noqa: BLE001 - a damaged step: the restore's fallback reports it
      continue
    check_resume_config(saved, current, step, bool(config.resume_with_changes), hints)
    return


def attempt_number(workdir: epath.Path) -> int:
  """This start's number among the run's attempts in `workdir` (process 0 counts them)."""
  count = np.asarray(attempts_so_far(workdir) if jax.process_index() == 0 else 0, np.int32)
  if jax.process_count() > 1:
    count = multihost_utils.broadcast_one_to_all(count)
  return int(count) + 1
