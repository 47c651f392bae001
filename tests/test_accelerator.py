"""The accelerator tier: what only a GPU or TPU can show — the fused attention kernels as
compiled for the chip, the bf16 policy's output form there, a train step with a checkpoint and
an exact resume, cached generation, the compiled matmuls, and `bertjax doctor` end to end.

Each test is marked `accelerator(twin=...)` with the CPU test of the same property (the suite
runs that one on every commit) or `accelerator(reason=...)` where there is none; the last test
here checks that every one says which. On CPU they skip with the command that runs them:

    JAX_PLATFORMS=cuda python -m pytest -m accelerator -n 0 -rA tests/test_accelerator.py

(`tpu` on a TPU VM.) docs/doctor.md has the tier with the GPU benchmark table as one command,
and docs/results/ what they gave on the GPUs they ran on.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from bertjax import config as config_lib
from bertjax.config import model_config
from bertjax.models import build_model, jit_init

TESTS = Path(__file__).parent
TWIN = "tests/{}::{}"


# gpt_tiny on synthetic data, bf16, no dropout (deterministic), 8 steps, a checkpoint at 4.
GPT_TINY = {"data.source": "synthetic_markov", "model.dtype": "bfloat16",
            "model.hidden_dropout": "0.0", "model.attention_dropout": "0.0",
            "num_train_steps": "8", "log_every": "1", "eval_every": "0",
            "checkpoint.every": "4"}


def _gpt_tiny(**changes):
  return config_lib.load_config("gpt_tiny", list({**GPT_TINY, **changes}.items()))


@pytest.mark.accelerator(twin=TWIN.format(
    "test_attention.py", "test_implementations_match_xla_forward_and_gradients"))
def test_the_fused_attention_kernel_matches_the_xla_core_here():
  """cuDNN (GPU) or splash (TPU) as compiled for this chip, bf16, against the XLA core in
  float32: padding, causal, packed and local-window masks, forward and gradients."""
  from bertjax.tools import device_checks
  checks = device_checks.attention_checks(_gpt_tiny())
  assert len(checks) == 4
  failed = [c.line() for c in checks if c.status != "pass"]
  assert not failed, failed
  expected = {"gpu": "cudnn", "tpu": "splash"}[jax.default_backend()]
  assert all(c.name.startswith(f"attention/{expected}/") for c in checks)


@pytest.mark.accelerator(twin=TWIN.format("test_precision.py",
                                          "test_compute_mode_writes_bf16_activations"))
def test_the_bf16_policy_writes_bf16_activations_and_float32_logits_here():
  """On an accelerator `matmul_output=auto` is the compute dtype: products written in bf16,
  logits in float32, and within bf16 rounding of the float32 model's."""
  config = _gpt_tiny()
  cfg = model_config(config)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  jaxpr = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, ids))(params))
  assert "preferred_element_type=bfloat16" in jaxpr
  logits = jax.jit(lambda p: model.apply({"params": p}, ids))(params)
  assert logits.dtype == jnp.float32
  reference = build_model(cfg.replace(dtype="float32"))
  with jax.default_matmul_precision("highest"):
    expected = jax.jit(lambda p: reference.apply({"params": p}, ids))(params)
  error = float(jnp.abs(logits - expected).max() / jnp.abs(expected).max())
  assert error < 0.05, error


def _train_records(workdir: Path) -> list[dict]:
  """metrics.jsonl's train records, without the machine's timings."""
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if k not in ("step_time", "tokens_per_sec", "mfu")}
          for r in rows if "loss" in r]


# XLA's GPU scatter-adds and cuDNN's attention backward sum in whatever order their atomics
# land unless told otherwise; exact resume compares bits.
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"


def _train(workdir: Path) -> None:
  env = {**os.environ, "XLA_FLAGS": DETERMINISTIC}
  result = subprocess.run(
      [sys.executable, "-m", "bertjax", "train", "--config", "gpt_tiny", "--workdir",
       str(workdir), *(f"--config.{k}={v}" for k, v in GPT_TINY.items())], env=env,
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.accelerator(twin=TWIN.format("test_checkpoints.py",
                                          "test_three_kills_resume_bit_identically"))
def test_a_train_run_checkpoints_and_resumes_exactly_here(tmp_path):
  """A run's step-8 checkpoint removed, the run started again resumes from step 4 and logs
  steps 5-8 exactly as the run that went straight through (deterministic GPU reductions)."""
  import shutil
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _train(straight)
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "8")
  shutil.rmtree(resumed / "params")
  _train(resumed)
  first, again = _train_records(straight), _train_records(resumed)
  assert [r["step"] for r in first] == list(range(1, 9))
  assert [r["step"] for r in again] == list(range(1, 9)) + list(range(5, 9))
  for a, b in zip(first[4:], again[8:]):
    assert a == b, f"step {a['step']}: straight {a}, resumed {b}"
  assert len({r["loss"] for r in first}) > 1


@pytest.mark.accelerator(twin=TWIN.format("test_generate.py",
                                          "test_cached_greedy_equals_full_recomputation"))
def test_cached_generation_equals_recomputation_here():
  import test_generate

  from bertjax.inference import generate as gen
  params, cfg = test_generate._gpt(True)
  got = gen.generate(params, cfg, test_generate.PROMPTS, max_new_tokens=10)
  expected = [test_generate.uncached_greedy(params, cfg, p, 10) for p in test_generate.PROMPTS]
  assert got == expected


@pytest.mark.accelerator(twin=TWIN.format("test_bench.py",
                                          "test_model_flops_formula_matches_xla"))
def test_the_compiled_matmuls_equal_the_model_flops_here():
  """The compiled program's matmuls (on a GPU: cuBLAS calls and fusions holding dots) add up
  to the model-FLOPs formula MFU is computed from."""
  from bertjax.tools import bench
  from bertjax.training import flops
  config = config_lib.load_config("gpt_tiny", [
      ("model.hidden_size", "256"), ("model.mlp_dim", "1024"), ("model.num_heads", "4"),
      ("model.vocab_size", "2048"), ("batch_size", "16"), ("model.scan_layers", "False")])
  step = bench.OurStep(config, bench.synthetic_batch(config))
  dots, _ = step.compiled_flops()
  model = flops.train_flops_per_step(model_config(config), 16, int(config.seq_length), None)
  assert dots == pytest.approx(model, rel=1e-6)


@pytest.mark.accelerator(twin=TWIN.format("test_doctor.py",
                                          "test_doctor_on_one_device_prints_every_check"))
def test_doctor_passes_end_to_end_here(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  report = tmp_path / "doctor.json"
  result = subprocess.run(
      [sys.executable, "-m", "bertjax", "doctor", "--config", "gpt_tiny", "--workdir",
       str(tmp_path), "--json", str(report), "--config.data.source=synthetic_markov",
       "--config.model.dtype=bfloat16", "--steps", "2"], env=env, capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  record = json.loads(report.read_text())
  names = {c["name"] for c in record["checks"]}
  assert {"environment", "products/bf16_accumulation", "speed", "checkpoint", "loader"} <= names
  assert not record["failed"]


def _accelerator_marks(path: Path) -> dict[str, dict[str, str]]:
  """Test function -> the keywords of its accelerator mark, read from the source."""
  marks = {}
  for node in ast.parse(path.read_text()).body:
    if not isinstance(node, ast.FunctionDef):
      continue
    for decorator in node.decorator_list:
      if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
          and decorator.func.attr == "accelerator"):
        marks[node.name] = {k.arg: ast.literal_eval(_format_call(k.value))
                            for k in decorator.keywords}
  return marks


def _format_call(node: ast.AST) -> str:
  """TWIN.format("file", "name") -> its string, as source text for literal_eval."""
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
    args = [ast.literal_eval(a) for a in node.args]
    return repr(TWIN.format(*args))
  return ast.unparse(node)


def _defined_tests(path: Path) -> set[str]:
  return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_accelerator_test_names_a_cpu_twin_or_a_reason():
  """Runs on CPU: each accelerator test's twin exists (file and function), or it says why
  there is none; an accelerator test with neither, or a twin renamed away, fails here."""
  marks = _accelerator_marks(Path(__file__))
  assert len(marks) >= 6
  for name, keywords in marks.items():
    twin, reason = keywords.get("twin"), keywords.get("reason")
    assert twin or reason, f"{name}: accelerator mark without twin= or reason="
    if twin:
      file, _, function = twin.partition("::")
      path = TESTS.parent / file
      assert path.is_file(), f"{name}: twin file {file} does not exist"
      assert function in _defined_tests(path), f"{name}: {file} defines no {function}"
