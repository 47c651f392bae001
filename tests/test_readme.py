"""Every command in README.md's bash blocks runs and exits 0, in README order (later commands use
what earlier ones made: the main job's runs/modernbert_tiny feeds plot, generate, finetune and
export).

How a command is run is decided per `&&`-separated part by `RULES` (first match wins); a part
no rule matches fails the test, so a command added to the README without a way to run it here
is caught instead of skipped. The rules change nothing in a command but append flags that cut
its step count (training steps, epochs, timed steps, generated tokens) and, for the commands
whose cost is a base-size model (`compile`, `bench`), its depth to 2 layers; the flags a user
types are all parsed and used. The two-phase run reads the main job's built dataset instead of
building the same one again. Choices:

- The "fresh machine" commands: their install parts (`python3 -m venv`, activating the venv,
  `pip install`) are not re-run; the test runs the parts after them with the installed package
  (this interpreter's bin directory first on PATH), which is what the install leads to.
- The test-suite command (`python -m pytest`) is not run: it would run this test again.
- `bertjax import ~/models/...`: HOME is a temporary directory holding a small random Hugging
  Face BERT saved by `transformers` under that name.
- Everything runs in a temporary directory where `configs/` and `launch/` point at the
  repository's, so `runs/...` paths are local to the test.

Supporting a new README command: add a rule (a regex on the part, the flags to append).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from xla_env import TEST_FLAGS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# Training runs: a few steps, with a checkpoint, an eval and a log line on the way.
_TRAIN = ("--config.num_train_steps=4 --config.optimizer.warmup_steps=1 "
          "--config.checkpoint.every=2 --config.eval_every=2 --config.eval_steps=1 "
          "--config.log_every=2")

# Commands whose cost is compiling or running a base-size model: the same program, 2 layers.
_FEWER_LAYERS = "--config.model.num_layers=2"
# Benchmarks, whose cost is also running the model (and its PyTorch twin) on this CPU: the
# same program, 2 layers of BERT-Tiny's width.
_SMALLER = ("--config.model.num_layers=2 --config.model.hidden_size=128 "
            "--config.model.num_heads=2 --config.model.mlp_dim=512")


@dataclasses.dataclass(frozen=True)
class Rule:
  """How the test runs a command part matching `pattern` (re.search)."""

  pattern: str
  # Appended to the part (a reduced step count); None: the part is not run (see `why`).
  append: str | None = ""
  why: str = ""
  # Environment changes for the command line holding this part ({home}: a temporary HOME).
  env: tuple[tuple[str, str], ...] = ()
  # Prepares something the part needs from outside the repository (called with the home dir).
  setup: Callable[[Path], None] | None = None


def _tiny_hf_bert(home: Path) -> None:
  """A small random BertForPreTraining where the README's import line looks for one."""
  sys.path.insert(0, str(REPO / "tests"))
  import hf_models
  hf_models.bert(home / "models" / "bert-base-uncased")


RULES: tuple[Rule, ...] = (
    Rule(r"^python3 -m venv \.venv$", None, "install: the package under test is installed"),
    Rule(r"^\. \.venv/bin/activate$", None, "install: this interpreter's bin is on PATH"),
    Rule(r"^pip install ", None, "install: the package under test is installed"),
    Rule(r"python -m pytest", None, "the test suite: it would run this test again"),
    # The phase switch is the point; the data is the main job's (same sources, vocabulary).
    Rule(r"^bertjax train --config configs/bert_tiny_two_phase\.py ",
         _TRAIN + " --config.phase2.start_step=2"
         " --config.data.dataset=runs/modernbert_tiny/data/dataset"),
    Rule(r"^(XLA_FLAGS=\S+ )?bertjax train ", _TRAIN),
    Rule(r"^python launch/local\.py .* -- bertjax train ", _TRAIN),
    Rule(r"^python launch/tpu_vm\.py .* --dry-run "),
    Rule(r"^bertjax info "),
    Rule(r"^bertjax compile ", _FEWER_LAYERS),
    Rule(r"^bertjax generate "),
    Rule(r"^bertjax plot "),
    Rule(r"^bertjax init "),
    Rule(r"^bertjax data task "),
    Rule(r"^bertjax finetune ", "--epochs 1"),
    Rule(r"^bertjax data glue "),
    Rule(r"^bertjax eval glue ", "--tasks mnli --seeds 0,1 --epochs 1"),
    Rule(r"^bertjax tokenizer train "),
    Rule(r"^bertjax data build "),
    Rule(r"^bertjax data bench "),
    Rule(r"^bertjax bench .*--compare hf", "--steps 1 --pairs 1 " + _SMALLER),
    Rule(r"^bertjax bench .*--decode ", "--new-tokens 2 " + _SMALLER),
    # The kernel and product checks have their own tests (tests/test_doctor.py).
    Rule(r"^bertjax doctor ", "--steps 2 --checks environment,speed,checkpoint,loader"),
    Rule(r"^bertjax import ~/", env=(("HOME", "{home}"),), setup=_tiny_hf_bert),
    Rule(r"^bertjax export --workdir \S+ --step ", "--step 4"),
    Rule(r"^bertjax export "),
)


def readme_commands(text: str) -> list[str]:
  """The commands of the ```bash blocks, continuation lines joined, in order."""
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
    for line in block.replace("\\\n", " ").splitlines():
      if line.strip():
        commands.append(" ".join(line.split()))
  return commands


def command_parts(command: str) -> list[str]:
  """A command's `&&`-separated parts, trailing comments dropped."""
  return [re.sub(r"\s+#.*$", "", part).strip() for part in command.split(" && ")]


def rule_for(part: str) -> Rule:
  for rule in RULES:
    if re.search(rule.pattern, part):
      return rule
  raise LookupError(f"README command part {part!r} has no rule in tests/test_readme.py RULES: "
                    "add one saying how the test runs it")


def planned(command: str) -> tuple[str, list[Rule]]:
  """The shell line the test runs for a README command, and the rules of its parts."""
  runs, rules = [], []
  for part in command_parts(command):
    rule = rule_for(part)
    rules.append(rule)
    if rule.append is not None:
      runs.append(f"{part} {rule.append}".strip())
  return " && ".join(runs), rules


def test_every_readme_command_has_a_rule():
  commands = readme_commands(README.read_text())
  assert len(commands) >= 20, commands  # the blocks were found
  for command in commands:
    planned(command)  # raises for a part no rule covers


def test_an_unknown_command_is_refused():
  with pytest.raises(LookupError, match="no rule"):
    planned("bertjax frobnicate --out runs/x")


def _workspace(tmp: Path) -> dict[str, str]:
  for name in ("configs", "launch"):
    (tmp / name).symlink_to(REPO / name)
  env = dict(os.environ)
  # Commands that want simulated devices say so themselves (the tour's first line); the
  # suite's compile and collective-timeout flags stay (tests/xla_env.py), unless a command sets
  # XLA_FLAGS itself.
  env["XLA_FLAGS"] = TEST_FLAGS
  env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
  env["PYTHONUNBUFFERED"] = "1"
  return env


@pytest.mark.timeout(1800)
@pytest.mark.slow
def test_readme_commands_run(tmp_path):
  env = _workspace(tmp_path)
  home = tmp_path / "home"
  home.mkdir()
  # Every command planned first: one without a rule fails before minutes of the others run.
  for line, rules in [planned(command) for command in readme_commands(README.read_text())]:
    if not line:
      continue
    part_env = dict(env)
    for rule in rules:
      if rule.setup:
        rule.setup(home)
      part_env.update({k: v.format(home=home) for k, v in rule.env})
    started = time.perf_counter()
    result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=part_env,
                            capture_output=True, text=True, timeout=600, check=False)
    print(f"{time.perf_counter() - started:6.1f} s  {line}")
    assert result.returncode == 0, (f"README command failed (exit {result.returncode}):\n"
                                    f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # The main job explains itself.
    if ("bertjax train --config configs/modernbert.py:size=tiny --workdir runs/modernbert_tiny "
        in line):
      output = result.stdout + result.stderr
      assert ("run finished at step 4 of 4" in output
              and "runs/modernbert_tiny/metrics.png" in output)
      # The summary names the workdir as an absolute path: the next commands run from anywhere.
      assert re.search(r"bertjax export --params \S*/runs/modernbert_tiny/params --format hf",
                       output), output[-3000:]
      png = (tmp_path / "runs" / "modernbert_tiny" / "metrics.png").read_bytes()
      assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # The multi-process line builds its data on first use: process 0 trains the tokenizer and
    # builds the embedded sample into the shared workdir, the other process waits for it.
    if line.startswith("python launch/local.py "):
      output = result.stdout + result.stderr
      workdir = tmp_path / re.search(r"--workdir (\S+)", line).group(1)
      assert (workdir / "data" / "dataset" / "dataset.json").is_file()
      assert (workdir / "params" / "model.json").is_file()
      assert "[p1]" in output and "process 1 of 2" in output, output[-3000:]
    # The tour's `data build` runs with its defaults: they hold out an eval split.
    if line.startswith("bertjax data build --source embedded ") and "--eval-fraction" not in line:
      from bertjax.data.records import BuiltDataset
      out = re.search(r"--out (\S+)", line).group(1)
      counts = BuiltDataset.open(tmp_path / out).counts()["embedded"]
      assert counts["eval"]["documents"] > 0 and counts["train"]["documents"] > 0, counts


def test_empty_eval_split_is_caught_at_start_up(tmp_path):
  """The README's `data build` then `train --config.data.dataset=` once built a dataset whose
  eval split came out empty and died at the first evaluation; now such a build fails with the
  counts, and the train loader of a run that evaluates refuses a dataset built without an
  eval split before the first step."""
  from bertjax.data.build import build_dataset
  from bertjax.data.options import BuildOptions
  from bertjax.data.errors import CorpusError
  from bertjax.data.pipeline import CorpusBatches
  from bertjax.data.options import LoaderConfig
  from bertjax.data.sources import parse_source

  words = [f"w{i}" for i in range(50)]
  (tmp_path / "a.txt").write_text("\n\n".join(
      "\n".join(" ".join(words[(d + s + k) % 50] for k in range(8)) + " ." for s in range(6))
      for d in range(8)) + "\n")
  (tmp_path / "vocab.txt").write_text(
      "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + words) + "\n")
  source = [parse_source(f"bert_lines:{tmp_path / 'a.txt'}")]
  with pytest.raises(CorpusError, match=r"eval_fraction 1e-09 held out no document of 8 .*"
                                        r"--eval-fraction 0 to hold out nothing"):
    build_dataset(source, tmp_path / "vocab.txt", tmp_path / "held_out_none",
                  BuildOptions(num_shards=2, eval_fraction=1e-9))
  # Built with no eval split on purpose: a run that evaluates refuses it at start-up.
  build_dataset(source, tmp_path / "vocab.txt", tmp_path / "built",
                BuildOptions(num_shards=2, eval_fraction=0.0))
  cfg = LoaderConfig(dataset=str(tmp_path / "built"), objective="mlm_nsp", seq_length=32)
  CorpusBatches(cfg, "train", [0], 2).close()  # a run that does not evaluate is fine
  with pytest.raises(CorpusError, match=r"no eval documents .* larger --eval-fraction"):
    CorpusBatches(dataclasses.replace(cfg, require_eval=True), "train", [0], 2)


def test_one_set_of_data_defaults():
  """`bertjax data build`'s defaults, a run's build on first use (the config's data group) and
  the data package's own options are one set of values."""
  from bertjax.cli import _parser
  from bertjax.config.data_schema import data_group
  from bertjax.data.options import BuildOptions, LoaderConfig
  args = _parser().parse_args(["data", "build", "--source", "embedded", "--tokenizer", "t",
                               "--out", "o"])
  build = BuildOptions()
  assert (args.eval_fraction, args.num_shards, args.workers, args.language) == (
      build.eval_fraction, build.num_shards, build.num_workers, build.language)
  group = data_group()
  assert group.eval_fraction == build.eval_fraction == 0.05
  for key in ("mask_prob", "bert_instances", "short_seq_prob", "dupe_factor", "shuffle_window",
              "seed", "num_epochs", "num_workers", "prefetch", "weights", "epoch_documents"):
    assert group[key] == getattr(LoaderConfig, key), key
