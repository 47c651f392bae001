"""Multi-host setup and per-host batches.

`initialize` starts `jax.distributed` from the config's `distributed` group or the environment
(BERTJAX_COORDINATOR_ADDRESS, BERTJAX_NUM_PROCESSES, BERTJAX_PROCESS_ID — what launch/local.py
sets), or lets JAX detect the cluster on TPU VMs, GKE and SLURM. On CPU it selects gloo
collectives. `global_batch` assembles one global array per field from the rows this process
holds; `local_rows` says which rows those are.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

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
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu") or cfg.get("cpu_collectives"):
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
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
    return False
  return Path("/dev/accel0").exists() or any(Path("/dev/vfio").glob("[0-9]*"))


def local_rows(sharding: NamedSharding, global_batch_size: int) -> range:
  """The contiguous range of global batch rows whose shards live on this process."""
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  starts, stops = [], []
  for index in index_map.values():
    rows = index[0]
    starts.append(rows.start or 0)
    stops.append(global_batch_size if rows.stop is None else rows.stop)
  start, stop = min(starts), max(stops)
  covered = set()
  for a, b in zip(starts, stops):
    covered.update(range(a, b))
  if covered != set(range(start, stop)):
    raise ValueError("this process's batch shards are not contiguous rows; order the mesh so "
                     "each process's devices are adjacent along the batch axes")
  return range(start, stop)


def global_batch(local: Mapping[str, np.ndarray], shardings: Mapping[str, NamedSharding],
                 global_batch_size: int) -> dict[str, jax.Array]:
  """One global jax.Array per field from this process's rows (no cross-host copy)."""
  out = {}
  for key, value in local.items():
    shape = (global_batch_size,) + value.shape[1:]
    out[key] = jax.make_array_from_process_local_data(shardings[key], value, shape)
  return out


class StepWatchdog:
  """Exits the process, with a message, when no step completes for `timeout_s` seconds.

  A peer that dies mid-collective can leave the others blocked forever; the coordination
  service usually notices within its heartbeat timeout, and this is the backstop.
  """

  def __init__(self, timeout_s: float) -> None:
    self.timeout_s = timeout_s
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread = None
    if timeout_s > 0 and jax.process_count() > 1:
      self._thread = threading.Thread(target=self._watch, daemon=True)
      self._thread.start()

  def tick(self) -> None:
    self._last = time.monotonic()

  def stop(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(5.0, self.timeout_s / 4)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        print(f"bertjax: process {jax.process_index()} of {jax.process_count()}: no training "
              f"step completed in {idle:.0f} s; a peer process has probably died or hung. "
              "Exiting so the job can be restarted from its last checkpoint.", flush=True)
        os._exit(3)


def barrier(name: str) -> None:
  """Waits until every process reaches the barrier `name` (a no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
