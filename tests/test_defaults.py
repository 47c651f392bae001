"""Defaults per backend (bertjax/training/defaults.py): `model.dtype="auto"` becomes bf16 on TPUs
and GPUs and, on a CPU, bf16 only where its bf16 matmuls are measured at least 1.5x float32's
(the probe is stubbed both ways here), side by side, whatever the peak cache holds; explicit
values win; the choice is logged, said in the run's summary and written into config.json; a
resume keeps the run's recorded choice and peak even where the machine's cache moved, and an
explicit change of the dtype is refused in one line; the doctor says it; a TPU slice's compile
gets bf16 without probing."""

import json

import jax.numpy as jnp
import pytest
from train_helpers import tiny_args

from bertjax import cli
from bertjax import config as config_lib
from bertjax.models import ModelConfig, attention
from bertjax.training import defaults, flops

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


# A CPU with AVX-512 BF16: each dtype's matmul probe, FLOP/s (docs/results/
# 2026-11-28-auto-dtype-cpu.md), and its peak cache after one mis-timed log interval raised the
# float32 entry 2.6x and the bf16 entry moved too.
CPU_RATES = {"float32": 460e9, "bfloat16": 900e9}
MOVED_CACHE = {"float32": 2.6 * 460e9, "bfloat16": 1.4 * 900e9}


def _probes_read(monkeypatch, rates):
  monkeypatch.setattr(flops, "measure_matmul_peak",
                      lambda size, dtype, *a, **k: rates[jnp.dtype(dtype).name])


def _cache_holds(entries):
  flops.cpu_peak_cache().parent.mkdir(parents=True, exist_ok=True)
  flops.cpu_peak_cache().write_text(json.dumps(
      {flops.cpu_peak_key(dtype, 1024): value for dtype, value in entries.items()}))


def test_a_cache_with_an_outlier_changes_no_runs_dtype(tmp_path, monkeypatch):
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path))
  _probes_read(monkeypatch, CPU_RATES)
  config = config_lib.load_config("bert_tiny", [("model.dtype", "auto")])
  clean, (choice,) = defaults.resolve(config, "cpu")
  assert clean.model.dtype == "bfloat16" and "1.96x" in choice.reason
  _cache_holds(MOVED_CACHE)
  assert defaults.resolve(config, "cpu") == (clean, [choice])


GPT = ["--config", "gpt_tiny", "--config.data.source=synthetic_markov", *tiny_args(**{
    "model.vocab_size": 128, "optimizer.warmup_steps": 1, "log_every": 1, "eval_every": 0,
    "checkpoint.every": 2, "model.dtype": "auto"})]


@pytest.mark.slow
def test_a_run_keeps_its_choice_and_peak_and_refuses_an_explicit_change(
    tmp_path, capsys, caplog, monkeypatch):
  import logging
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path / "cache"))
  workdir = tmp_path / "run"
  train = ["train", "--workdir", str(workdir), *GPT]
  _probes_read(monkeypatch, CPU_RATES)
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main([*train, "--config.num_train_steps=2"]) == 0
  said = "model.dtype=bfloat16 (auto: bf16 matmuls 1.96x float32's on this CPU)"
  assert said in caplog.text and said in capsys.readouterr().out  # first lines, summary
  assert json.loads((workdir / "config.json").read_text())["model"]["dtype"] == "bfloat16"
  # The machine's cache moved since: it would make a fresh start here float32 with the old
  # probe. Changing the dtype explicitly is still refused, in one line that says why.
  _cache_holds(MOVED_CACHE)
  assert cli.main([*train, "--config.num_train_steps=4", "--config.model.dtype=float32"]) == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(errors) == 1, errors
  assert "model.dtype: 'bfloat16' -> 'float32'" in errors[0]
  # "auto" continues the run as it started: its dtype and its peak, whatever the cache says.
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="bertjax"):
    assert cli.main([*train, "--config.num_train_steps=4"]) == 0
  kept = f"model.dtype=bfloat16 (auto: {defaults.RECORDED_REASON})"
  assert kept in caplog.text and kept in capsys.readouterr().out
  assert "peak 9e+11 FLOP/s for bfloat16 (the run's recorded peak: best of 3" in caplog.text
  assert json.loads((workdir / "mfu_peak.json").read_text())["flops"] == 900e9
  steps = [json.loads(line)["step"] for line in
           (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]
