"""The integrity check (bertjax.resilience.replicas) on meshes of the simulated CPU devices: a
bit flipped in one FSDP shard (data 1 x fsdp 4 on 4 of the 8 devices: no copy of that shard
exists) is found by the step's replay on the rotated mesh and exits with status 5; a healthy
FSDP run passes every check and trains bit for bit as without them; on one device the check
builds nothing, runs nothing and records nothing. The runs are the tiny GPT of train_helpers."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import train_helpers

from bertjax import cli
from bertjax.checkpoints.params import load_params
from bertjax.parallel import sharding
from bertjax.resilience import replicas
from bertjax.training.trainer import Trainer

STEPS = 12
EVERY = 5  # checks after steps 5 and 10, each replaying its step from a copy of the one before
FSDP = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 1}


@pytest.fixture
def devices(monkeypatch):
  """Runs in this process use the first `n` devices (a data 1 x fsdp 4 mesh needs 4 of 8)."""
  original = sharding.mesh_from_config

  def use(n: int) -> None:
    monkeypatch.setattr(sharding, "mesh_from_config",
                        lambda config, given=None: original(config, jax.devices()[:n]))
  return use


def _train(workdir: Path, **changes) -> int:
  args = ["train", "--config", "gpt_tiny", "--workdir", str(workdir),
          "--config.data.source=synthetic_markov", *train_helpers.tiny_args(**{
              "model.vocab_size": 128, "model.hidden_dropout": 0.0,
              "model.attention_dropout": 0.0, "num_train_steps": STEPS, "log_every": 1,
              "checkpoint.every": 10, "resilience.replica_check_every": EVERY, **changes})]
  return cli.main(args)


def _events(workdir: Path) -> list[dict]:
  path = workdir / "resilience.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _ledger(workdir: Path) -> dict[str, float]:
  return json.loads((workdir / "goodput" / "attempt-0001.json").read_text())["seconds"]


def test_a_bit_flip_in_one_fsdp_shard_is_a_hardware_fault(tmp_path, capsys, caplog, devices):
  devices(4)
  code = _train(tmp_path, **FSDP, **{"faults.flip_bit": str(2 * EVERY)})
  err = capsys.readouterr().err
  assert code == 5, err[-3000:]
  assert "replayed from the state before it on the mesh with its devices rotated" in err
  assert "Exiting with status 5 so the launcher restarts the run" in err
  fault = _events(tmp_path)[-1]
  assert fault["kind"] == "hardware_fault" and fault["step"] == 2 * EVERY
  # The flipped parameter (the largest) is one whose blocks each live on one device only.
  flipped = [r.getMessage() for r in caplog.records if "fault lab: flipped" in r.getMessage()]
  name = flipped[0].split("flipped a bit of ")[1].split(" on device")[0]
  print(flipped[0], fault, sep="\n")
  assert any(p.startswith(f".params{name}:") for p in fault["rotated_replay"]), fault
  trainer = Trainer(train_helpers.tiny_config("gpt", **FSDP), train_helpers.mesh_for((1, 4, 1)))
  named = jax.tree_util.tree_flatten_with_path(trainer.abstract_state())[0]
  which = [jax.tree_util.keystr(path) for path, _ in named].index(f".params{name}")
  assert sorted(replicas.block_numbers(trainer.abstract_state())[which]) == [0, 1, 2, 3]
  assert _ledger(tmp_path)["integrity_check"] > 0


def test_a_healthy_fsdp_run_passes_and_trains_as_without_the_check(tmp_path, capsys, devices):
  devices(4)
  assert _train(tmp_path / "checked", **FSDP) == 0, capsys.readouterr().err[-3000:]
  assert _train(tmp_path / "unchecked", **FSDP,
                **{"resilience.replica_check_every": 0}) == 0
  assert not [e for e in _events(tmp_path / "checked") if e["kind"] == "hardware_fault"]
  checked, unchecked = _ledger(tmp_path / "checked"), _ledger(tmp_path / "unchecked")
  assert checked["integrity_check"] > 0 and unchecked["integrity_check"] == 0
  assert checked["replayed"] == 0  # the step replay's category is the guard's alone
  # The check's copy and replay leave the run's own state as it was, bit for bit.
  ours = jax.tree.leaves(load_params(tmp_path / "checked" / "params")[0])
  theirs = jax.tree.leaves(load_params(tmp_path / "unchecked" / "params")[0])
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_on_one_device_the_check_builds_runs_and_records_nothing(tmp_path, capsys, devices,
                                                                 monkeypatch):
  devices(1)

  def built(*args, **kwargs):
    raise AssertionError("the integrity check built a program on one device")
  monkeypatch.setattr(replicas, "Fingerprints", built)
  monkeypatch.setattr(replicas, "rotated_mesh", built)
  assert _train(tmp_path, **{"mesh.data": 1, "resilience.replica_check_every": 1}) == 0, (
      capsys.readouterr().err[-3000:])
  seconds = _ledger(tmp_path)
  assert seconds["integrity_check"] == 0 and seconds["replayed"] == 0
  assert _events(tmp_path) == []


def test_any_one_flipped_bit_changes_the_fingerprint():
  words = np.random.default_rng(0).integers(0, 2**32, size=(64, 33), dtype=np.uint32)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
    x = jax.lax.bitcast_convert_type(jnp.asarray(words), jnp.float32).astype(dtype)
    bits = np.asarray(jax.lax.bitcast_convert_type(
        x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]))
    clean = int(replicas._word_sum(x))
    for bit in range(8 * x.dtype.itemsize):
      flipped = bits.copy()
      flipped.reshape(-1)[777] ^= flipped.dtype.type(1 << bit)
      y = jax.lax.bitcast_convert_type(jnp.asarray(flipped), dtype)
      assert int(replicas._word_sum(y)) != clean, (dtype, bit)


@pytest.mark.parametrize("axes", [(1, 4, 1), (2, 2, 1)])
def test_the_state_moves_onto_the_rotated_mesh_device_by_device(axes):
  mesh = train_helpers.mesh_for(axes)
  moved_mesh = replicas.rotated_mesh(mesh)
  before, after = list(mesh.devices.flat), list(moved_mesh.devices.flat)
  assert sorted(d.id for d in after) == sorted(d.id for d in before)
  assert all(a != b and a.process_index == b.process_index for a, b in zip(before, after))
  assert moved_mesh.shape == mesh.shape and replicas.stays_on_each_host(mesh, moved_mesh)
  config = train_helpers.tiny_config("gpt")
  state = Trainer(config, mesh).init_state(0)
  shardings = Trainer(config, moved_mesh).state_shardings
  copy = replicas.moved_within_hosts(state, shardings, mesh, moved_mesh)
  place = dict(zip(before, after))
  for leaf, moved, target in zip(jax.tree.leaves(state), jax.tree.leaves(copy),
                                 jax.tree.leaves(shardings)):
    assert moved.sharding == target
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(leaf))
    # Each block sits where its device's place went, in a buffer of its own.
    for shard in leaf.addressable_shards:
      theirs = [s for s in moved.addressable_shards if s.device == place[shard.device]][0]
      assert theirs.index == shard.index
      np.testing.assert_array_equal(np.asarray(theirs.data), np.asarray(shard.data))


@pytest.mark.fast  # the fast tier's test of bertjax.tools.integrity_bench
def test_bench_compare_integrity_times_the_check_and_writes_a_record(tmp_path, capsys, devices):
  """`bertjax bench --compare integrity` at toy size on data 1 x fsdp 4: its plumbing (the
  ratios are the results page's)."""
  devices(4)
  out = tmp_path / "integrity.json"
  assert cli.main(["bench", "--config", "gpt_tiny", "--compare", "integrity", "--steps", "1",
                   "--pairs", "2", "--json", str(out), "--config.mesh.data=1",
                   "--config.mesh.fsdp=4", "--config.resilience.replica_check_every=2",
                   *train_helpers.tiny_args(**{"model.vocab_size": 128})]) == 0
  assert "over 2 steps, per round" in capsys.readouterr().out
  record = json.loads(out.read_text())
  assert record["replays"] and record["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert len(record["ratios"]) == 2 and record["seconds"]["check"] > 0
