"""Batch-size ramps (bertjax.config.ramp): the stage table against Megatron-LM's rule, the rows
of a stage's batch, the learning rate read at the samples consumed, one compile per stage in
a real run, and the errors of a ramp that cannot run. Kills and resumes inside a ramp:
tests/test_checkpoints.py (gpt-batch-ramp) and, on another process count,
tests/test_multihost.py (gpt_packing)."""

from __future__ import annotations

import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_helpers
from bertjax import config as config_lib
from bertjax.config import ramp
from bertjax.parallel import distributed
from bertjax.training import loop, optim
from bertjax.training.trainer import Trainer, _split_micro_batches


def _megatron_batch(consumed: int, start: int, increment: int, samples: int, full: int) -> int:
  """Megatron-LM's RampupBatchsizeNumMicroBatches: the batch after `consumed` samples."""
  increments = (full - start) // increment
  per_increment = samples / increments
  return min(start + int(consumed / per_increment) * increment, full)


@pytest.mark.parametrize("start,increment,samples,full", [
    (16, 16, 480, 64), (32, 32, 1000, 256), (8, 24, 100, 56), (768, 768, 48_828_125, 4608)])
def test_stages_follow_megatrons_rampup_rule(start, increment, samples, full):
  table = ramp.build(start, increment, samples, full)
  assert table.unit == math.gcd(start, increment, full)
  assert [s.batch_size for s in table.stages] == list(range(start, full + 1, increment))
  consumed = 0
  for step in range(table.stages[-1].first_step + 3):  # ModernBERT's: ~29K steps, 0.2 s
    assert table.samples_before(step) == consumed
    want = _megatron_batch(consumed, start, increment, samples, full)
    assert table.batch_size(step) == want, (step, consumed)
    consumed += want
  # Every stage's batch is a whole number of unit batches.
  assert all(s.batch_size % table.unit == 0 for s in table.stages)


def test_steps_for_samples_is_the_first_step_that_consumes_them():
  table = ramp.build(16, 16, 480, 64)
  for samples in range(1, 1500, 7):
    steps = ramp.steps_for_samples(table, samples, 64)
    assert table.samples_before(steps) >= samples > table.samples_before(steps - 1)
  assert ramp.steps_for_samples(None, 1000, 64) == 16


def test_the_table_names_each_stage():
  lines = ramp.build(16, 16, 480, 64).table(seq_length=128)
  assert lines == ["steps 1..10: batch 16 (1 x 16) from 0 tokens",
                   "steps 11..15: batch 32 (2 x 16) from 20,480 tokens",
                   "steps 16..19: batch 48 (3 x 16) from 40,960 tokens",
                   "steps 20..end: batch 64 (4 x 16) from 65,536 tokens"]


def test_a_stage_batch_keeps_every_device_its_rows_and_splits_into_the_unit_batches(devices):
  """A batch of m units on an 8-way data mesh: each device's block holds exactly its blocks of
  the m unit batches, and the m-way micro-batch split gives back the unit batches."""
  mesh = train_helpers.mesh_for((8, 1, 1))
  trainer = Trainer(train_helpers.tiny_config("gpt"), mesh)
  sharding = trainer.data_sharding()
  unit, m = 8, 3
  parts = [{"ids": np.arange(unit * 4).reshape(unit, 4) + 1000 * j} for j in range(m)]
  big = ramp.interleave(parts)["ids"]
  assert distributed.local_rows(sharding, unit * m) == tuple(range(unit * m))  # one process
  unit_blocks = sharding.devices_indices_map((unit,))
  for device, index in sharding.devices_indices_map((unit * m,)).items():
    block = big[index[0]]
    want = np.concatenate([part["ids"][unit_blocks[device][0]] for part in parts])
    np.testing.assert_array_equal(np.sort(block, axis=None), np.sort(want, axis=None))
  split = np.asarray(_split_micro_batches(jnp.asarray(big), m))
  for j in range(m):
    np.testing.assert_array_equal(split[j], parts[j]["ids"])


def test_the_learning_rate_is_read_at_the_samples_consumed():
  """Warmup over 4 full batches with a ramp from a quarter batch: 16 steps of warmup, and each
  step's rate is the schedule's at samples consumed / full batch."""
  config = train_helpers.tiny_config("gpt")
  table = ramp.build(4, 4, 48, 16)
  _, with_ramp = optim.build_optimizer(config.optimizer, 40, batch_ramp=table)
  full_steps = math.ceil(table.samples_before(40) / 16)
  _, plain = optim.build_optimizer(config.optimizer, full_steps)
  for step in range(40):
    want = float(plain(table.samples_before(step) / 16))
    assert float(with_ramp(step)) == pytest.approx(want, rel=1e-6, abs=1e-12), step
  # The ramp's first steps are a quarter batch: a quarter of a full step's warmup each.
  assert float(with_ramp(1)) == pytest.approx(float(plain(0.25)), rel=1e-6)


@pytest.mark.slow
def test_a_ramp_run_compiles_once_per_stage_and_logs_each_steps_batch(tmp_path, monkeypatch,
                                                                      devices):
  """A GPT run on 8 devices with 4 ramp stages: the train step compiles 4 times in 12 steps;
  every train record's batch and samples are the table's; the log prints the table."""
  config = train_helpers.tiny_config("gpt", num_train_steps=12, batch_size=32,
                                     grad_accum_steps=2)
  config.batch_ramp.update(start_batch_size=8, increment=8, samples=48)
  table = ramp.from_config(config)
  assert [s.batch_size for s in table.stages] == [8, 16, 24, 32]
  compiles = []
  original = Trainer.compile_step

  def counting(self, batch, accum_steps=None):
    compiles.append((jax.tree.leaves(batch)[0].shape[0], accum_steps))
    return original(self, batch, accum_steps)

  monkeypatch.setattr(Trainer, "compile_step", counting)
  report = io.StringIO()
  loop.train_and_evaluate(config, tmp_path, report=report)
  # Micro-batches of at most 16 rows (the full batch's), each divisible over 8 devices.
  assert compiles == [(8, 1), (16, 1), (24, 3), (32, 2)]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r["split"] == "train"]
  assert [r["step"] for r in train] == list(range(1, 13))
  for r in train:
    assert r["batch_size"] == table.batch_size(r["step"] - 1)
    assert r["samples"] == table.samples_before(r["step"])
  assert train[-1]["samples"] == 8 + 8 + 16 + 24 + 32 * 8


def test_a_ramp_that_cannot_run_is_a_clear_error():
  def load(*overrides):
    return config_lib.load_config("gpt_tiny", [tuple(o.split("=")) for o in overrides])

  with pytest.raises(ValueError, match=r"batch_ramp.increment=5 must be positive and divide"):
    load("batch_size=32", "batch_ramp.start_batch_size=8", "batch_ramp.increment=5",
         "batch_ramp.samples=100")
  with pytest.raises(ValueError, match=r"batch_ramp.start_batch_size=64 must be in 1..batch_size-1=31"):
    load("batch_size=32", "batch_ramp.start_batch_size=64", "batch_ramp.increment=8",
         "batch_ramp.samples=100")
  with pytest.raises(ValueError, match=r"batch_ramp and phase2 cannot be combined"):
    load("batch_size=32", "batch_ramp.start_batch_size=8", "batch_ramp.increment=8",
         "batch_ramp.samples=100", "phase2.start_step=5", "num_train_steps=10")
  with pytest.raises(ValueError, match=r"cannot be split over the mesh's 8 data-parallel"):
    ramp.accum_steps(12, 16, ways=8)
  assert load("batch_ramp.start_batch_size=0").batch_ramp.start_batch_size == 0


def test_the_paper_ramps_fit_their_slices():
  """GPT-3 and ModernBERT-base ramp (their docstrings say how); every stage of each splits
  into micro-batches no larger than the full batch's over the data-parallel devices of the
  slice its compile report (docs/compile_reports) planned it on."""
  from pathlib import Path
  reports = Path(__file__).resolve().parents[1] / "docs" / "compile_reports"
  checked = set()
  for path in sorted(reports.glob("*.json")):
    report = json.loads(path.read_text())
    config = config_lib.load_config(report["config"])
    table = ramp.from_config(config)
    if table is None or report["overrides"]:
      continue
    mesh = report["report"]["mesh"]
    ways = mesh["data"] * mesh["fsdp"]
    micro = config.batch_size // config.grad_accum_steps
    for stage in table.stages:
      accum = ramp.accum_steps(stage.batch_size, micro, ways)
      assert stage.batch_size // accum <= micro and (stage.batch_size // accum) % ways == 0
    assert table.stages[-1].batch_size == config.batch_size
    checked.add(report["config"])
  assert checked == {f"gpt3:size={s}" for s in ("125m", "350m", "760m", "1p3b", "2p7b",
                                                "6p7b", "13b")} | {"modernbert:size=base"}
  # GPT-3 125M starts at the paper's 32K tokens (16 sequences of 2,048).
  assert config_lib.load_config("gpt3:size=125m").batch_ramp.start_batch_size * 2048 == 32_768


def test_sequence_length_warmup_follows_the_same_rule_on_the_length():
  config = train_helpers.tiny_config("gpt", seq_length=32)
  config.seq_warmup.update(start_length=8, increment=8, samples=48)
  warmup = ramp.seq_warmup_from_config(config)
  assert warmup.lengths() == [8, 16, 24, 32]
  for consumed in range(0, 100):
    assert warmup.length_at(consumed) == _megatron_batch(consumed, 8, 8, 48, 32)
  batch = {"input_ids": np.arange(64).reshape(2, 32), "positions": np.arange(64).reshape(2, 32)}
  cut = ramp.cut_rows(batch, 8)
  np.testing.assert_array_equal(cut["input_ids"], batch["input_ids"][:, :8])
  assert cut["positions"].shape == (2, 8)
  with pytest.raises(ValueError, match=r"seq_warmup cuts causal-LM rows; objective 'mlm_nsp'"):
    bert = train_helpers.tiny_config("bert")
    bert.seq_warmup.update(start_length=8, increment=8, samples=48)
    ramp.seq_warmup_from_config(bert)
  config.seq_warmup.increment = 5
  with pytest.raises(ValueError, match=r"seq_warmup.increment=5 must be positive and divide"):
    ramp.seq_warmup_from_config(config)


@pytest.mark.slow
def test_a_sequence_length_warmup_compiles_once_per_length(tmp_path, monkeypatch, devices):
  """Rows of 8, 16, 24, then 32 tokens, one length per 16 sequences (one step of batch 16):
  4 compiles in 6 steps, each record's length the rule's, evaluation on full rows."""
  config = train_helpers.tiny_config("gpt", num_train_steps=6, seq_length=32, eval_every=3,
                                     eval_steps=1)
  config.seq_warmup.update(start_length=8, increment=8, samples=48)
  lengths = []
  original = Trainer.compile_step

  def counting(self, batch, accum_steps=None):
    lengths.append(batch["input_ids"].shape[1])
    return original(self, batch, accum_steps)

  monkeypatch.setattr(Trainer, "compile_step", counting)
  loop.train_and_evaluate(config, tmp_path, report=io.StringIO())
  assert lengths == [8, 16, 24, 32]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r["split"] == "train"]
  assert [r["seq_length"] for r in train] == [8, 16, 24, 32, 32, 32]
  assert [r["samples"] for r in train] == [16 * s for s in range(1, 7)]
  assert [r["step"] for r in records if r["split"] == "eval"] == [3, 6]
