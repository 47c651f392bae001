"""Runs the `bertjax` command with the mesh's devices in a real TPU slice's order.

Simulated CPU devices come in host order (process 0's devices, then process 1's, ...), so every
process's batch rows are one contiguous block. On a TPU slice the mesh follows the torus and
the processes interleave along the batch axis (v4-16: process indices 0, 1, 0, 1, ...; see
tests/test_topology_layouts.py). This wrapper gives `bertjax.parallel.sharding.make_mesh` the
devices interleaved the same way (device j of every process, then device j+1 of every process, ...)
and otherwise runs the real command line:

  python launch/local.py --processes 2 --devices 4 -- \\
      python tests/slice_order.py train --config configs/gpt_tiny.py --workdir runs/x

It prints the process index of every mesh position, so a test can see the interleaving.
"""

import os
import sys

import jax

from bertjax import cli

from bertjax.parallel import sharding

_make_mesh = sharding.make_mesh


def _interleaved(axis_sizes, devices=None, dcn_sizes=None):
  devices = list(jax.devices() if devices is None else devices)
  by_process: dict[int, list] = {}
  for device in devices:
    by_process.setdefault(device.process_index, []).append(device)
  columns = zip(*(by_process[p] for p in sorted(by_process)))
  ordered = [device for column in columns for device in column]
  mesh = _make_mesh(axis_sizes, ordered, dcn_sizes)
  if jax.process_index() == 0:
    # One write(2) for the whole line: with PYTHONUNBUFFERED, print() writes its arguments one
    # by one and gloo's C++ threads, writing to the same pipe, can land between them.
    line = f"slice_order: mesh process indices {[d.process_index for d in mesh.devices.flat]}\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())
  return mesh


if __name__ == "__main__":
  sharding.make_mesh = _interleaved
  sys.exit(cli.main(sys.argv[1:]))
