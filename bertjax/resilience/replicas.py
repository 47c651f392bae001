"""The replica check: every copy of a replicated parameter must hold the same bits, since every
replica applies the same update. Copies that differ are silent data corruption on the device
that holds the odd one out (no data or model problem can make them differ), so a mismatch is a
hardware fault at once. Periodic (`resilience.replica_check_every`); each device sums its own
copy's bits, and the sums (a few numbers per parameter) are compared on the host, across
processes with one all-gather.

The guide: docs/resilience.md, 'Step replay and silent data corruption'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


@jax.jit
def _bits_sum(x: jax.Array) -> jax.Array:
  """The sum of the array's bits read as unsigned integers (wrapping): one number per copy."""
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  if x.dtype.itemsize == 8:
    x = x.astype(jnp.float32)
  return jnp.sum(jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32), dtype=jnp.uint32)


def _index_key(index: tuple[slice, ...]) -> int:
  return hash(tuple((s.start, s.stop) for s in index)) & 0x7FFFFFFF


def mismatches(params: Any) -> list[str]:
  """'path: devices [..] differ from [..]' for each parameter whose copies disagree (every
  process must call it)."""
  named = jax.tree_util.tree_flatten_with_path(params)[0]
  rows = []  # (leaf, block index key, device id, bits sum) of this process's copies
  for number, (_, leaf) in enumerate(named):
    for shard in leaf.addressable_shards:
      rows.append((number, _index_key(shard.index), shard.device.id,
                   int(jax.device_get(_bits_sum(shard.data)))))
  table = np.asarray(rows, np.int64).reshape(-1, 4)
  if jax.process_count() > 1:
    table = np.asarray(multihost_utils.process_allgather(table)).reshape(-1, 4)
  problems = []
  for number, (path, _) in enumerate(named):
    mine = table[table[:, 0] == number]
    for key in np.unique(mine[:, 1]):
      copies = mine[mine[:, 1] == key]
      sums, counts = np.unique(copies[:, 3], return_counts=True)
      if len(sums) > 1:
        common = sums[np.argmax(counts)]
        odd = sorted(int(d) for d in copies[copies[:, 3] != common][:, 2])
        rest = sorted(int(d) for d in copies[copies[:, 3] == common][:, 2])
        problems.append(f"{jax.tree_util.keystr(path)}: device(s) {odd} differ from {rest}")
  return problems
