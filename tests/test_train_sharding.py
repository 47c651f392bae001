"""Sharding invariance of the train step, FSDP memory, accumulation."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import train_helpers
from bertjax.parallel import sharding
from xla_env import xla_flags

TESTS = Path(__file__).resolve().parent

MESHES = [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 1, 8)]


@pytest.fixture(scope="module", params=["bert", "gpt"])
def reference(request):
  config = train_helpers.tiny_config(request.param)
  _, state, history = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  return request.param, jax.device_get(state.params), history


@pytest.mark.parametrize("axes", MESHES[1:], ids=lambda a: "x".join(map(str, a)))
@pytest.mark.slow
def test_train_steps_are_mesh_invariant(devices, reference, axes):
  """Two steps (Adam's first update is invariant to the gradient's scale, so one step could
  hide a wrong gradient); every metric, gradient norm included, and all parameters agree."""
  family, params_ref, history_ref = reference
  config = train_helpers.tiny_config(family)
  _, state, history = train_helpers.run_steps(config, axes, steps=2)
  _assert_same_run(history, state.params, history_ref, params_ref)


@pytest.mark.slow
def test_one_hot_lookup_trains_like_the_gather(devices, reference):
  """model.embed_lookup="one_hot" on a (2, 2, 2) mesh takes the same two steps as the
  unsharded gather: the rows it reads are exact, only the table gradient's sums run in
  another order."""
  family, params_ref, history_ref = reference
  config = train_helpers.tiny_config(family, **{"model.embed_lookup": "one_hot"})
  _, state, history = train_helpers.run_steps(config, (2, 2, 2), steps=2)
  _assert_same_run(history, state.params, history_ref, params_ref)


def _assert_same_run(history, params, history_ref, params_ref) -> None:
  """Every metric, gradient norm included, and every parameter agree."""
  for got, expected in zip(history, history_ref):
    for key, value in expected.items():
      assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, got[key], value)
  flat_ref = jax.tree_util.tree_leaves_with_path(params_ref)
  flat = jax.tree.leaves(jax.device_get(params))
  for (path, expected), got in zip(flat_ref, flat):
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ["adamw", "stable_adamw"])
def test_fsdp_shards_weights_and_adam_moments(devices, name):
  config = train_helpers.tiny_config("gpt", sharding_rules="fsdp", **{"optimizer.name": name})
  trainer, state, _ = train_helpers.run_steps(config, (1, 8, 1))
  # chain(clip, adamw): adamw's ScaleByAdamState; chain(clip, stable_adamw): StableAdamState.
  mu = state.opt_state[1][0].mu
  nu = state.opt_state[1][0].nu
  for tree in (state.params, mu, nu):
    large = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree) if x.ndim >= 2
             and x.size >= 64 * 64]
    assert large
    for path, x in large:
      assert sharding.sharded_fraction(x) == pytest.approx(1 / 8), jax.tree_util.keystr(path)
      assert {tuple(s.data.shape) for s in x.addressable_shards} == {
          tuple(d // 8 if i == x.sharding.spec.index("fsdp") else d
                for i, d in enumerate(x.shape))}


@pytest.mark.parametrize("family", ["bert", "gpt"])
@pytest.mark.slow
def test_gradient_accumulation_equals_large_batch(devices, family):
  one = train_helpers.tiny_config(family, batch_size=16)
  four = train_helpers.tiny_config(family, batch_size=16, grad_accum_steps=4)
  _, state_a, hist_a = train_helpers.run_steps(one, (2, 2, 2), steps=2)
  _, state_b, hist_b = train_helpers.run_steps(four, (2, 2, 2), steps=2)
  for a, b in zip(hist_a, hist_b):
    for key in a:
      assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key
  for x, y in zip(jax.tree.leaves(jax.device_get(state_a.params)),
                  jax.tree.leaves(jax.device_get(state_b.params))):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"model.dtype": "bfloat16", "model.remat_policy": "dots", "optimizer.name": "lamb"},
    {"model.remat_policy": "full", "optimizer.name": "adafactor", "model.scan_layers": False},
], ids=["bf16-dots-lamb", "full-remat-adafactor-unrolled"])
def test_precision_remat_and_optimizer_variants_train(devices, overrides):
  config = train_helpers.tiny_config("gpt", **overrides)
  _, state, history = train_helpers.run_steps(config, (2, 2, 2), steps=3)
  assert all(np.isfinite(h["loss"]) for h in history)
  assert history[-1]["loss"] < history[0]["loss"]
  # fp32 master weights whatever the compute dtype.
  assert {str(x.dtype) for x in jax.tree.leaves(state.params)} == {"float32"}


# Compiles the train and eval steps of both families on a (2, 2, 2) data/fsdp/tensor mesh, and
# GPT's train step with the one-hot lookup. XLA reports an involuntary full rematerialization
# (a tensor replicated on every device and re-partitioned, because no collective goes from one
# sharding to the other) only as a C++ warning on stderr, so the compile runs in a child
# process whose stderr is read; the child also has its own jit caches and no persistent
# compilation cache, so nothing compiled earlier hides the warning.
_COMPILE_STEPS = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax
    import train_helpers
    from bertjax.parallel import distributed
    from bertjax.data import make_batches
    from bertjax.training.trainer import Trainer

    for family, lookup in (("gpt", "gather"), ("bert", "gather"), ("gpt", "one_hot")):
      config = train_helpers.tiny_config(family, **{"model.hidden_dropout": 0.1,
                                                    "model.attention_dropout": 0.1,
                                                    "model.embed_lookup": lookup})
      trainer = Trainer(config, train_helpers.mesh_for((2, 2, 2)))
      rows = distributed.local_rows(trainer.data_sharding(), config.batch_size)
      local = next(make_batches(config, "train", rows))
      step = trainer.compile_step(local)
      batch = distributed.global_batch(local, trainer.batch_shardings, rows, config.batch_size)
      state = trainer.abstract_state()
      with jax.set_mesh(trainer.mesh):
        step.lower(state, batch).compile()
        if lookup == "gather":
          trainer._eval.lower(state.params, batch, state.teacher).compile()
      print("compiled", family, lookup, flush=True)
""")


@pytest.mark.slow
def test_embedding_lookup_needs_no_involuntary_rematerialization():
  """On an fsdp x tensor mesh the word-embedding gather (and its scatter-add in the
  backward pass) must partition without XLA replicating a whole [B, L, D] activation."""
  # TF_CPP_MIN_LOG_LEVEL=1: XLA's warnings are printed even where the environment silences
  # them (2 and up would hide the very lines this test reads).
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false",
         "TF_CPP_MIN_LOG_LEVEL": "1",
         "XLA_FLAGS": xla_flags(8)}
  result = subprocess.run([sys.executable, "-c", _COMPILE_STEPS, str(TESTS)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == ["compiled", "gpt", "gather", "compiled", "bert", "gather",
                                   "compiled", "gpt", "one_hot"]
  remats = [line for line in result.stderr.splitlines()
            if "Involuntary full rematerialization" in line]
  assert not remats, f"{len(remats)} involuntary rematerializations:\n" + "\n".join(
      line[:600] for line in remats[:3])


@pytest.mark.slow
def test_stable_adamw_steps_the_same_sharded(devices):
  """StableAdamW's per-tensor RMS is a mean over a sharded tensor: on a (2, 2, 2) mesh with
  FSDP the two steps equal the single-device ones."""
  config = train_helpers.tiny_config("gpt", **{"optimizer.name": "stable_adamw"})
  _, state_ref, history_ref = train_helpers.run_steps(config, (1, 1, 1), steps=2)
  _, state, history = train_helpers.run_steps(config, (2, 2, 2), steps=2)
  _assert_same_run(history, state.params, history_ref, jax.device_get(state_ref.params))
