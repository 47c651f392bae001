"""Runs that recover by themselves (bertjax.resilience), on one process with 8 CPU devices: the
spike guard's rule and its bit-identity when nothing is wrong; a poisoned batch skipped in the
step; a poisoned window and a NaN batch rewound and skipped, the same decisions on a replay of
the run; a flipped bit classified as a hardware fault (exit status 5) by the replica check and
by the step replay, a NaN batch as reproducible; the rewind limit; a kill right after a rewind
resumes onto the same batches. The fault-lab runs are the tiny GPT of train_helpers for 40
steps, checkpoints every 10."""

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
from bertjax.resilience import guard as spike_guard
from bertjax.resilience.policy import EVENTS, GaveUp, Policy
from bertjax.training import loop

STEPS = 40
# The faults below hit data position 24 (step 25): after the step-20 checkpoint, before 30.
FAULTY = 24


def _config(family: str = "gpt", **overrides):
  return train_helpers.tiny_config(family, **{
      "num_train_steps": STEPS, "checkpoint.every": 10, "resilience.spike_min_history": 8,
      "resilience.replica_check_every": 0, **overrides})


def _events(workdir: Path) -> list[dict]:
  path = workdir / "resilience.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _final_params(workdir: Path) -> list[np.ndarray]:
  params, _ = load_params(workdir / "params")
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def _tail_loss(workdir: Path, steps: int = 5) -> float:
  losses = train_helpers.step_losses(workdir)
  return float(np.mean([losses[s] for s in sorted(losses)[-steps:]]))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
  workdir = tmp_path_factory.mktemp("clean")
  loop.train_and_evaluate(_config(), workdir)
  return workdir


# --- the rule ------------------------------------------------------------------------------

SETTINGS = spike_guard.GuardSettings(sigmas=6.0, history=16, min_history=4, alarm_skips=3,
                                     alarm_window=10)


def _judge_all(losses, grad_norms=None):
  guard = spike_guard.init(SETTINGS)
  skips = []
  for i, loss in enumerate(losses):
    norm = 1.0 if grad_norms is None else grad_norms[i]
    guard, skip = spike_guard.judge(guard, jnp.int32(i + 1), jnp.float32(loss),
                                    jnp.float32(norm), SETTINGS)
    skips.append(bool(skip))
  return guard, skips


def test_the_guard_skips_outliers_and_non_finite_steps_only():
  noise = [2.0 + 0.01 * np.sin(i) for i in range(12)]
  guard, skips = _judge_all(noise + [2.5] + noise[:3])
  assert skips == [False] * 12 + [True] + [False] * 3
  assert int(guard.skipped) == 1 and int(guard.alarm) == 0
  assert int(guard.accepted) == 15  # the outlier never enters the statistics
  # Before min_history nothing finite is judged; a non-finite value always is, and alarms.
  guard, skips = _judge_all([2.0, 50.0, float("nan"), 2.0])
  assert skips == [False, False, True, False] and int(guard.alarm) == 3
  # A gradient-norm spike alone is an outlier too.
  _, skips = _judge_all([2.0] * 8, [1.0 + 0.01 * i for i in range(7)] + [9.0])
  assert skips[-1] and not any(skips[:-1])
  # ... but not the one right after it: the same cliff under the kept parameters, which only
  # an update gets past; it stays out of the statistics. A loss spike is skipped every time.
  norms = [1.0 + 0.01 * i for i in range(8)]
  guard, skips = _judge_all([2.0] * 12, norms + [9.0, 9.0, 9.0, 1.0])
  assert skips == [False] * 8 + [True, False, True, False]
  assert int(guard.accepted) == 9 and int(guard.skipped) == 2
  _, skips = _judge_all(noise[:8] + [9.0, 9.0, 9.0], norms + [9.0, 9.0, 9.0])
  assert skips == [False] * 8 + [True] * 3


def test_three_skips_within_the_window_raise_the_alarm_from_the_first():
  base = [2.0 + 0.01 * np.sin(i) for i in range(8)]
  guard, _ = _judge_all(base + [9.0, 2.0, 9.0, 2.0, 9.0])
  assert int(guard.alarm) == 9  # steps 9, 11, 13 skipped: the trouble began at 9
  guard, _ = _judge_all(base + [9.0] + [2.0] * 10 + [9.0, 9.0])
  assert int(guard.alarm) == 0  # the first skip fell out of the 10-step window
  assert int(guard.skipped) == 3


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_the_guard_changes_nothing_bitwise_when_no_step_is_an_outlier(tmp_path, family):
  runs = {}
  for sigmas in (6.0, 0.0):
    workdir = tmp_path / f"sigmas{sigmas}"
    result = loop.train_and_evaluate(
        _config(family, num_train_steps=12, **{"resilience.spike_sigmas": sigmas,
                                               "resilience.spike_min_history": 2}), workdir)
    runs[sigmas] = (_final_params(workdir), train_helpers.step_losses(workdir), result)
  assert runs[6.0][2]["skipped_updates"] == 0.0 and "skipped_updates" not in runs[0.0][2]
  assert runs[6.0][1] == runs[0.0][1]
  for a, b in zip(runs[6.0][0], runs[0.0][0]):
    np.testing.assert_array_equal(a, b)


# --- spikes and NaNs: skip, rewind, replay --------------------------------------------------

def _loss_tolerance(clean: Path) -> float:
  """Within the noise of a clean run: 3 standard deviations of its last 10 per-step losses
  around their mean, over 5 steps' mean (sqrt 5). A run that skipped a few of 40 batches and
  rewound 5-10 steps trains on other batches near the end, so its last losses differ by
  batch-to-batch noise, not more."""
  losses = train_helpers.step_losses(clean)
  tail = [losses[s] for s in sorted(losses)[-10:]]
  return 3 * float(np.std(tail)) / np.sqrt(5) + 0.02


def test_a_poisoned_batch_is_skipped_in_the_step(tmp_path, clean):
  loop.train_and_evaluate(_config(**{"faults.poison": str(FAULTY)}), tmp_path)
  events = _events(tmp_path)
  assert [e["kind"] for e in events] == ["skipped"]
  assert events[0]["last_step"] == FAULTY + 1 and events[0]["loss"] > 40  # x50
  print(f"poison once: last-5 mean loss {_tail_loss(tmp_path):.4f}, clean "
        f"{_tail_loss(clean):.4f}, tolerance {_loss_tolerance(clean):.4f}")
  assert abs(_tail_loss(tmp_path) - _tail_loss(clean)) < _loss_tolerance(clean)
  ledger = json.loads((tmp_path / "goodput" / "attempt-0001.json").read_text())
  assert ledger["seconds"]["skipped"] > 0 and ledger["seconds"]["rewound"] == 0


@pytest.mark.parametrize("fault, first", [("poison", FAULTY + 1), ("nan", FAULTY + 1)])
def test_persistent_trouble_rewinds_skips_and_replays_the_same(tmp_path, clean, fault, first):
  positions = f"{FAULTY},{FAULTY + 1},{FAULTY + 2}" if fault == "poison" else str(FAULTY)
  runs = []
  for name in ("run", "replay"):
    workdir = tmp_path / name
    loop.train_and_evaluate(_config(**{f"faults.{fault}": positions}), workdir)
    runs.append(workdir)
  events = _events(runs[0])
  rewind = [e for e in events if e["kind"] == "rewind"]
  assert len(rewind) == 1, events
  assert rewind[0]["trouble_from"] == first and rewind[0]["rewound_to"] == 20
  assert rewind[0]["replay"] == "reproduced"
  # The batches drawn between the checkpoint and the alarm are skipped: the faulty ones too.
  assert rewind[0]["data_from"] == 20 and rewind[0]["data_to"] > FAULTY + (
      3 if fault == "poison" else 1)
  # The same run again decides the same, bit for bit, and ends with the same parameters.
  assert _events(runs[1]) == events
  for a, b in zip(_final_params(runs[0]), _final_params(runs[1])):
    np.testing.assert_array_equal(a, b)
  print(f"{fault}: last-5 mean loss {_tail_loss(runs[0]):.4f}, clean {_tail_loss(clean):.4f}, "
        f"tolerance {_loss_tolerance(clean):.4f}; rewind {rewind[0]}")
  assert abs(_tail_loss(runs[0]) - _tail_loss(clean)) < _loss_tolerance(clean)
  ledger = json.loads((runs[0] / "goodput" / "attempt-0001.json").read_text())
  assert ledger["seconds"]["replayed"] > 0 and ledger["seconds"]["rewound"] > 0


@pytest.mark.parametrize("case", [
    # (faults, replica check every, expected): bit flips are hardware faults whichever
    # check finds them; a NaN batch is the data's.
    ({"faults.flip_bit": "24"}, 5, "replicas"),
    ({"faults.flip_bit": "13"}, 5, "replicas"),
    ({"faults.flip_bit": "24", "faults.flip_param": "scale"}, 0, "replay"),
    ({"faults.flip_bit": "33", "faults.flip_param": "scale"}, 0, "replay"),
    ({"faults.nan": "24"}, 0, "reproduced"),
    ({"faults.nan": "12"}, 5, "reproduced"),
], ids=["flip-kernel-24", "flip-kernel-13", "flip-scale-24", "flip-scale-33", "nan-24",
        "nan-12"])
def test_a_bit_flip_is_a_hardware_fault_and_a_nan_batch_is_not(tmp_path, capsys, case):
  faults, every, expected = case
  args = ["train", "--config", "gpt_tiny", "--workdir", str(tmp_path),
          "--config.data.source=synthetic_markov", *train_helpers.tiny_args(**{
              "model.vocab_size": 128, "model.hidden_dropout": 0.0,
              "model.attention_dropout": 0.0, "num_train_steps": STEPS, "log_every": 1,
              "checkpoint.every": 10, "resilience.spike_min_history": 8,
              "resilience.replica_check_every": every, **faults})]
  code = cli.main(args)
  events = _events(tmp_path)
  if expected == "reproduced":
    assert code == 0
    assert [e["replay"] for e in events if e["kind"] == "rewind"] == ["reproduced"]
    return
  assert code == 5, capsys.readouterr().err[-2000:]
  err = capsys.readouterr().err
  assert "Exiting with status 5 so the launcher restarts the run" in err
  fault = events[-1]
  assert fault["kind"] == "hardware_fault"
  if expected == "replicas":
    assert "device(s) [7] differ from [0, 1, 2, 3, 4, 5, 6]" in fault["replicas"][0]
  else:
    assert fault["seen"]["loss"] != fault["replayed"]["loss"]
    assert np.isfinite(fault["replayed"]["loss"])


def test_trouble_that_keeps_coming_back_stops_with_one_line(tmp_path):
  # Every batch from position 24 on is NaN: each rewind meets NaN again.
  nans = ",".join(str(p) for p in range(FAULTY, 200))
  with pytest.raises(GaveUp, match=r"came back after 2 rewind\(s\) "
                                   r"\(resilience.max_rewinds=2\); stopping"):
    loop.train_and_evaluate(_config(**{"faults.nan": nans, "resilience.max_rewinds": 2,
                                       "resilience.replay": False}), tmp_path)
  kinds = [e["kind"] for e in _events(tmp_path)]
  assert kinds.count("rewind") == 2 and kinds[-1] == "gave_up"


def test_rewinds_to_the_same_checkpoint_replay_onto_every_skip_so_far(tmp_path):
  """Trouble that comes back: each rewind to checkpoint 20 skips more batches, and the
  checkpoint still holds the position it was saved with, so a replay or resume from it must
  skip every range so far. Found by a DistilBERT golden run, whose third replay skipped only
  the last range, replayed other batches and called it a hardware fault."""
  def rewind(to, data_from, data_to):
    return {"kind": "rewind", "rewound_to": to, "data_from": data_from, "data_to": data_to}

  def data_at(events, step):
    (tmp_path / EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
    return Policy(_config(), tmp_path, True, None).data_at(step)

  again = [rewind(20, 20, 25), rewind(20, 25, 27), rewind(20, 27, 30)]
  assert data_at(again[:1], 20) == (5, 25)
  assert data_at(again, 20) == (10, 30)
  # A later checkpoint, saved after the rewinds: its own position, nothing to skip.
  assert data_at(again, 25) == (0, 35)
  # A rewind to an earlier step deletes checkpoint 20: a new one is saved after it.
  assert data_at([*again, rewind(10, 33, 40)], 20) == (0, 50)
  assert data_at([*again, rewind(10, 33, 40), rewind(20, 50, 52)], 20) == (2, 52)
  assert data_at([], 20) == (0, 20)


def test_a_run_killed_after_a_rewind_resumes_onto_the_same_batches(tmp_path, monkeypatch):
  """The rewind to step 20 skips the batches drawn up to the alarm; the run is killed before
  its next checkpoint (an exception right after the rewind, standing in for SIGKILL); resumed
  from step 20 it skips the same batches again and ends as the uninterrupted run does."""
  config = _config(**{"faults.nan": str(FAULTY)})
  loop.train_and_evaluate(config, tmp_path / "whole")
  from bertjax.training import recovery as recovery_lib
  original = recovery_lib.Recovery.recover

  def recover_then_die(self, *args):
    original(self, *args)
    raise KeyboardInterrupt("killed after the rewind")
  monkeypatch.setattr(recovery_lib.Recovery, "recover", recover_then_die)
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, tmp_path / "killed")
  monkeypatch.setattr(recovery_lib.Recovery, "recover", original)
  assert train_helpers.committed_steps(tmp_path / "killed")[-1] == 20
  loop.train_and_evaluate(config, tmp_path / "killed")
  whole, killed = _events(tmp_path / "whole"), _events(tmp_path / "killed")
  assert [e for e in killed if e["kind"] == "rewind"] == [
      e for e in whole if e["kind"] == "rewind"]
  for a, b in zip(_final_params(tmp_path / "whole"), _final_params(tmp_path / "killed")):
    np.testing.assert_array_equal(a, b)


def test_a_run_that_fails_before_its_first_step_leaves_no_watchdog(tmp_path, monkeypatch):
  """The watchdog starts inside the loop's try: a run that fails while setting up its hooks
  leaves no thread behind that would end the process minutes later (one ended a pytest worker
  600 s after a refused fine-tune)."""
  import threading

  from bertjax.training.pretraining import Pretraining

  def refuse(*args, **kwargs):
    raise ValueError("refused while adding hooks")
  monkeypatch.setattr(Pretraining, "add_hooks", refuse)
  with pytest.raises(ValueError, match="refused while adding hooks"):
    loop.train_and_evaluate(_config(num_train_steps=2), tmp_path)
  assert not [t for t in threading.enumerate() if t.name == "bertjax-watchdog"]


def test_heartbeats_are_written_when_the_step_count_changes():
  """A process waiting (a long step, a compile) writes no heartbeat per poll; each new step
  count is written once, and read back by `behind`."""
  from bertjax.resilience.watchdog import Peers

  class Store:
    def __init__(self):
      self.values, self.writes = {}, 0

    def key_value_set(self, key, value, allow_overwrite=False):
      self.writes += 1
      self.values[key] = value

    def key_value_dir_get(self, prefix):
      return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

  peers = Peers()
  peers.client = store = Store()
  for steps in (0, 0, 0, 1, 1, 2, 2, 2):
    peers.beat(steps)
  assert store.writes == 3
  assert store.values == {f"{Peers.BEAT_DIR}0": "2"}
  assert "0: 2" in peers.behind()
