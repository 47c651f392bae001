"""Training checkpoints: everything needed to continue a run exactly, saved asynchronously.

WORKDIR/checkpoints/<step>/ is an Orbax CheckpointManager step with four items: `params` (a
distillation run's student only), `train` (step, optimizer state, dropout RNG key data), `data`
(the data iterators' state, one JSON file per process, restorable onto any process count:
`DataStateHandler`) and `config` (the resolved run config). A step killed mid-write is never
listed; restoring falls back from a damaged step to the previous complete one.

The guide: docs/checkpoints.md, 'Saving' and 'Resuming'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from bertjax import paths
from bertjax.data.pipeline import merge_states
from bertjax.models.params import shape_mismatches

log = logging.getLogger(__name__)

ITEMS = ("params", "train", "data", "config")
# Items a run may add (`extra`): its own state as JSON ("run": a fine-tune's best score, the
# evaluations so far) and a parameter tree ("best": the best parameters so far).
EXTRA_ITEMS = ("run", "best")


class CheckpointMismatch(ValueError):
  """A checkpoint whose arrays do not fit the config (never silently skipped)."""


class CheckpointWriteError(ValueError):
  """Writing a checkpoint failed (a full disk, a read-only or unreachable store)."""


# Orbax writes this into a step and into each of its items once they are complete.
COMMIT_MARKER = "commit_success.txt"


def failure_reason(error: BaseException) -> str:
  """One line from a checkpoint library's exception: the innermost cause's first line, without
  the TensorStore spec dumps that follow it."""
  inner, seen = error, set()
  while id(inner) not in seen and (inner.__cause__ or inner.__context__) is not None:
    seen.add(id(inner))
    inner = inner.__cause__ or inner.__context__
  text = (str(inner).strip().splitlines() or [""])[0] or type(inner).__name__
  for cut in (" [tensorstore_spec=", " See full TensorStore details", " [os_error_code"):
    text = text.split(cut)[0]
  if "No space left on device" in text:
    return "no space left on device"
  return text[:500]


def _failed_step(error: BaseException, default: int | None) -> int | None:
  """The step whose write failed, read from the temporary path in the error (a save reports
  the failure of the one before it, still in the background)."""
  inner = error
  while inner.__cause__ is not None or inner.__context__ is not None:
    found = re.search(r"/(\d+)\.orbax-checkpoint-tmp", str(inner))
    if found:
      return int(found.group(1))
    inner = inner.__cause__ or inner.__context__
  found = re.search(r"/(\d+)\.orbax-checkpoint-tmp", str(inner))
  return int(found.group(1)) if found else default


class DataStateHandler(ocp.CheckpointHandler):
  """The data iterators' positions: each process writes its iterator's state as
  `process_<i>.json`; a restore reads every process's file and hands the merged state to the
  iterator (`pipeline.merge_states`), which takes its own rows from it. So a run saved by N
  processes resumes exactly on M. Written synchronously at save time: the state of the
  batches consumed up to the saved step."""

  def save(self, directory: epath.Path, args: DataSave) -> None:
    state = json.dumps(args.iterator.get_state())
    (directory / f"process_{jax.process_index()}.json").write_text(state)

  def restore(self, directory: epath.Path, args: DataRestore) -> Any:
    files = sorted(directory.glob("process_*.json"))
    if not files:
      raise FileNotFoundError(f"{directory}: no data-iterator state (process_*.json)")
    args.iterator.set_state(merge_states([json.loads(f.read_text()) for f in files]))
    return args.iterator

  def metadata(self, directory: epath.Path) -> None:
    return None

  def finalize(self, directory: epath.Path) -> None:
    pass

  def close(self) -> None:
    pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
  iterator: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
  iterator: Any


def _leaves(tree: Any) -> dict[str, Any]:
  """Path -> leaf (an array, its shape struct or Orbax's metadata: anything with a .shape)."""
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _train_item(state: Any) -> dict[str, Any]:
  """What the `train` item holds: step, optimizer state, dropout key and, when the spike guard
  is on, its statistics (bertjax.resilience.guard)."""
  item = {"step": state.step, "opt_state": state.opt_state, "rng": state.rng}
  guard = getattr(state, "guard", None)
  if guard is not None:  # as a dict: a checkpoint's tree is plain containers
    item["guard"] = {f.name: getattr(guard, f.name) for f in dataclasses.fields(guard)}
  return item


def _zeros_like(abstract: Any) -> Any:
  """Zeros in the shardings of an abstract tree (a guard that starts afresh)."""
  return jax.tree.map(lambda a: jax.jit(lambda: jax.numpy.zeros(a.shape, a.dtype),
                                        out_shardings=a.sharding)(), abstract)


class TrainCheckpoints:
  """The CheckpointManager of one run directory."""

  def __init__(self, workdir: str | Path, config: ml_collections.ConfigDict,
               extra: tuple[str, ...] = (),
               teacher_loader: Callable[[Any], Any] | None = None):
    """`teacher_loader`: a distillation run's teacher weights placed into the shardings of its
    abstract parameters (bertjax.training.distillation.Teacher.load). A teacher is input, not
    state: never saved, read again from its source on restore."""
    c = config.checkpoint
    unknown = set(extra) - set(EXTRA_ITEMS)
    if unknown:
      raise ValueError(f"unknown checkpoint items {sorted(unknown)}; extras: {EXTRA_ITEMS}")
    self.items = ITEMS + tuple(extra)
    self.directory = paths.path(workdir) / "checkpoints"
    self.teacher_loader = teacher_loader
    self.every = int(c.every)
    options = ocp.CheckpointManagerOptions(
        # Saves are decided by the loop (interval, preemption, the end); Orbax keeps K.
        save_interval_steps=1,
        max_to_keep=int(c.keep) if c.keep else None,
        keep_period=int(c.keep_period) if c.keep_period else None,
        enable_async_checkpointing=bool(c.async_save),
        cleanup_tmp_directories=True,
        create=True)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=self.items,
        item_handlers={name: handler for name, handler in (
            ("params", ocp.StandardCheckpointHandler()),
            ("train", ocp.StandardCheckpointHandler()), ("data", DataStateHandler()),
            ("config", ocp.JsonCheckpointHandler()), ("run", ocp.JsonCheckpointHandler()),
            ("best", ocp.StandardCheckpointHandler())) if name in self.items})

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def resume_candidates(self, restore_step: int) -> list[int]:
    """The steps a run resumes from, in the order a restore tries them: `restore_step` alone
    when it is >= 0 (the config's `restore_step`), else every step, the latest first."""
    return [restore_step] if restore_step >= 0 else self.steps()[::-1]

  def due(self, step: int, total: int, evaluated: bool = False) -> bool:
    """Whether `step` is saved: the last step, every `checkpoint.every` steps, or with
    `checkpoint.every=-1` each step that was evaluated."""
    return (step == total or (self.every > 0 and step % self.every == 0)
            or (self.every == -1 and evaluated))

  def save(self, step: int, state: Any, batches: Any, config: ml_collections.ConfigDict,
           extra: dict[str, Any] | None = None) -> None:
    """Starts an (async) save of `step`; returns once the device arrays are copied. A failed
    write (this one or the previous one still in the background) raises CheckpointWriteError."""
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        train=ocp.args.StandardSave(_train_item(state)),
        data=DataSave(batches),
        config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())),
        **{name: (ocp.args.JsonSave(value) if name == "run" else ocp.args.StandardSave(value))
           for name, value in (extra or {}).items()})
    try:
      self.manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - any write failure: one line naming the cause
      raise self._write_error(e, step) from None

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._write_error(e, None) from None

  def _write_error(self, error: BaseException, step: int | None) -> CheckpointWriteError:
    failed = _failed_step(error, step)
    what = f"checkpoint step {failed}" if failed is not None else "a checkpoint"
    return CheckpointWriteError(f"writing {what} in {self.directory} failed: "
                                f"{failure_reason(error)}")

  def problem(self, step: int) -> str | None:
    """Why `step` cannot be a complete checkpoint, from its files alone (None: it looks whole):
    a missing commit marker, item, metadata, OCDBT manifest or data-iterator state."""
    directory = self.directory / str(step)
    # Orbax of this generation marks every finished step and item; a step without a marker in
    # a directory whose steps have them did not finish (or was damaged).
    marked = any((self.directory / str(s) / COMMIT_MARKER).exists() for s in self.steps())
    if marked and not (directory / COMMIT_MARKER).exists():
      return f"{directory / COMMIT_MARKER} is missing (the save did not finish)"
    for item in self.items:
      item_dir = directory / item
      if not item_dir.is_dir():
        return f"{item_dir} is missing"
      if marked and not (item_dir / COMMIT_MARKER).exists():
        return f"{item_dir / COMMIT_MARKER} is missing (the save did not finish)"
    for item in ("params", "train"):
      metadata = directory / item / "_METADATA"
      if not metadata.exists():
        return f"{metadata} is missing"
      try:
        json.loads(metadata.read_text())
      except (ValueError, UnicodeDecodeError):
        return f"{metadata} is not readable"
      if any((directory / item).glob("ocdbt.process_*")) and not (
          directory / item / "manifest.ocdbt").exists():
        return f"{directory / item / 'manifest.ocdbt'} is missing"
    if not any((directory / "data").glob("process_*.json")):
      return f"{directory / 'data'} holds no data-iterator state (process_*.json)"
    return None

  def close(self) -> None:
    """Waits for the pending writes and closes the manager, whatever fails; a write that
    failed in the background raises the one-line CheckpointWriteError (unwrapped, the
    library's own multi-line message)."""
    failure = None
    for finish in (self.manager.wait_until_finished, self.manager.close):
      try:
        finish()
      except Exception as e:  # noqa: BLE001 - any write failure: one line naming the cause
        failure = failure or self._write_error(e, None)
    if failure is not None:
      raise failure

  def check_shapes(self, step: int, abstract_params: Any) -> None:
    """Raises CheckpointMismatch listing every parameter whose shape differs."""
    saved = _leaves(self.manager.item_metadata(step)["params"])
    problems = shape_mismatches(saved, _leaves(abstract_params), "config")
    if problems:
      raise CheckpointMismatch(
          f"checkpoint step {step} in {self.directory} does not fit the config "
          f"({len(problems)} parameter(s)):\n  " + "\n  ".join(problems[:20]))

  def restore(self, abstract_state: Any, batches: Any | None,
              step: int | None = None) -> tuple[Any, int]:
    """The state (into the shardings of `abstract_state`, whatever mesh it was saved on) and
    the data iterator position of `step` (default: the latest complete step, falling back to
    earlier ones when a step cannot be read)."""
    steps = self.steps()
    if step is not None:
      if step not in steps:
        raise ValueError(f"no checkpoint of step {step} in {self.directory}; steps: {steps}")
      candidates = [step]
    else:
      candidates = steps[::-1]
    errors = []
    for number, candidate in enumerate(candidates):
      fallback = (f"; falling back to step {candidates[number + 1]}"
                  if number + 1 < len(candidates) else "")
      problem = self.problem(candidate)
      if problem is not None:
        errors.append(f"step {candidate}: {problem}")
        log.warning("checkpoint step %d cannot be restored: %s%s", candidate, problem, fallback)
        continue
      train_item = _train_item(abstract_state)
      guard = getattr(abstract_state, "guard", None)
      try:
        fresh_guard = guard is not None and not self._has_guard(candidate, guard)
        if fresh_guard:  # saved before the spike guard existed, with it off or another rule
          del train_item["guard"]
        items = {
            "params": ocp.args.StandardRestore(abstract_state.params),
            "train": ocp.args.StandardRestore(train_item),
        }
        if batches is not None:
          items["data"] = DataRestore(batches)
        self.check_shapes(candidate, abstract_state.params)
        restored = self.manager.restore(candidate, args=ocp.args.Composite(**items))
      except CheckpointMismatch:
        raise
      except Exception as e:  # noqa: BLE001 — any unreadable step: say so, try the previous
        message = failure_reason(e)
        errors.append(f"step {candidate}: {message}")
        log.warning("checkpoint step %d in %s cannot be restored: %s%s", candidate,
                    self.directory, message, fallback)
        continue
      train = restored["train"]
      state = abstract_state.replace(step=train["step"], params=restored["params"],
                                     opt_state=train["opt_state"], rng=train["rng"],
                                     guard=type(guard)(**train["guard"]) if guard is not None
                                     and not fresh_guard else None)
      if fresh_guard:
        log.info("checkpoint step %d has no spike-guard statistics of this rule: they start "
                 "afresh", candidate)
        state = state.replace(guard=_zeros_like(guard))
      if getattr(abstract_state, "teacher", None) is not None:
        if self.teacher_loader is None:
          raise ValueError("the state to restore has a distillation teacher but no teacher "
                           "source was given (distillation.teacher)")
        state = state.replace(teacher=self.teacher_loader(abstract_state.teacher))
      if candidate != candidates[0]:
        log.warning("resumed from step %d instead of the latest step %d", candidate,
                    candidates[0])
      return state, candidate
    raise ValueError(f"no checkpoint in {self.directory} can be restored:\n  " +
                     "\n  ".join(errors))

  def _has_guard(self, step: int, guard: Any) -> bool:
    """Whether checkpoint `step` holds statistics of this guard's rule and settings: the same
    fields (an earlier rule kept other quantities under other names) of the same shapes (a
    resumed run may change `resilience.spike_history` or `alarm_skips`)."""
    train = self.manager.item_metadata(step)["train"]
    if train is None or "guard" not in train:
      return False
    saved = train["guard"]
    if set(saved) != {f.name for f in dataclasses.fields(guard)}:
      return False
    return all(tuple(getattr(saved[f.name], "shape", ())) == tuple(getattr(guard, f.name).shape)
               for f in dataclasses.fields(guard))

  def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
    """Only the parameters of `step` (default latest): what export and fine-tuning need; the
    optimizer state is never read."""
    step = self.latest_step() if step is None else step
    if step is None or step not in self.steps():
      raise ValueError(f"no checkpoint{'' if step is None else f' of step {step}'} in "
                       f"{self.directory}; steps: {self.steps()}")
    self.check_shapes(step, abstract_params)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_params)))
    return restored["params"], step

  def restore_extra(self, step: int, best: Any | None = None) -> dict[str, Any]:
    """The run's own items of `step`: "run" (JSON) and, given its abstract tree, "best"."""
    items = {"run": ocp.args.JsonRestore()} if "run" in self.items else {}
    if best is not None and "best" in self.items:
      items["best"] = ocp.args.StandardRestore(best)
    return dict(self.manager.restore(step, args=ocp.args.Composite(**items))) if items else {}

  def saved_config(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))["config"]


def restore_or_initialize(checkpoints: TrainCheckpoints, abstract_state: Any,
                          batches: Any | None, restore_step: int,
                          initialize: Callable[[], Any]) -> tuple[Any, int | None]:
  """The run's state: its latest checkpoint (or `restore_step`'s, when >= 0) with the data
  position, or `initialize()` where the run has none yet. Returns the state and the step
  restored (None: initialised). Training on from an earlier step rewrites history: the
  checkpoints after it are deleted (a damaged step in the way would stop the new saves)."""
  if checkpoints.latest_step() is None:
    if restore_step >= 0:
      raise ValueError(f"restore_step={restore_step} but {checkpoints.directory} holds no "
                       "checkpoint")
    return initialize(), None
  requested = None if restore_step < 0 else restore_step
  state, step = checkpoints.restore(abstract_state, batches, requested)
  later = [s for s in checkpoints.steps() if s > step]
  if later:
    why = (f"restore_step={step}" if requested is not None else
           f"the later step(s) could not be restored; resuming from step {step}")
    log.warning("%s: deleting the later checkpoints %s", why, later)
    for s in later:
      checkpoints.manager.delete(s)
  log.info("resumed from %s step %d", checkpoints.directory, step)
  return state, step
