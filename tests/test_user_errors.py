"""A user's mistake, or the machine's, ends in one line naming the key, file or path and exit
status 2 (never a traceback); a full disk is reported once; a compiler crash has its own status.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import tiny_args

from bertjax import cli
from xla_env import xla_flags

ROOT = Path(__file__).resolve().parent.parent
GPT = ["--config", "gpt_tiny", "--config.data.source=synthetic_markov", *tiny_args(**{
    "model.vocab_size": 2048, "optimizer.warmup_steps": 1, "log_every": 1, "eval_every": 0})]


def _one_error(err: str) -> str:
  """The single error line of a command's stderr (log lines aside)."""
  assert "Traceback" not in err, err[-3000:]
  errors = [line for line in err.splitlines() if "error:" in line]
  assert len(errors) == 1, err[-3000:]
  return errors[0]


@pytest.mark.parametrize("value", ["0", "-4"])
def test_a_batch_size_no_run_can_use_is_refused_before_any_work(tmp_path, capsys, value):
  code = cli.main(["train", "--workdir", str(tmp_path / "run"), *GPT,
                   f"--config.batch_size={value}"])
  assert code == 2
  assert f"--config.batch_size={value}: must be at least 1" in _one_error(capsys.readouterr().err)
  assert not (tmp_path / "run").exists()  # refused before the workdir, data or model


@pytest.mark.parametrize("config", ["modernbert:size=tiny", "mosaicbert", "roberta_base"])
def test_unpaired_instances_with_a_sentence_objective_are_refused(tmp_path, capsys, config):
  """Packed or full-sentence instances have no NSP/SOP labels: training that head on their
  zeros would be silent nonsense."""
  code = cli.main(["train", "--workdir", str(tmp_path / "run"), "--config", config,
                   "--config.objective=mlm_sop"])
  assert code == 2
  assert "makes no sentence pairs for objective='mlm_sop'" in _one_error(
      capsys.readouterr().err)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("body,expected", [
    ("def get_config(:\n  pass\n", "bad.py:1: syntax error"),
    ("import ml_collections\ndef get_config():\n  return {'batch_size': 8}\n",
     "get_config() returned a dict; it must return an ml_collections.ConfigDict"),
    ("from bertjax.config import base_config, gpt_model\n\ndef get_config():\n"
     "  config = base_config(gpt_model())\n  return config.no_such_group.value\n",
     "bad.py:5: get_config() failed: AttributeError"),
    ("x = 1\n", "has no get_config() function"),
])
def test_a_broken_config_file_is_one_line_naming_the_file(tmp_path, capsys, body, expected):
  (tmp_path / "bad.py").write_text(body)
  assert cli.main(["train", "--config", str(tmp_path / "bad.py"), "--workdir",
                   str(tmp_path / "run")]) == 2
  assert expected in _one_error(capsys.readouterr().err)


def test_a_workdir_that_cannot_be_written_is_one_line(tmp_path, capsys):
  (tmp_path / "file").write_text("not a directory")
  for workdir, reason in ((tmp_path / "file" / "run", "Not a directory"),
                          (Path("/sys/bertjax-test/run"), "Operation not permitted")):
    assert cli.main(["train", "--workdir", str(workdir), *GPT,
                     "--config.num_train_steps=2"]) == 2
    line = _one_error(capsys.readouterr().err)
    assert str(workdir.parent) in line or str(workdir) in line
    assert reason in line, line


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
  """A small tmpfs mounted at `path` (root only; skipped where mounting is not allowed)."""
  path.mkdir(parents=True, exist_ok=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                           capture_output=True, text=True)
  if mounted.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_read_only_workdir_is_one_line(tmp_path, capsys):
  with _tmpfs(tmp_path / "ro", "ro,size=1M") as mount:
    assert cli.main(["train", "--workdir", str(mount / "run"), *GPT,
                     "--config.num_train_steps=2"]) == 2
    assert "Read-only file system" in _one_error(capsys.readouterr().err)


@pytest.mark.slow
def test_a_full_disk_is_reported_once(tmp_path):
  """Checkpoints of ~1.5 MiB each on a 3 MiB disk: the second save fails. One error line, exit
  status 2, none of the tracebacks Orbax's and TensorStore's threads print by themselves."""
  with _tmpfs(tmp_path / "small", "size=3M") as mount:
    result = subprocess.run(
        [sys.executable, "-m", "bertjax", "train", "--workdir", str(mount / "run"), *GPT,
         "--config.checkpoint.every=2", "--config.num_train_steps=40"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": xla_flags(2)})
  assert result.returncode == 2, result.stderr[-3000:]
  line = _one_error(result.stderr)
  assert "writing checkpoint step 4 in" in line and line.endswith("failed: no space left on device")
  assert "Event loop is closed" not in result.stderr
  assert "_SignalingThread" not in result.stderr
  assert result.stderr.lower().count("no space left on device") == 1


def test_a_compiler_crash_has_its_own_exit_status(monkeypatch, capsys):
  import concurrent.futures

  class CrashingPool:
    def __init__(self, *args, **kwargs):
      pass

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def submit(self, *args):
      future = concurrent.futures.Future()
      future.set_exception(concurrent.futures.process.BrokenProcessPool("crashed"))
      return future

  monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CrashingPool)
  assert cli.main(["compile", "--config", "gpt_tiny", "--topology", "v4-8"]) == 4
  assert "the TPU compiler (libtpu) crashed" in _one_error(capsys.readouterr().err)


def test_command_line_mistakes_exit_2(tmp_path, capsys):
  assert cli.main(["export", "--params", "a", "--workdir", "b", "--out", "c"]) == 2
  assert "exactly one of --params DIR or --workdir DIR" in _one_error(capsys.readouterr().err)
  assert cli.main(["info", "--config", "gpt_tiny", "--config.model.no_such_key=1"]) == 2
  assert "no_such_key" in _one_error(capsys.readouterr().err)


def test_a_full_disk_under_the_ledger_names_its_file(tmp_path):
  """A write that finds the disk full names no file by itself; the ledger's error names its."""
  import errno
  from bertjax.resilience.ledger import Ledger
  with _tmpfs(tmp_path / "tiny", "size=16k") as mount:
    ledger = Ledger(mount / "run", 1, enabled=True)
    with pytest.raises(OSError) as raised:  # the disk filled up
      for i in range(64):
        (mount / f"filler-{i}").write_bytes(b"\0" * 4096)
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as raised:
      ledger.flush()
  assert raised.value.errno == errno.ENOSPC
  assert str(raised.value).endswith(f"'{ledger.path}'"), raised.value
