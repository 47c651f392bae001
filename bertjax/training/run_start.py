"""What a run settles before its first step: the workdir's lock (process 0 holds it, every
process learns whether it could), what a resume keeps from the run's start (its "auto"
settings' values and its measured MFU peak), the resumed config against its checkpoint's, and
which attempt of the run this start is (bertjax.resilience.ledger counts them).

The guide: docs/training.md, 'One run per workdir'.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.checkpoints.workdir import WorkdirLock, check_resume_config
from bertjax.models.config import AUTO
from bertjax.parallel import distributed
from bertjax.resilience.ledger import attempts_so_far
from bertjax.training import defaults, flops

log = logging.getLogger(__name__)

# The measured MFU peak a run started with (flops.Peak.as_record), in its workdir.
PEAK_RECORD = "mfu_peak.json"


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


def recorded_settings(workdir: epath.Path, config: ml_collections.ConfigDict) -> dict[str, str]:
  """What the config's "auto" settings were resolved to when the run started: their values in
  the config of the checkpoint a resume starts from (the one `check_resume` compares with), by
  key; none for a fresh run or a config without "auto" settings. Every process reads it, as
  every process checks the resume."""
  keys = defaults.auto_keys(config)
  if not keys or not (workdir / "checkpoints").exists():
    return {}
  checkpoints = TrainCheckpoints(workdir, config)
  try:
    for step in checkpoints.resume_candidates(int(config.restore_step)):
      try:
        saved = checkpoints.saved_config(step)
      except Exception:  # noqa: BLE001 - a damaged step: the restore's fallback reports it
        continue
      values = {key: saved.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in keys}
      return {key: str(value) for key, value in values.items() if value not in (None, AUTO)}
    return {}
  finally:
    checkpoints.close()


def run_peak(workdir: epath.Path, dtype: str, resuming: bool, is_main: bool) -> flops.Peak:
  """The peak the run's MFU is measured against (`flops.run_peak`). A measured one (CPU) is
  recorded in WORKDIR/mfu_peak.json by process 0, when the run starts and whenever its steps
  raise it; a resume on the machine it was measured on continues against it, whatever the
  machine's peak cache holds today."""
  record = workdir / PEAK_RECORD
  peak = None
  if resuming and record.exists():
    try:
      peak = flops.recorded_peak(json.loads(record.read_text()), dtype)
      if peak is None:
        log.info("the run's recorded peak (%s) is of another machine or dtype: measuring "
                 "this one's", record)
    except (OSError, ValueError, KeyError, TypeError) as e:
      log.warning("could not read the run's recorded peak %s (%s): measuring it again", record,
                  e)
  peak = peak or flops.run_peak(dtype)
  if is_main and peak.cache_key is not None:
    peak.keep_in(record)
  return peak


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
