"""Weights & Biases (config.wandb): what a run hands W&B (the config once, every record at its
step), one W&B run across resumes, and a real offline run's files; a missing package or a
wrong mode is a one-line user error."""

import json
import shutil
import sys
import types

import pytest
import train_helpers

from bertjax import cli
from bertjax.training import loop


class FakeWandb(types.ModuleType):
  """The slice of the wandb API the tracker uses, recording the calls."""

  def __init__(self):
    super().__init__("wandb")
    self.inits, self.logs, self.finished = [], [], 0

  def init(self, **kwargs):
    self.inits.append(kwargs)
    fake = self

    class Run:
      def log(self, data, step):
        fake.logs.append((step, data))

      def finish(self):
        fake.finished += 1
    return Run()


def _config(**changes):
  return train_helpers.tiny_config("gpt", **{"num_train_steps": 4, "checkpoint.every": 2,
                                              "wandb.project": "bertjax-tests", **changes})


@pytest.mark.slow
def test_a_run_logs_its_records_and_config_and_a_resume_continues_the_same_run(
    tmp_path, monkeypatch):
  fake = FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  first = tmp_path / "run"
  loop.train_and_evaluate(_config(**{"wandb.tags": "tiny,gpt"}), str(first))
  (init,) = fake.inits
  assert init["project"] == "bertjax-tests" and init["resume"] == "allow"
  assert init["name"] == "run" and init["tags"] == ["tiny", "gpt"]
  assert init["config"]["model"]["num_layers"] == 2 and init["mode"] == "online"
  assert init["id"] == json.loads((first / "wandb.json").read_text())["id"]
  records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in records if r["split"] == "train"] == [
      (step, data["train/loss"]) for step, data in fake.logs]
  assert fake.finished == 1
  # Resumed from its step-2 checkpoint: the same W&B run, the steps trained again re-logged.
  shutil.rmtree(first / "checkpoints" / "4")
  shutil.rmtree(first / "params")
  loop.train_and_evaluate(_config(**{"wandb.tags": "tiny,gpt"}), str(first))
  assert len(fake.inits) == 2 and fake.inits[1]["id"] == init["id"]
  assert [step for step, _ in fake.logs] == [1, 2, 3, 4, 3, 4]


@pytest.mark.slow
def test_a_real_offline_run_writes_its_files_in_the_workdir(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_SILENT", "true")
  workdir = tmp_path / "run"
  loop.train_and_evaluate(_config(**{"wandb.mode": "offline"}), str(workdir))
  run_id = json.loads((workdir / "wandb.json").read_text())["id"]
  (run,) = (workdir / "wandb").glob(f"offline-run-*-{run_id}")
  assert list(run.glob("*.wandb")) and (run / "files").is_dir()


def test_wandb_without_the_package_or_with_a_wrong_mode_is_a_user_error(
    tmp_path, monkeypatch, capsys):
  base = ["train", "--config", "gpt_tiny", "--config.data.source=synthetic_markov",
          "--config.num_train_steps=1", "--config.wandb.project=p"]
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
  assert cli.main(base + ["--workdir", str(tmp_path / "a")]) == 2
  assert "pip install wandb" in capsys.readouterr().err
  monkeypatch.setitem(sys.modules, "wandb", FakeWandb())
  assert cli.main(base + ["--workdir", str(tmp_path / "b"), "--config.wandb.mode=live"]) == 2
  assert "wandb.mode must be one of online, offline, disabled" in capsys.readouterr().err
