"""Per-host loading on real TPU slice layouts (libtpu's compile-only topology devices: the real
`process_index`, torus `coords` and `slice_index`), where the processes interleave along the
batch axis instead of coming in host order as simulated CPU devices do."""

import os

import numpy as np
import pytest

from bertjax.parallel import distributed, sharding
from bertjax.tools.topology import libtpu_available, parse_topology, topology_devices
from bertjax.training.trainer import batch_shardings

pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="needs libtpu (pip install 'jax[tpu]')")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# (accelerator type, slices): single slices whose hosts hold scattered batch rows, and two
# multi-slice jobs.
TOPOLOGIES = [("v4-16", 1), ("v4-128", 1), ("v5e-64", 1), ("v5p-128", 1), ("v6e-16", 1),
              ("v5e-16", 2), ("v4-16", 2)]
PRESETS = {"data_parallel": {"data": -1}, "fsdp": {"data": 1, "fsdp": -1}}
BATCH = 256


def _layout(topology: str, slices: int, mesh_axes: dict, preset: str):
  devices = topology_devices(parse_topology(topology, slices))
  mesh = sharding.make_mesh(mesh_axes, devices)
  rows = batch_shardings({"x": np.zeros(1)}, mesh, sharding.resolve_rules(preset))["x"]
  return devices, rows, distributed.row_layout(rows, BATCH)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("topology,slices", TOPOLOGIES, ids=[f"{t}x{s}" for t, s in TOPOLOGIES])
def test_every_host_loads_its_own_rows_disjoint_and_complete(topology, slices, preset):
  devices, rows_sharding, layout = _layout(topology, slices, PRESETS[preset], preset)
  processes = sorted({d.process_index for d in devices})
  assert layout.num_processes == len(processes) > 1
  assert layout.num_slices == slices
  held = [set(layout.rows_by_process[p]) for p in processes]
  for rows in held:
    assert len(rows) == BATCH // len(processes)
  assert sum(map(len, held)) == len(set().union(*held))  # disjoint
  assert set().union(*held) == set(range(BATCH))  # complete
  assert not layout.problems()
  assert "row sets disjoint and complete" in layout.summary()
  # What the training loop calls, as this test process (process 0 of the slice) would: before
  # row_layout it raised "batch shards are not contiguous rows" on every one of these slices.
  assert distributed.local_rows(rows_sharding, BATCH) == layout.rows_by_process[0]
  # On a v4-16 a host's rows are scattered, not one range (what the row layout must handle).
  if (topology, preset) == ("v4-16", "data_parallel") and slices == 1:
    assert layout.rows_by_process[0] != tuple(range(BATCH // 2))
  # What each device of each host receives from its host's rows (global_batch's selection):
  # exactly the global rows the sharding places on it.
  for device, index in rows_sharding.devices_indices_map((BATCH, 3)).items():
    rows = layout.rows_by_process[device.process_index]
    local = np.repeat(np.asarray(rows)[:, None], 3, axis=1)  # value = global row number
    block = distributed.device_block(local, rows, index, BATCH)
    start, stop = index[0].start or 0, index[0].stop or BATCH
    np.testing.assert_array_equal(block[:, 0], np.arange(start, stop))


def test_hosts_sharing_rows_form_disjoint_groups():
  """A tensor axis of 4 on v4-128 spans 2 hosts: those hosts load the same rows."""
  _, _, layout = _layout("v4-128", 1, {"data": 1, "fsdp": -1, "tensor": 4}, "fsdp_tensor")
  groups = layout.groups()
  assert len(groups) == 8 and all(len(g) == 2 for g in groups)
  assert not layout.problems()
  assert "8 groups of 2 hosts hold the same rows" in layout.summary()
  assert "groups disjoint and complete" in layout.summary()


def test_layout_problems_are_named():
  unequal = distributed.RowLayout(8, {0: (0, 1, 2), 1: (3, 4, 5, 6, 7)}, {0: 1, 1: 1})
  assert "different numbers of rows" in unequal.problems()[0]
  overlapping = distributed.RowLayout(4, {0: (0, 1), 1: (1, 2)}, {0: 1, 1: 1})
  assert any("overlapping" in p for p in overlapping.problems())
  missing = distributed.RowLayout(4, {0: (0,), 1: (1,)}, {0: 1, 1: 1})
  assert any("held by no process" in p for p in missing.problems())


def test_multi_slice_mesh_puts_slices_outermost_on_the_data_axis():
  devices = topology_devices(parse_topology("v5e-16", 2))
  mesh = sharding.make_mesh({"data": 1, "fsdp": -1}, devices, {"data": 2})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 16, "tensor": 1}
  for i in range(2):
    assert {d.slice_index for d in mesh.devices[i].reshape(-1)} == {i}
  with pytest.raises(ValueError, match="dcn_mesh .* needs 3 slices but 2 are available"):
    sharding.make_mesh({"data": -1}, devices, {"data": 3})
