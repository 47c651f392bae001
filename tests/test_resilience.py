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

SETTINGS = spike_guard.GuardSettings(sigmas=6.0, history=16, min_history=4, min_ratio=1.5,
                                     peak_half_life=1000.0, alarm_skips=3, alarm_window=10)


def _judge_all(losses, grad_norms=None, settings=SETTINGS):
  guard = spike_guard.init(settings)
  skips = []
  for i, loss in enumerate(losses):
    norm = 1.0 + 0.01 * np.cos(i) if grad_norms is None else grad_norms[i]
    guard, skip = spike_guard.judge(guard, jnp.int32(i + 1), jnp.float32(loss),
                                    jnp.float32(norm), settings)
    skips.append(bool(skip))
  return guard, skips


NOISE = [2.0 + 0.01 * np.sin(i) for i in range(12)]
NORMS = [1.0 + 0.01 * np.cos(i) for i in range(12)]


def test_the_guard_skips_a_step_whose_loss_and_norm_both_spike():
  guard, skips = _judge_all(NOISE + [100.0] + NOISE[:3], NORMS + [50.0] + NORMS[:3])
  assert skips == [False] * 12 + [True] + [False] * 3
  assert int(guard.skipped) == 1 and int(guard.alarm) == 0
  assert int(guard.accepted) == 15  # the outlier never enters the statistics
  # Its record's values are its own (a later read names them, not its own step's).
  np.testing.assert_allclose(np.asarray(guard.skip_values), [100.0, 50.0])
  assert int(guard.skip_steps[-1]) == 13


def test_either_signal_alone_is_ordinary_training():
  # A gradient-norm jump while the loss is in its band: early training, a cliff under the
  # kept parameters (DistilBERT's 2.7 -> 85), never skipped.
  _, skips = _judge_all(NOISE[:8] + [2.0, 2.0], NORMS[:8] + [85.0, 85.0])
  assert not any(skips)
  # A hard batch: the loss far above its band, the norm in its own.
  _, skips = _judge_all(NOISE + [9.0], NORMS + [1.0])
  assert not any(skips)


def test_a_falling_loss_and_a_settled_series_are_not_spikes():
  # A fine-tune's loss falls by orders of magnitude: every loss is below the history's median.
  falling = [2.0 * 0.8 ** i for i in range(40)]
  _, skips = _judge_all(falling, [5.0 * 0.9 ** i for i in range(40)])
  assert not any(skips)
  # A fine-tune's hard batch once its loss is near zero (one misclassified example: the loss
  # x 170, the norm x 3000, seen in the README fine-tune) is below where the loss started.
  near_zero = [0.7 * 0.97 ** i for i in range(200)]
  norms = [5.0 * 0.98 ** i for i in range(200)]
  _, skips = _judge_all(near_zero + [170 * near_zero[-1]], norms + [3000 * norms[-1]])
  assert not any(skips)
  # A very steady series: 20% up in both is within min_ratio (1.5x), twice is a spike.
  steady, flat = [2.0] * 12, [1.0] * 12
  assert not any(_judge_all(steady + [2.4], flat + [1.2])[1])
  assert _judge_all(steady + [4.0], flat + [2.0])[1][-1]


def test_non_finite_steps_are_skipped_from_the_first_and_raise_the_alarm():
  # Before min_history nothing finite is judged; a non-finite value always is, and alarms.
  guard, skips = _judge_all([2.0, 50.0, float("nan"), 2.0], [1.0, 50.0, 1.0, 1.0])
  assert skips == [False, False, True, False] and int(guard.alarm) == 3
  guard, skips = _judge_all([2.0] * 6, [1.0] * 5 + [float("inf")])
  assert skips[-1] and int(guard.alarm) == 6


def test_three_skips_within_the_window_raise_the_alarm_from_the_first():
  base, norms = NOISE[:8], NORMS[:8]
  guard, _ = _judge_all(base + [9.0, 2.0, 9.0, 2.0, 9.0], norms + [9.0, 1.0, 9.0, 1.0, 9.0])
  assert int(guard.alarm) == 9  # steps 9, 11, 13 skipped: the trouble began at 9
  guard, _ = _judge_all(base + [9.0] + [2.0] * 10 + [9.0, 9.0],
                        norms + [9.0] + [1.0] * 10 + [9.0, 9.0])
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


def test_a_checkpoint_without_this_rules_statistics_resumes_with_them_afresh(tmp_path, caplog):
  """Saved with the guard off (or by an earlier rule, whose fields had other names): the
  resumed run starts the guard's statistics from zero and trains on."""
  import logging
  loop.train_and_evaluate(_config(num_train_steps=10, **{"resilience.spike_sigmas": 0.0}),
                          tmp_path)
  with caplog.at_level(logging.INFO, logger="bertjax.checkpoints.train_state"):
    result = loop.train_and_evaluate(_config(num_train_steps=20), tmp_path)
  assert "no spike-guard statistics of this rule: they start afresh" in caplog.text
  assert result["skipped_updates"] == 0.0
  # Another history length: statistics of other shapes, afresh too.
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="bertjax.checkpoints.train_state"):
    loop.train_and_evaluate(_config(num_train_steps=30, **{"resilience.spike_history": 64}),
                            tmp_path)
  assert "no spike-guard statistics of this rule: they start afresh" in caplog.text


def test_a_skip_read_at_a_later_log_step_records_its_own_values(tmp_path):
  """log_every=5: the skip at step 23 (poison at 22) is read at step 25, and its record holds
  step 23's loss (x 50) and gradient norm, not step 25's."""
  loop.train_and_evaluate(_config(num_train_steps=30, log_every=5,
                                  **{"faults.poison": "22"}), tmp_path)
  (event,) = _events(tmp_path)
  assert event["kind"] == "skipped" and event["last_step"] == 23 and event["seen_at"] == 25
  logged = {int(r["step"]): r for r in map(json.loads, (tmp_path / "metrics.jsonl")
                                           .read_text().splitlines()) if "grad_norm" in r}
  assert event["loss"] > 40 * logged[25]["loss"] and event["grad_norm"] > logged[25]["grad_norm"]


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


def test_a_replay_from_before_an_earlier_rewind_skips_what_that_rewind_skipped(tmp_path):
  """A skip at step 15 (poison at 14), a NaN batch at 30 rewound to checkpoint 30, then two
  more skips (poison at 33 and 36): three skips within the window alarm from step 15, so the
  replay starts at checkpoint 10, before the rewind to 30. It must skip what that rewind
  skipped, or it meets the NaN batch the run never trained on and calls data trouble a
  hardware fault (found in a gpt_tiny run under launch/local.py: exit 5, twice)."""
  config = _config(**{"faults.poison": "14,33,36", "faults.nan": "30"})
  loop.train_and_evaluate(config, tmp_path)
  rewinds = [e for e in _events(tmp_path) if e["kind"] == "rewind"]
  assert [(e["trouble_from"], e["rewound_to"], e["replay"]) for e in rewinds] == [
      (31, 30, "reproduced"), (15, 10, "reproduced")], _events(tmp_path)
  assert not [e for e in _events(tmp_path) if e["kind"] == "hardware_fault"]


def test_a_resumed_run_does_not_record_earlier_skips_again(tmp_path):
  """A skip at step 25, a stop at step 30, a resume to 40: one `skipped` event, and the
  ledger of the second attempt counts no skipped time."""
  loop.train_and_evaluate(_config(num_train_steps=30, **{"faults.poison": str(FAULTY)}),
                          tmp_path)
  loop.train_and_evaluate(_config(**{"faults.poison": str(FAULTY)}), tmp_path)
  assert [e["kind"] for e in _events(tmp_path)] == ["skipped"]
  second = json.loads((tmp_path / "goodput" / "attempt-0002.json").read_text())
  assert second["seconds"]["skipped"] == 0


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
