"""`bertjax bench --time-to`: the target's syntax, a run stopped at the first eval that meets
it (its time and step recorded), a run that ends without meeting it (exit status 1), a
workdir that is not fresh and a malformed target (exit status 2)."""

from __future__ import annotations

import json

import pytest

from bertjax import cli
from bertjax.tools.time_to import Target, parse_target

# gpt_tiny on synthetic data: 40 steps, an eval every 10 (its loss starts near ln(vocab)).
ARGS = ["bench", "--config", "gpt_tiny", "--config.data.source=synthetic_markov",
        "--config.num_train_steps=40", "--config.eval_every=10", "--config.eval_steps=1",
        "--config.checkpoint.every=0", "--config.log_every=10"]


def test_targets():
  assert parse_target("eval/mlm_accuracy>=0.26") == Target("eval", "mlm_accuracy", 0.26, True)
  assert parse_target("mlm_accuracy=0.26") == Target("eval", "mlm_accuracy", 0.26, True)
  assert parse_target("eval/loss <= 5.1") == Target("eval", "loss", 5.1, False)
  assert parse_target("eval/loss<=5.1").met(5.0) and not parse_target("loss<=5.1").met(5.2)
  for bad in ("accuracy", "eval/acc>0.2", "acc>=x"):
    with pytest.raises(ValueError, match="expected"):
      parse_target(bad)


@pytest.mark.slow
def test_a_met_target_stops_the_run_and_an_unmet_one_exits_1(tmp_path, capsys):
  status = cli.main(ARGS + ["--time-to", "eval/loss<=1000", "--workdir", str(tmp_path / "met"),
                            "--json", str(tmp_path / "met.json")])
  record = json.loads((tmp_path / "met.json").read_text())
  assert status == 0 and record["reached"] and record["step"] == 10, record
  assert 0 < record["seconds"] == record["evals"][0]["seconds"] and len(record["evals"]) == 1
  assert "eval/loss<=1000 reached at step 10 after" in capsys.readouterr().out
  assert record["machine"]["cores"] >= 1 and "gpt_tiny" in record["command"]

  status = cli.main(ARGS + ["--time-to", "eval/loss<=0", "--workdir", str(tmp_path / "unmet"),
                            "--json", str(tmp_path / "unmet.json")])
  record = json.loads((tmp_path / "unmet.json").read_text())
  assert status == 1 and not record["reached"] and record["exit_status"] == 0
  assert [e["step"] for e in record["evals"]] == [10, 20, 30, 40]
  assert "eval/loss<=0 not reached: the last eval, step 40, gave" in capsys.readouterr().out

  assert cli.main(ARGS + ["--time-to", "eval/loss<=0", "--workdir", str(tmp_path / "met")]) == 2
  assert "is not empty" in capsys.readouterr().err
  assert cli.main(ARGS + ["--time-to", "loss>1"]) == 2
  err = capsys.readouterr().err
  assert "expected [SPLIT/]METRIC>=VALUE" in err and len(err.strip().splitlines()) == 1
