"""Reproduction contracts (bertjax.reproduction): every paper config has one with traceable
sources, `bertjax reproduce` prints them, a run checks its evals against its contract (inside,
above and below the band), and `bertjax plot` draws the band."""

from __future__ import annotations

import json
import logging

import pytest

from bertjax import cli, config as config_lib
from bertjax.reproduction import contract as contract_lib
from bertjax.reproduction import golden, on_track
from bertjax.reproduction.contract import Contract, Point, Target
from bertjax.tools import reproduce_report
from bertjax.training import plot

PAPER_CONFIGS = reproduce_report.paper_configs()


def test_every_paper_config_has_a_contract_with_traceable_targets():
  """Each config a user can name that reproduces a paper (not the tiny or fine-tuning ones)
  has a contract with at least one target, each with the source it was read from."""
  assert len(PAPER_CONFIGS) >= 50 and "gpt2:size=small" in PAPER_CONFIGS
  assert not any("tiny" in name or name.startswith("finetune") for name in PAPER_CONFIGS)
  missing = [name for name in PAPER_CONFIGS if reproduce_report.contract_of(name) is None]
  assert not missing, f"paper configs without a contract: {missing}"
  without_targets = []
  for name in PAPER_CONFIGS:
    contract = reproduce_report.contract_of(name)
    assert contract.targets or contract.missing, name
    if not contract.targets:
      without_targets.append(name)
    for target in contract.targets:
      # A source names where the number is printed: a paper's table or section, a README,
      # a model card or a log, not just a citation.
      assert len(target.source) > 20, (name, target)
      assert any(word in target.source for word in (
          "Table", "Sec.", "README", "card", "log", "abstract", "notebook", "issues",
          "reference", "table", "ipynb", "notes")), (name, target)
  # T5 paper Table 14's per-size rows were not found in a source that could be read: these
  # contracts say so (docs/reproducing.md), and no other config may lack a target.
  assert without_targets == ["t5:size=small", "t5:size=large", "t5:size=3b",
                             "t5:size=small,version=1.1", "t5:size=large,version=1.1",
                             "t5:size=xl,version=1.1", "t5:size=xxl,version=1.1"]


def test_reproduce_lists_every_paper_config_with_its_targets(capsys):
  assert cli.main(["reproduce"]) == 0
  out = capsys.readouterr().out
  for name in PAPER_CONFIGS:
    assert f"\n{name}: " in f"\n{out}", name
  assert "NO CONTRACT" not in out
  assert out.count("  target  ") >= len(PAPER_CONFIGS)
  for run in golden.GOLDEN_RUNS:
    assert run.config in out


def test_reproduce_details_a_config(capsys):
  """The contract, the launch command, the slice and expected time of its compile report, and
  what is verified here."""
  assert cli.main(["reproduce", "gpt2:size=small"]) == 0
  out = capsys.readouterr().out
  assert "WikiText-103 perplexity (zero-shot) = 37.5" in out
  assert "point   loss 4.317 in [4.217, 4.467] at 524M tokens (step 1000)" in out
  assert "bertjax compile --config configs/gpt2.py:size=small --topology v4-32" in out
  assert "v4-32: 21.5 GiB per chip of 32.0 (fits); expected 33.9 h at 50% MFU" in out
  assert "parameters 124,439,808 against the paper's 124,000,000: matches" in out
  assert "golden curve of gpt2:size=small,runlocal (GPT)" in out


def test_reproduce_of_an_unknown_config_is_one_line(capsys):
  assert cli.main(["reproduce", "gpt9"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "gpt9" in err


def test_golden_commands_refuse_what_they_cannot_do_in_one_line(tmp_path, capsys):
  for argv, message in (
      (["--record", "bert_base:runlocal", "--seeds", "0,1"], "at least 3 distinct seeds"),
      (["--record", "bert_tiny", "--seeds", "0,1,2"], "no golden run for 'bert_tiny'"),
      (["--check", "bert_base:runlocal"], "give --workdir"),
      (["gpt2:size=small", "--config.seed=1"], "overrides apply to --check")):
    workdir = [] if "--workdir" in message else ["--workdir", str(tmp_path)]
    assert cli.main(["reproduce", *argv, *workdir]) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, (argv, err)
  assert not any(tmp_path.iterdir())  # refused before training anything


def test_the_loader_names_the_contract_of_the_config_loaded():
  assert config_lib.load_config("gpt2:size=small").contract == "gpt2:size=small"
  assert config_lib.load_config("bert_base").contract == "bert_base"
  # Items in any order; a variant without a contract (and the runlocal of a paper config
  # whose golden curve is not the one asked for) names none.
  assert config_lib.load_config("albert:sharing=ffn,size=base").contract == (
      "albert:sharing=ffn,size=base")
  assert config_lib.load_config("gpt2:size=medium,runlocal").contract == ""
  assert config_lib.load_config("bert_tiny").contract == ""
  # An override wins: no check, or a contract file.
  config = config_lib.load_config("gpt2:size=small", [("contract", "")])
  assert config.contract == ""


def _contract(points) -> Contract:
  return Contract(paper="a test", targets=(Target("x", 1.0, "a test's own table"),),
                  points=tuple(points))


def test_the_reference_is_the_points_between_them_in_log_tokens_and_none_outside():
  c = _contract([Point(100, "loss", 8.0, 7.0, 9.0, "s"), Point(10_000, "loss", 4.0, 3.0, 5.0,
                                                                 "s")])
  assert c.reference_at("loss", 100) == contract_lib.Reference("loss", 8.0, 7.0, 9.0)
  middle = c.reference_at("loss", 1000)  # halfway in log(tokens)
  assert (middle.value, middle.low, middle.high) == pytest.approx((6.0, 5.0, 7.0))
  assert c.reference_at("loss", 99) is None and c.reference_at("loss", 10_001) is None
  assert c.reference_at("mlm_accuracy", 1000) is None
  with pytest.raises(ValueError, match="does not hold its value"):
    Point(1, "loss", 8.0, 8.5, 9.0, "s")
  with pytest.raises(ValueError, match="has no source"):
    Contract(paper="p", targets=(Target("x", 1.0, " "),))


def test_tokens_trained_counts_each_phase_and_a_batch_ramp():
  config = config_lib.load_config("bert_base")
  assert on_track.tokens_trained(config, 900_000) == 900_000 * 256 * 128
  assert on_track.tokens_trained(config, 1_000_000) == 900_000 * 256 * 128 + 100_000 * 256 * 512
  gpt3 = config_lib.load_config("gpt3:size=125m")
  full = 256 * 2048
  # The ramp's early steps are smaller than a full batch.
  assert on_track.tokens_trained(gpt3, 100) < 100 * full
  late = on_track.tokens_trained(gpt3, 200_000) - on_track.tokens_trained(gpt3, 199_000)
  assert late == 1000 * full


def _run(tmp_path, contract: Contract, capsys, caplog):
  path = tmp_path / "contract.json"
  path.write_text(json.dumps(contract.to_json()))
  workdir = tmp_path / "run"
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main(["train", "--config", "gpt_tiny", "--workdir", str(workdir),
                     "--config.data.source=synthetic_markov", "--config.num_train_steps=6",
                     "--config.log_every=2", "--config.eval_every=2", "--config.eval_steps=1",
                     "--config.checkpoint.every=0", f"--config.contract={path}"]) == 0
  return workdir, capsys.readouterr().out


def test_a_run_logs_on_and_off_track_at_each_eval_and_the_plot_draws_the_band(
    tmp_path, capsys, caplog):
  """A tiny GPT given a synthetic contract: the band at its first eval holds any loss, the
  second lies above every loss a run can have (the run is below it), the third below zero
  (the run is above it)."""
  tokens = 2 * 16 * 128  # gpt_tiny: batch 16 x 128 tokens
  workdir, out = _run(tmp_path, _contract([
      Point(tokens, "loss", 5.0, 0.0, 100.0, "inside"),
      Point(2 * tokens, "loss", 150.0, 100.0, 200.0, "above every loss"),
      Point(3 * tokens, "loss", -5.0, -10.0, -1.0, "below zero")]), capsys, caplog)
  evals = plot.read_metrics(workdir / "metrics.jsonl")["eval"]
  assert [r["step"] for r in evals] == [2, 4, 6]
  assert [on_track.verdicts(r) for r in evals] == [{"loss": 0}, {"loss": -1}, {"loss": 1}]
  assert [r["on_track"] for r in evals] == [1.0, 0.0, 0.0]
  assert evals[1]["loss_ref"] == 150.0 and evals[1]["loss_ref_low"] == 100.0
  assert evals[0]["tokens"] == tokens
  lines = [r.getMessage() for r in caplog.records
           if "track at step" in r.getMessage().lower()]
  assert len(lines) == 3 and lines[0].startswith("on track at step 2 (4,096 tokens)")
  assert "OFF TRACK at step 4" in lines[1] and "below [100, 200]" in lines[1]
  assert "OFF TRACK at step 6" in lines[2] and "above [-10, -1]" in lines[2]
  assert out.count("| OFF TRACK") == 2 and out.count("| on track") == 1
  # The plot: the band and the reference line in the loss panel.
  figure = plot.plot_runs({"run": plot.read_metrics(workdir / "metrics.jsonl")},
                          tmp_path / "plot.png")
  labels = figure.axes[0].get_legend_handles_labels()[1]
  assert "contract band" in labels and "contract" in labels
  assert cli.main(["plot", str(workdir), "--out", str(tmp_path / "cli.png")]) == 0
  assert (tmp_path / "cli.png").stat().st_size > 0


def test_a_contract_without_a_point_for_the_run_logs_nothing(tmp_path, capsys, caplog):
  workdir, _ = _run(tmp_path, _contract([Point(1e12, "loss", 3.0, 2.0, 4.0, "far away")]),
                    capsys, caplog)
  evals = plot.read_metrics(workdir / "metrics.jsonl")["eval"]
  assert evals and not any("on_track" in r or "loss_ref" in r for r in evals)


def test_a_missing_contract_file_is_a_one_line_error(tmp_path, capsys):
  assert cli.main(["train", "--config", "gpt_tiny", "--workdir", str(tmp_path / "w"),
                   f"--config.contract={tmp_path / 'none.json'}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "none.json not found" in err


DOC = config_lib.CONFIGS_DIR.parent / "docs" / "reproducing.md"


def test_reproducing_md_holds_the_contract_table():
  """docs/reproducing.md's table is the contracts': `python tests/test_reproduce.py --write`
  rewrites it."""
  text = DOC.read_text()
  start = text.index(reproduce_report.TABLE_BEGIN)
  end = text.index(reproduce_report.TABLE_END) + len(reproduce_report.TABLE_END)
  assert text[start:end] == reproduce_report.markdown_table(), (
      "docs/reproducing.md's contract table is stale: python tests/test_reproduce.py --write")


if __name__ == "__main__":
  import sys
  if sys.argv[1:] != ["--write"]:
    sys.exit("usage: python tests/test_reproduce.py --write")
  text = DOC.read_text()
  start = text.index(reproduce_report.TABLE_BEGIN)
  end = text.index(reproduce_report.TABLE_END) + len(reproduce_report.TABLE_END)
  DOC.write_text(text[:start] + reproduce_report.markdown_table() + text[end:])
  print(f"wrote the contract table of {DOC}")
