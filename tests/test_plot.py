"""bertjax.training.plot without a training run: reading metrics.jsonl, a failed plot that costs one
warning line, not the run, and `bertjax plot` of two runs (the PNGs of real runs:
tests/test_train_loop.py)."""

import argparse
import json
import logging

from bertjax.training import plot


def _write(path, records, tail=""):
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_read_metrics_keeps_the_last_line_of_a_step_and_skips_a_cut_line(tmp_path):
  metrics = tmp_path / "metrics.jsonl"
  _write(metrics, [{"step": 10, "split": "train", "loss": 3.0},
                   {"step": 20, "split": "train", "loss": 2.0},
                   {"step": 20, "split": "eval", "loss": 2.5},
                   # resumed from step 10: step 20 trained again
                   {"step": 20, "split": "train", "loss": 1.5}],
         tail='{"step": 30, "spl')
  records = plot.read_metrics(metrics)
  assert [(r["step"], r["loss"]) for r in records["train"]] == [(10, 3.0), (20, 1.5)]
  assert [r["step"] for r in records["eval"]] == [20]


def test_a_failed_plot_is_one_warning_and_no_exception(tmp_path, monkeypatch, caplog):
  metrics = tmp_path / "metrics.jsonl"
  _write(metrics, [{"step": 10, "split": "train", "loss": 3.0}])

  def broken(*args, **kwargs):
    raise RuntimeError("no fonts")

  monkeypatch.setattr(plot, "plot_runs", broken)
  with caplog.at_level(logging.WARNING):
    assert plot.plot_workdir(metrics, tmp_path / "metrics.png", "run") is False
  warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and "no fonts" in warnings[0].getMessage()
  assert "\n" not in warnings[0].getMessage()
  assert not (tmp_path / "metrics.png").exists()


def test_plot_of_two_workdirs_draws_each_run_under_its_name(tmp_path, monkeypatch, capsys):
  """`bertjax plot A B`: one figure, one colour per run labelled by its workdir's name, the
  panels of both (BERT: MLM and NSP accuracy; GPT: next-token accuracy)."""
  bert, gpt = tmp_path / "bert_run", tmp_path / "gpt_run"
  for workdir, accuracy in ((bert, ("mlm_accuracy", "nsp_accuracy")), (gpt, ("lm_accuracy",))):
    workdir.mkdir()
    _write(workdir / "metrics.jsonl",
           [{"step": s, "split": split, "loss": 5.0 - s / 10, **dict.fromkeys(accuracy, s / 100)}
            for s in (10, 20, 30) for split in ("train", "eval")])
  figures = []
  draw = plot.plot_runs
  monkeypatch.setattr(plot, "plot_runs", lambda *a, **k: figures.append(draw(*a, **k)))
  out = tmp_path / "compare.png"
  assert plot.cmd_plot(argparse.Namespace(workdirs=[str(bert), str(gpt)], out=str(out))) == 0
  assert f"wrote {out}" in capsys.readouterr().out
  data = out.read_bytes()
  assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
  (figure,) = figures
  panels = {ax.get_title(): ax for ax in figure.axes if ax.get_visible()}
  assert set(panels) == {"loss", "MLM accuracy", "NSP accuracy", "next-token accuracy"}
  assert {line.get_label() for line in panels["loss"].get_lines()} == {
      "bert_run train", "bert_run eval", "gpt_run train", "gpt_run eval"}
  assert {line.get_label() for line in panels["next-token accuracy"].get_lines()} == {
      "gpt_run train", "gpt_run eval"}
  colours = {line.get_label().split()[0]: line.get_color() for line in panels["loss"].get_lines()}
  assert colours["bert_run"] != colours["gpt_run"]
