"""Multi-host setup and per-host batches.

`initialize` starts `jax.distributed` from the config's `distributed` group or the environment
(BERTJAX_COORDINATOR_ADDRESS, BERTJAX_NUM_PROCESSES, BERTJAX_PROCESS_ID — what launch/local.py
sets), or lets JAX detect the cluster on TPU VMs, GKE and SLURM. On CPU it selects gloo
collectives. `row_layout` says which global batch rows every process's devices hold (any device
order: on real TPU slices a process's rows interleave with its peers'); `local_rows` is this
process's share, and `global_batch` assembles one global array per field from those rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from bertjax.parallel import host

log = logging.getLogger(__name__)

_CLUSTER_ENV = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                "JOB_COMPLETION_INDEX")


def initialize(cfg: Mapping[str, Any]) -> None:
  """Starts jax.distributed when this is a multi-process run; a no-op otherwise."""
  address = cfg.get("coordinator_address") or os.environ.get("BERTJAX_COORDINATOR_ADDRESS")
  num = int(cfg.get("num_processes") or os.environ.get("BERTJAX_NUM_PROCESSES", 0))
  pid = cfg.get("process_id", -1)
  pid = int(os.environ.get("BERTJAX_PROCESS_ID", -1)) if pid is None or pid < 0 else int(pid)
  timeouts = dict(heartbeat_timeout_seconds=int(cfg.get("heartbeat_timeout_s", 100)),
                  initialization_timeout=int(cfg.get("initialization_timeout_s", 300)))
  if address:
    if num < 1 or pid < 0:
      raise ValueError("distributed: a coordinator address needs num_processes and process_id "
                       "(config distributed.* or BERTJAX_NUM_PROCESSES / BERTJAX_PROCESS_ID)")
    if host.cpu_platform_forced() or cfg.get("cpu_collectives"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num, pid, **timeouts)
  elif cfg.get("auto", True) and (any(k in os.environ for k in _CLUSTER_ENV) or _on_tpu_vm()):
    jax.distributed.initialize(**timeouts)  # TPU VM / GKE / SLURM cluster detection
  if jax.process_count() > 1:
    log.info("process %d of %d, %d local devices of %d", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())


def _on_tpu_vm() -> bool:
  """A Cloud TPU VM: its TPU chips are device files (v2-v4 /dev/accel*, v5e and later
  /dev/vfio/N). An ssh session there has none of the cluster variables above, and JAX finds the
  slice's workers through the VM metadata server once `jax.distributed.initialize()` is called."""
  return not host.cpu_platform_forced() and host.tpu_chips_present()


@dataclasses.dataclass(frozen=True)
class RowLayout:
  """Which global batch rows each process's devices hold, for every process of the mesh.

  On a real TPU slice the mesh follows the torus, so along the batch axes the processes
  interleave (v4-16: process indices 0, 1, 0, 1, ...) and a process's rows are not one
  contiguous range. Loading works from these row sets whatever their order."""

  batch_size: int
  rows_by_process: dict[int, tuple[int, ...]]
  devices_by_process: dict[int, int]
  num_slices: int = 1

  @property
  def num_processes(self) -> int:
    return len(self.rows_by_process)

  def groups(self) -> list[tuple[int, ...]]:
    """Processes that hold the same rows (a model axis spanning hosts), one tuple each."""
    by_rows: dict[tuple[int, ...], list[int]] = {}
    for process, rows in sorted(self.rows_by_process.items()):
      by_rows.setdefault(rows, []).append(process)
    return [tuple(v) for v in by_rows.values()]

  def problems(self) -> list[str]:
    """Why per-host loading could not work with this layout (empty: it can)."""
    out = []
    sizes = {len(r) for r in self.rows_by_process.values()}
    if len(sizes) > 1:
      out.append(f"processes hold different numbers of rows ({sorted(sizes)}): hosts would "
                 "load unequal shares")
    held = [set(self.rows_by_process[g[0]]) for g in self.groups()]
    if sum(map(len, held)) != len(set().union(*held)):
      out.append("two processes hold overlapping but different row sets")
    missing = set(range(self.batch_size)) - set().union(*held)
    if missing:
      out.append(f"{len(missing)} row(s) are held by no process, e.g. row {min(missing)}")
    return out

  def summary(self) -> str:
    """One line: hosts, the rows each loads, and whether the row sets partition the batch."""
    devices = "/".join(map(str, sorted(set(self.devices_by_process.values()))))
    rows = sorted({len(r) for r in self.rows_by_process.values()})
    slices = f" in {self.num_slices} slices" if self.num_slices > 1 else ""
    groups = self.groups()
    shared = ("" if len(groups) == self.num_processes else
              f"; {len(groups)} groups of {self.num_processes // len(groups)} hosts hold the "
              "same rows (a model axis spans hosts)")
    # A row's stream reads documents row, row+B, ...: a host reads its rows' share of them.
    share = f" ({rows[0] / self.batch_size:.3g} of the documents)" if len(rows) == 1 else ""
    verdict = "; ".join(self.problems()) or (
        "row sets disjoint and complete" if len(groups) == self.num_processes else
        "groups disjoint and complete")
    return (f"hosts: {self.num_processes} x {devices} devices{slices}; each loads "
            f"{'/'.join(map(str, rows))} of {self.batch_size} rows{share}{shared}; {verdict}")


def row_layout(sharding: NamedSharding, global_batch_size: int) -> RowLayout:
  """The rows of a batch sharded by `sharding` (on dimension 0) that every process holds."""
  rows: dict[int, set[int]] = {}
  devices: dict[int, int] = {}
  slices = set()
  for device, index in sharding.devices_indices_map((global_batch_size,)).items():
    block = index[0]
    rows.setdefault(device.process_index, set()).update(
        range(block.start or 0, global_batch_size if block.stop is None else block.stop))
    devices[device.process_index] = devices.get(device.process_index, 0) + 1
    slices.add(getattr(device, "slice_index", 0) or 0)
  return RowLayout(global_batch_size, {p: tuple(sorted(r)) for p, r in sorted(rows.items())},
                   devices, len(slices))


def local_rows(sharding: NamedSharding, global_batch_size: int) -> tuple[int, ...]:
  """The global batch rows whose shards live on this process, ascending (any device order;
  rows shared with other processes, when a model axis spans hosts, included)."""
  layout = row_layout(sharding, global_batch_size)
  problems = layout.problems()
  if problems:
    raise ValueError(f"batch of {global_batch_size} rows over mesh "
                     f"{dict(sharding.mesh.shape)}: {'; '.join(problems)}")
  return layout.rows_by_process[jax.process_index()]


def device_block(local: np.ndarray, rows: Sequence[int], index: tuple[slice, ...],
                 global_batch_size: int) -> np.ndarray:
  """The part of this process's `local` rows (`local[i]` is global row `rows[i]`, rows
  ascending) that a device holding the global block `index` gets."""
  start = index[0].start or 0
  stop = global_batch_size if index[0].stop is None else index[0].stop
  first = int(np.searchsorted(rows, start))
  if first + stop - start > len(rows) or rows[first] != start or rows[
      first + stop - start - 1] != stop - 1:
    raise ValueError(f"rows {start}..{stop - 1} of the batch are not among this process's rows")
  return local[first:first + stop - start][(slice(None),) + tuple(index[1:])]


def global_batch(local: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding],
                 rows: Sequence[int], global_batch_size: int) -> dict[str, jax.Array]:
  """One global jax.Array per field from this process's rows (`local[k][i]` is global row
  `rows[i]`, rows ascending); each device takes its block of rows, no cross-host copy."""
  rows = np.asarray(rows)
  return {key: jax.make_array_from_callback(
      (global_batch_size,) + value.shape[1:], shardings[key],
      lambda index, value=value: device_block(value, rows, index, global_batch_size))
          for key, value in local.items()}


def to_host(tree: Any) -> Any:
  """The global arrays of `tree` as host arrays, whole, on every process (an all-gather where
  they are spread over processes: every process must call it)."""
  if jax.process_count() > 1:
    tree = multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


def any_process(flag: bool) -> bool:
  """Whether `flag` is true on any process (every process must call it; one small
  all-gather)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


# The exit status of a process that stops because a peer process is gone (bertjax.cli has the
# table; a hang is bertjax.resilience.watchdog's EXIT_HUNG).
EXIT_PEER_LOST = 3


def abandon(error: BaseException) -> None:
  """Ends this process at once, with one line, after a collective failed because a peer died.

  A normal exit would first wait in jax.distributed's shutdown barrier for the dead peer (until
  its heartbeat times out) and then abort with a C++ stack dump; the run's state is in its
  last checkpoint either way."""
  reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
  reason = reason.split("Error dispatching computation: ")[-1][:300]
  print(f"bertjax: process {jax.process_index()} of {jax.process_count()}: a collective "
        f"failed ({reason}): a peer process has probably died. Exiting with status "
        f"{EXIT_PEER_LOST} so the job can be restarted from its last checkpoint.", flush=True)
  os._exit(EXIT_PEER_LOST)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (a no-op with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
