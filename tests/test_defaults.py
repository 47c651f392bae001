"""Defaults per backend (bertjax/training/defaults.py): `model.dtype="auto"` becomes bf16 on TPUs
and GPUs and, on a CPU, bf16 only where its bf16 matmuls are measured at least 1.5x float32's
(the probe is stubbed both ways here); explicit values win; the choice is logged, said in the
run's summary, written into config.json and makes a resume on a machine that decides otherwise
refuse with one line; the doctor says it; a TPU slice's compile gets bf16 without probing."""

import json

import pytest

from bertjax import cli
from bertjax import config as config_lib
from bertjax.models import ModelConfig, attention
from bertjax.training import defaults
from train_helpers import tiny_args

SHAPE = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64,
             max_positions=24)


def _no_probe():
  raise AssertionError("the CPU probe must not run here")


def test_auto_dtype_follows_the_measured_cpu_speedup():
  fast = defaults.compute_dtype("cpu", speedup=lambda: 2.01)
  assert (fast.value, fast.key) == ("bfloat16", "model.dtype")
  assert fast.line() == "model.dtype=bfloat16 (auto: bf16 matmuls 2.01x float32's on this CPU)"
  slow = defaults.compute_dtype("cpu", speedup=lambda: 1.03)
  assert slow.value == "float32" and "1.03x" in slow.reason and "no native bf16" in slow.reason
  assert defaults.compute_dtype("cpu", speedup=lambda: 1.5).value == "bfloat16"  # the bound
  assert defaults.compute_dtype("cpu", speedup=lambda: 1.49).value == "float32"
  # Another host of the run measured otherwise: every process compiles the same program.
  split = defaults.compute_dtype("cpu", speedup=lambda: 2.0, agree=lambda bf16: False)
  assert split.value == "float32" and "another host" in split.reason
  for platform in ("tpu", "gpu", "cuda", "rocm"):
    assert defaults.compute_dtype(platform, speedup=_no_probe).value == "bfloat16", platform


def test_resolve_makes_a_concrete_copy_and_explicit_values_win():
  config = config_lib.load_config("bert_tiny", [("model.dtype", "auto")])
  resolved, choices = defaults.resolve(config, "cpu", speedup=lambda: 1.0)
  assert resolved.model.dtype == "float32" and config.model.dtype == "auto"
  assert [c.key for c in choices] == ["model.dtype"]
  assert config_lib.model_config(resolved).compute_dtype.__name__ == "float32"
  with pytest.raises(ValueError, match="made concrete when a run starts"):
    _ = config_lib.model_config(config).compute_dtype
  for explicit in ("float32", "bfloat16"):
    same = config_lib.load_config("bert_tiny", [("model.dtype", explicit)])
    assert defaults.resolve(same, "cpu", speedup=_no_probe) == (same, [])
  with pytest.raises(ValueError, match="model.param_dtype must be one of"):
    ModelConfig(family="bert", param_dtype="auto", **SHAPE)


def test_the_main_job_is_auto():
  config = config_lib.load_config("modernbert:size=tiny")
  assert config.model.dtype == "auto"


def test_attention_says_what_it_chose_and_why():
  bert = ModelConfig(family="bert", dtype="bfloat16", attention_dropout=0.0, **SHAPE)
  assert attention.choose(bert, "gpu") == ("cudnn", "GPU, 16-bit compute, no attention dropout")
  assert attention.choose(bert, "tpu")[0] == "splash"
  assert attention.choose(bert.replace(dtype="float32"), "gpu") == (
      "xla", "cuDNN's fused kernel takes 16-bit inputs")
  assert attention.choose(bert.replace(attention_dropout=0.1), "gpu")[0] == "xla"
  assert attention.choose(bert.replace(attention_dropout=0.1), "gpu", training=False)[0] == \
      "cudnn"
  assert attention.choose(bert, "cpu")[1].startswith("no fused kernel on cpu")
  t5 = config_lib.model_config(config_lib.load_config("t5:size=tiny")).replace(
      dtype="bfloat16", attention_dropout=0.0)
  assert attention.choose(t5, "tpu")[0] == "xla"
  assert attention.resolve(bert, "gpu").attention == "cudnn"
  assert attention.resolve(bert.replace(attention="xla"), "gpu").attention == "xla"


def test_the_trainer_resolves_a_config_no_run_resolved(monkeypatch, caplog):
  import logging

  from bertjax.parallel import sharding
  from bertjax.training.trainer import Trainer
  monkeypatch.setattr(defaults, "cpu_bf16_speedup", lambda: 2.0)
  config = config_lib.load_config("bert_tiny", [("model.dtype", "auto")])
  with caplog.at_level(logging.INFO, logger="bertjax"):
    trainer = Trainer(config, sharding.mesh_from_config(config))
  assert trainer.model_config.dtype == "bfloat16" and trainer.config.model.dtype == "bfloat16"
  assert "model.dtype=bfloat16 (auto: bf16 matmuls 2.00x float32's on this CPU)" in caplog.text
  assert "model.attention=xla (auto: no fused kernel on cpu" in caplog.text


@pytest.mark.slow
def test_a_tpu_slice_compiles_auto_as_bf16_without_probing(libtpu, monkeypatch):
  from bertjax.tools import aot
  monkeypatch.setattr(defaults, "cpu_bf16_speedup", _no_probe)
  config = config_lib.load_config("bert_tiny", [("model.dtype", "auto")])
  report = aot.compile_for_topology(config, "v4-8")
  assert report.dtype == "bfloat16/float32"


def test_the_doctor_says_what_auto_became(monkeypatch, tmp_path):
  from bertjax.tools import doctor
  monkeypatch.setattr(defaults, "cpu_bf16_speedup", lambda: 1.02)
  config = config_lib.load_config("bert_tiny", [("model.dtype", "auto"), ("batch_size", "8")])
  (check,) = doctor.run_doctor(config, str(tmp_path), checks=("environment",))
  assert "model.dtype=float32 (auto: bf16 matmuls 1.02x float32's on this CPU" in check.detail
  assert check.values["auto"] == {"model.dtype": "float32"}


GPT = ["--config", "gpt_tiny", "--config.data.source=synthetic_markov", *tiny_args(**{
    "model.vocab_size": 128, "optimizer.warmup_steps": 1, "log_every": 1, "eval_every": 0,
    "checkpoint.every": 2, "model.dtype": "auto"})]


@pytest.mark.slow
def test_a_run_records_its_choice_and_a_machine_that_decides_otherwise_cannot_resume(
    tmp_path, capsys, caplog, monkeypatch):
  import logging
  workdir = tmp_path / "run"
  train = ["train", "--workdir", str(workdir), *GPT]
  monkeypatch.setattr(defaults, "cpu_bf16_speedup", lambda: 1.0)
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main([*train, "--config.num_train_steps=2"]) == 0
  said = "model.dtype=float32 (auto: bf16 matmuls 1.00x float32's on this CPU, under 1.5x"
  assert said in caplog.text and said in capsys.readouterr().out  # first lines, summary
  assert json.loads((workdir / "config.json").read_text())["model"]["dtype"] == "float32"
  # A machine whose bf16 is fast resolves bf16: refused, in one line that says why.
  monkeypatch.setattr(defaults, "cpu_bf16_speedup", lambda: 2.0)
  assert cli.main([*train, "--config.num_train_steps=4"]) == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(errors) == 1, errors
  assert ("model.dtype: 'float32' -> 'bfloat16' (model.dtype=bfloat16 (auto: bf16 matmuls "
          "2.00x float32's on this CPU) here; --config.model.dtype=<the checkpoint's> continues "
          "as it was)") in errors[0]
  # The stored value, given explicitly, continues the run.
  assert cli.main([*train, "--config.num_train_steps=4", "--config.model.dtype=float32"]) == 0
  steps = [json.loads(line)["step"] for line in
           (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]
