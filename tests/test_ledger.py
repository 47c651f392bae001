"""The goodput ledger (bertjax.resilience.ledger) after a rewind over skipped steps: every step's
time is in one category once (the skipped steps a rewind undid are `rewound`'s, no longer also
`skipped`'s), the mean productive step stays the mean of the steps still productive, and the
categories add up to the wall clock; on a fake clock and in a run of the tiny GPT."""

from __future__ import annotations

import json
import time

import pytest
import train_helpers

from bertjax.resilience import ledger as ledger_lib
from bertjax.training import loop


def test_a_rewind_over_skipped_steps_counts_each_step_once(tmp_path, monkeypatch):
  clock = [1000.0]
  monkeypatch.setattr(ledger_lib.time, "monotonic", lambda: clock[0])
  ledger = ledger_lib.Ledger(tmp_path, 1, enabled=False, started=time.time())

  def train(steps: int) -> None:  # steps of one second each, as the loop times them
    for _ in range(steps):
      ledger.switch("data_wait")
      ledger.switch("productive")
      clock[0] += 1.0
      ledger.steps += 1

  train(24)
  for _ in range(3):  # steps 25-27 skipped, each read right after it (bertjax.resilience.policy)
    train(1)
    ledger.move("productive", "skipped", ledger.step_time())
  train(1)
  assert ledger.seconds["skipped"] == pytest.approx(3.0)
  ledger.rewind(8, 3)  # back to step 20: steps 21-28 undone, 25-27 among them
  seconds = ledger.record()["seconds"]
  assert seconds["rewound"] == pytest.approx(8.0)
  assert seconds["skipped"] == pytest.approx(0.0) and seconds["productive"] == pytest.approx(20)
  assert ledger.step_time() == pytest.approx(1.0) and ledger.productive_steps() == 20
  train(10)
  joined = ledger_lib.report([ledger.record()])
  assert joined["seconds"]["productive"] == pytest.approx(30.0)
  assert sum(joined["seconds"].values()) == pytest.approx(joined["wall"])


def test_a_run_rewound_over_its_skipped_steps_counts_them_once(tmp_path):
  # Batches 24-26 x 50: steps 25-27 skipped, the alarm at 27, a rewind to checkpoint 20.
  config = train_helpers.tiny_config("gpt", **{
      "num_train_steps": 40, "checkpoint.every": 10, "resilience.spike_min_history": 8,
      "resilience.replica_check_every": 0, "faults.poison": "24,25,26"})
  loop.train_and_evaluate(config, tmp_path)
  events = [json.loads(x) for x in (tmp_path / "resilience.jsonl").read_text().splitlines()]
  rewind = [e for e in events if e["kind"] == "rewind"]
  assert len(rewind) == 1 and rewind[0]["rewound_to"] == 20, events
  record = json.loads((tmp_path / "goodput" / "attempt-0001.json").read_text())
  seconds = record["seconds"]
  print(f"ledger after the rewind: {seconds}; steps {record['steps']}, productive steps "
        f"{record['productive_steps']}")
  # Every skipped step was undone: its time is `rewound`'s alone (3/8 of it, counted twice,
  # stayed `skipped`'s before).
  assert 0 < seconds["rewound"] and seconds["skipped"] <= 0.02 * seconds["rewound"]
  undone = rewind[0]["step"] + 1 - rewind[0]["rewound_to"]  # the metrics are read a step late
  assert record["productive_steps"] == pytest.approx(record["steps"] - undone, abs=0.01)
  span = record["updated"] - record["started"]
  assert sum(seconds.values()) == pytest.approx(span, rel=0.01)
