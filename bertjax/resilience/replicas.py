"""The integrity check: silent data corruption of the train state, found on any mesh.

Every `resilience.replica_check_every` steps each device fingerprints its own block of each
array of the train state (the wrapping sum of its bits as words: one flipped bit changes
it). Copies of a replicated block must agree; blocks with one copy (fsdp, tensor) are
checked by replaying the step, from a copy of the state before it, on the mesh with every
device's place taken by another, and comparing every block bit for bit. A difference is a
hardware fault (exit status 5). One device has nothing to compare: nothing runs. Its time
is the ledger's `integrity_check`.

The guide: docs/resilience.md, 'Step replay and silent data corruption'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec

from bertjax.resilience.ledger import Ledger
from bertjax.resilience.policy import HardwareFault
from bertjax.resilience.watchdog import EXIT_HARDWARE

log = logging.getLogger(__name__)

CATEGORY = "integrity_check"  # the ledger's category of the check's time
_SHOWN = 20  # differences an event lists (the count is always there)


def _word_sum(x: jax.Array) -> jax.Array:
  """The wrapping sum of `x`'s bits read as unsigned words, as one uint32. Flipping any one
  bit of a word adds or takes 2^b (b < 32) and so always changes it; an integer sum is the
  same in any order, however XLA splits the reduction."""
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint8)
  elif x.dtype.itemsize == 8:  # two uint32 words per element, along a new last axis
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
  return jnp.sum(words.astype(jnp.uint32), dtype=jnp.uint32)


class Fingerprints:
  """Per mesh position and per array of a tree laid out like `example`: the `_word_sum` of the
  block that position's device holds, read from its own memory (one shard_map program over the
  whole tree: no collective, no copy), compiled at the first call."""

  def __init__(self, example: Any) -> None:
    shardings = jax.tree.map(lambda x: x.sharding, example)
    kinds = {type(s).__name__ for s in jax.tree.leaves(shardings)}
    meshes = {getattr(s, "mesh", None) for s in jax.tree.leaves(shardings)}
    if kinds != {"NamedSharding"} or len(meshes) != 1:
      raise ValueError("the integrity check fingerprints a state laid out on one mesh by "
                       f"NamedShardings, not by {sorted(kinds)} on {len(meshes)} mesh(es)")
    self.mesh: Mesh = meshes.pop()

    def per_device(tree: Any) -> jax.Array:
      return jnp.stack([_word_sum(x) for x in jax.tree.leaves(tree)])[None]

    # Row r of the result is mesh position r (the mesh's devices in row-major order).
    self._program = jax.jit(
        jax.shard_map(per_device, mesh=self.mesh,
                      in_specs=(jax.tree.map(lambda s: s.spec, shardings),),
                      out_specs=PartitionSpec(self.mesh.axis_names), check_vma=False),
        in_shardings=(shardings,))

  def __call__(self, tree: Any) -> np.ndarray:
    """[mesh positions, arrays] uint32 on every process (an all-gather across processes)."""
    sums = self._program(tree)
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(sums, tiled=True))
    return np.asarray(jax.device_get(sums))


def rotated_mesh(mesh: Mesh) -> Mesh:
  """`mesh` with every device's place taken by another: the next of its own process's devices
  in the mesh's order, so that copying the state onto it moves no byte between hosts; where a
  process holds only one of the mesh's devices, the next device of the whole mesh."""
  flat = list(mesh.devices.flat)
  places: dict[int, list[int]] = {}
  for i, device in enumerate(flat):
    places.setdefault(device.process_index, []).append(i)
  if all(len(p) > 1 for p in places.values()):
    moved = list(flat)
    for own in places.values():
      for here, there in zip(own, own[1:] + own[:1]):
        moved[here] = flat[there]
  else:
    moved = flat[1:] + flat[:1]
  return Mesh(np.asarray(moved, dtype=object).reshape(mesh.devices.shape), mesh.axis_names,
              axis_types=mesh.axis_types)


def stays_on_each_host(mesh: Mesh, rotated: Mesh) -> bool:
  """Whether every device's place went to another device of its own process."""
  return all(a.process_index == b.process_index
             for a, b in zip(mesh.devices.flat, rotated.devices.flat))


def moved_within_hosts(tree: Any, shardings: Any, mesh: Mesh, rotated: Mesh) -> Any:
  """A copy of `tree` (laid out on `mesh`) laid out by `shardings` (the same specs on
  `rotated`): every block copied from its device to the one that took its place, by plain
  transfers between two devices of one process. A reshard by `jax.device_put` runs a
  collective program per array instead: a BERT-base benchmark copying that way on 4 simulated
  CPU devices of 2 cores aborted in a collective permute on the rotated devices (3 of 4
  arrived within XLA's 40 s)."""
  to_rotated = {a: b for a, b in zip(mesh.devices.flat, rotated.devices.flat)}
  leaves, structure = jax.tree.flatten(tree)
  targets = jax.tree.leaves(shardings)
  blocks = [list(leaf.addressable_shards) for leaf in leaves]
  moved = jax.device_put([[s.data for s in own] for own in blocks],
                         [[to_rotated[s.device] for s in own] for own in blocks])
  return jax.tree.unflatten(structure, [
      jax.make_array_from_single_device_arrays(leaf.shape, target, arrays)
      for leaf, target, arrays in zip(leaves, targets, moved)])


def block_numbers(example: Any) -> np.ndarray:
  """[arrays, mesh positions]: which block of each array each position's device holds
  (positions with the same number hold copies of the same block)."""
  leaves = jax.tree.leaves(example)
  devices = list(leaves[0].sharding.mesh.devices.flat)
  rows = []
  for leaf in leaves:
    index = leaf.sharding.devices_indices_map(leaf.shape)
    numbers: dict[tuple, int] = {}
    rows.append([numbers.setdefault(tuple((s.start, s.stop) for s in index[d]), len(numbers))
                 for d in devices])
  return np.asarray(rows, np.int64).reshape(len(leaves), len(devices))


def replica_differences(sums: np.ndarray, blocks: np.ndarray, names: list[str],
                        devices: list[int]) -> list[str]:
  """'NAME: device(s) [..] differ from [..]' for each array a copy of whose block differs from
  the others (the odd ones: those outside the most common fingerprint)."""
  problems = []
  for a, name in enumerate(names):
    for block in np.unique(blocks[a]):
      places = np.flatnonzero(blocks[a] == block)
      if len(places) < 2:
        continue
      values, counts = np.unique(sums[places, a], return_counts=True)
      if len(values) > 1:
        common = values[np.argmax(counts)]
        odd = sorted(devices[p] for p in places if sums[p, a] != common)
        rest = sorted(devices[p] for p in places if sums[p, a] == common)
        problems.append(f"{name}: device(s) {odd} differ from {rest}")
  return problems


def replay_differences(sums: np.ndarray, replayed: np.ndarray, names: list[str],
                       devices: list[int]) -> list[str]:
  """'NAME: device(s) [..]'s block(s) differ' for each array whose blocks the replay on the
  rotated mesh computed with other bits than the main step, the fewest first (a fault that
  stayed on one device before it spread through the step's collectives)."""
  differ = sums != replayed
  arrays = sorted(np.flatnonzero(differ.any(axis=0)), key=lambda a: differ[:, a].sum())
  return [f"{names[a]}: device(s) {sorted(devices[p] for p in np.flatnonzero(differ[:, a]))}'s "
          f"block(s) differ from the replay's" for a in arrays]


class IntegrityCheck:
  """The check at its cadence, called by the loop after each step (every process calls it at
  the same steps). `trainer` is the run's (its `mesh`, its step's `batch_shardings`);
  `make_trainer(mesh)` builds the same trainer on another mesh (the replay's); `record`
  appends an event to the run's record of decisions."""

  def __init__(self, resilience: ml_collections.ConfigDict, trainer: Any,
               make_trainer: Callable[[Mesh], Any], ledger: Ledger,
               record: Callable[[dict[str, Any]], None]) -> None:
    self.every = int(resilience.replica_check_every)
    self.replay_allowed = bool(resilience.get("integrity_replay", True))
    self.trainer = trainer
    self.mesh: Mesh = trainer.mesh
    # One device holds the only copy of everything and computes it alone: nothing to compare.
    self.enabled = bool(self.every) and self.mesh.devices.size > 1
    self._make_trainer = make_trainer
    self.ledger = ledger
    self._record = record
    self.replays: bool | None = None  # known from the first state the check sees
    self._fingerprints: Fingerprints | None = None
    self._replayed_fingerprints: Fingerprints | None = None
    self._rotated: Any = None  # the trainer on the rotated mesh
    self._compiled_for: Any = None  # the batch layout its step was compiled for
    self._held: tuple[int, Any] | None = None  # (step, the state it left, on the rotated mesh)

  def _layout(self, state: Any) -> None:
    """What the state's layout fixes, once: names, blocks, whether any block is unreplicated."""
    named = jax.tree_util.tree_flatten_with_path(state)[0]
    self.names = [jax.tree_util.keystr(path) for path, _ in named]
    self.blocks = block_numbers(state)
    self.devices = [d.id for d in self.mesh.devices.flat]
    unreplicated = [name for name, row in zip(self.names, self.blocks)
                    if np.bincount(row).min() == 1]
    self.replays = self.replay_allowed and bool(unreplicated)
    self._fingerprints = Fingerprints(state)
    if self.replays:
      self._rotated = self._make_trainer(rotated_mesh(self.mesh))
      self.rotated_devices = [d.id for d in self._rotated.mesh.devices.flat]
      self._within_hosts = stays_on_each_host(self.mesh, self._rotated.mesh)
    log.info("integrity check every %d steps: %d of %d arrays of the train state replicated%s",
             self.every, len(self.names) - len(unreplicated), len(self.names),
             "; the others by a replay of the step on the mesh with its devices rotated"
             if self.replays else "")

  def after_step(self, state: Any, step: int, phase: Any, local: dict[str, np.ndarray]
                 ) -> None:
    """After step `step` was dispatched on the batch `local` (this host's rows; `phase` places
    them: `phase.global_batch(trainer, local)`, `phase.accum_steps`). At a check step, checks;
    before one that replays, keeps the state this step left. Raises HardwareFault."""
    if not self.enabled:
      return
    held, self._held = self._held, None
    checks, before_check = step % self.every == 0, (step + 1) % self.every == 0
    if not (checks or (before_check and self.replays is not False)):
      return
    jax.block_until_ready(state)  # the step's own time stays its category's
    with self.ledger.timing(CATEGORY):
      if self.replays is None:
        self._layout(state)
      if checks:
        # A copy from before a rewind, or from another step, is no input of this one.
        self._check(state, step, held[1] if held and held[0] == step - 1 else None,
                    phase, local)
      if before_check and self.replays:
        # A copy, never an alias: the replay's step donates it.
        shardings = self._rotated.state_shardings
        copy = (moved_within_hosts(state, shardings, self.mesh, self._rotated.mesh)
                if self._within_hosts
                else jax.device_put(state, shardings, may_alias=False))
        self._held = (step, jax.block_until_ready(copy))

  def _replay(self, held: Any, phase: Any, local: dict[str, np.ndarray]) -> np.ndarray:
    """The fingerprints of the step replayed from `held` on the rotated mesh."""
    rotated = self._rotated
    layout = (tuple((k, v.shape, str(v.dtype)) for k, v in sorted(local.items())),
              phase.accum_steps)
    if layout != self._compiled_for:
      rotated.compile_step(local, phase.accum_steps)
      self._compiled_for = layout
    # Each device takes the rows of the place it took: this host's rows where the rotation
    # stays on each host, others (moved across hosts) where it does not.
    batch = (phase.global_batch(rotated, local) if self._within_hosts else jax.device_put(
        phase.global_batch(self.trainer, local), rotated.batch_shardings))
    replayed, _ = rotated.step(held, batch)
    if self._replayed_fingerprints is None:
      self._replayed_fingerprints = Fingerprints(replayed)
    return self._replayed_fingerprints(replayed)

  def _check(self, state: Any, step: int, held: Any, phase: Any,
             local: dict[str, np.ndarray]) -> None:
    sums = self._fingerprints(state)
    problems = replica_differences(sums, self.blocks, self.names, self.devices)
    if problems:
      self._fault(step, {"replicas": problems[:_SHOWN]}, problems,
                  f"after step {step} the copies of {len(problems)} replicated array(s) of the "
                  "train state differ", "on those devices")
    if held is None:
      return  # no replay (none needed, or no copy of the state before this step)
    problems = replay_differences(sums, self._replay(held, phase, local), self.names,
                                  self.devices)
    if problems:
      rotation = {str(a): b for a, b in zip(self.devices, self.rotated_devices)}
      self._fault(step, {"rotated_replay": problems[:_SHOWN], "rotation": rotation}, problems,
                  f"step {step} replayed from the state before it on the mesh with its devices "
                  f"rotated ({', '.join(f'{a}->{b}' for a, b in rotation.items())}) gave other "
                  f"bits in {len(problems)} array(s) of the train state",
                  "on one of the mesh's devices")

  def _fault(self, step: int, found: dict[str, Any], problems: list[str], what: str,
             where: str) -> None:
    self._record({"kind": "hardware_fault", "step": step, **found,
                  "differing_arrays": len(problems)})
    self.ledger.flush()
    raise HardwareFault(
        f"{what} ({problems[0]}{'; ...' if len(problems) > 1 else ''}): silent data "
        f"corruption {where}. Exiting with status {EXIT_HARDWARE} so the launcher restarts "
        "the run on other machines from its last checkpoint.")
