"""Mixed precision (bertjax/models/precision.py) and the chunked vocabulary loss: the dtype of
each computation, the products XLA's CPU backend is given, gradients against plain einsums,
and the loss without [B, L, V] logits against the whole logits."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_helpers
from xla_env import CHEAP_COMPILE
from bertjax.training import objectives
from bertjax import config as config_lib
from bertjax.config import model_config
from bertjax.models import build_model, jit_init, precision
from bertjax.tools import bench

# Every contraction the layers run through `precision.einsum` (Dense layers, the tied head).
LAYER_EQUATIONS = [
    ("bld,dtnh->bltnh", (2, 8, 16), (16, 3, 2, 4)),
    ("blnh,nhd->bld", (2, 8, 2, 4), (2, 4, 16)),
    ("bld,df->blf", (2, 8, 16), (16, 32)),
    ("blf,fd->bld", (2, 8, 32), (32, 16)),
    ("bd,de->be", (2, 16), (16, 16)),
    ("abd,vd->abv", (2, 8, 16), (40, 16)),
]


def test_auto_resolves_per_platform():
  cfg = model_config(config_lib.load_config("gpt_tiny", [("model.dtype", "bfloat16")]))
  assert cfg.matmul_output == "auto"
  assert precision.resolve(cfg, "cpu").matmul_output == "float32"
  assert precision.resolve(cfg, "tpu").matmul_output == "compute"
  assert precision.resolve(cfg, "gpu").matmul_output == "compute"
  assert precision.resolve(cfg.replace(dtype="float32"), "cpu").matmul_output == "compute"
  assert precision.resolve(cfg.replace(matmul_output="compute"), "cpu").matmul_output == "compute"
  with pytest.raises(ValueError, match="matmul_output"):
    cfg.replace(matmul_output="bf16")


@pytest.mark.parametrize("equation,x_shape,y_shape", LAYER_EQUATIONS,
                         ids=[e for e, _, _ in LAYER_EQUATIONS])
def test_mixed_einsum_value_and_gradients(equation, x_shape, y_shape):
  """The custom VJP computes what JAX's own derivative of the bf16 einsum computes, with
  float32 cotangents (no bf16 rounding of the weight gradient)."""
  cfg = model_config(config_lib.load_config("gpt_tiny", [("model.dtype", "bfloat16"),
                                                         ("model.matmul_output", "float32")]))
  kx, ky, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, x_shape, jnp.float32)
  y = jax.random.normal(ky, y_shape, jnp.float32)

  def reference(x, y):
    return jnp.einsum(equation, x, y, precision=jax.lax.Precision.HIGHEST)

  def bf16(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)

  out, vjp = jax.vjp(lambda a, b: precision.einsum(cfg, equation, a, b), x, y)
  # The reference differentiates at the bf16-rounded inputs, in float32.
  ref_out, ref_vjp = jax.vjp(reference, bf16(x), bf16(y))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  g = jax.random.normal(kg, out.shape, jnp.float32)
  gx, gy = vjp(g)
  # The cotangent enters the backward products in bf16 (as under torch.autocast).
  ref_gx, ref_gy = ref_vjp(bf16(g))
  assert gx.dtype == gy.dtype == jnp.float32
  np.testing.assert_allclose(gx, ref_gx, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(gy, ref_gy, rtol=1e-5, atol=1e-4)


_STEP_DOTS = r"""
import json, re
import jax
from bertjax import config as config_lib
from bertjax.tools import bench
config = config_lib.load_config("gpt_tiny", [("model.dtype", "bfloat16"), ("batch_size", "8")])
step = bench.OurStep(config, bench.synthetic_batch(config))
text = step.compiled.as_text()
types = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\S+) ", text, re.M))
dots = []
for result, operands, name in re.findall(r'= (\S+) dot\(([^)]*)\).*op_name="([^"]*)"', text):
  if re.search(r"/(qkv|out|wi|wo)/|\.attend/|core\._core/", name):
    dots.append([result, [types.get(o.strip().split()[-1], "?") for o in operands.split(",")],
                 name])
print(json.dumps({"dots": dots,
                  "params": sorted({str(x.dtype) for x in jax.tree.leaves(step.state.params)})}))
"""


@pytest.mark.slow
def test_cpu_bf16_step_gives_every_layer_product_bf16_operands():
  """On CPU the bf16 step's layer matmuls, forward and backward (weight gradients
  included), and the attention core's score and context products with their four
  backward products, read bf16 operands and write float32: the form XLA's CPU kernel runs
  at full speed. With JAX's own derivative instead of the custom VJP, XLA upcasts the
  weight gradients' operands to float32, and the core's backward products run in float32
  on float32 cotangents (checked: this test then fails). Compiled in a process of its own
  with the Eigen thread pool on, as users run: the suite's one thread per device
  (tests/xla_env.py) makes XLA upcast some batched products that users get in bf16."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {CHEAP_COMPILE}")
  run = subprocess.run([sys.executable, "-c", _STEP_DOTS], env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  found = json.loads(run.stdout.strip().splitlines()[-1])
  dots = found["dots"]
  # forward + two backward products for qkv, out, wi, wo and the tied head.
  assert len([d for d in dots if "core._core/" not in d[2]]) >= 15, dots
  # scores and context, and the four products of their backward pass.
  assert len([d for d in dots if "core._core/" in d[2]]) >= 6, dots
  for result, operands, name in dots:
    assert result.startswith("f32"), (result, name)
    assert all(o.startswith("bf16") for o in operands), (operands, name)
  assert found["params"] == ["float32"]


def test_compute_mode_writes_bf16_activations():
  """matmul_output=compute (TPU, GPU): layer outputs and layer norms in bf16, logits and
  losses in float32."""
  config = config_lib.load_config("gpt_tiny", [("model.dtype", "bfloat16"),
                                               ("model.matmul_output", "compute")])
  cfg = model_config(config)
  model = build_model(cfg)
  params = jit_init(model)(jax.random.key(0))
  ids = jnp.zeros((2, 16), jnp.int32)
  jaxpr = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, ids))(params))
  assert "preferred_element_type=bfloat16" in jaxpr
  logits = model.apply({"params": params}, ids)
  assert logits.dtype == jnp.float32


@pytest.mark.parametrize("family", ["bert", "gpt"])
@pytest.mark.parametrize("mode", ["float32", "compute"])
def test_bf16_logits_stay_close_to_fp32(family, mode):
  """Same weights, bf16 compute: logits within bf16 rounding of the fp32 model's."""
  name = "bert_tiny" if family == "bert" else "gpt_tiny"
  config = config_lib.load_config(name)
  cfg32 = model_config(config)
  cfg16 = cfg32.replace(dtype="bfloat16", matmul_output=mode)
  params = jit_init(build_model(cfg32))(jax.random.key(1))
  ids = jax.random.randint(jax.random.key(2), (2, 32), 5, cfg32.vocab_size)
  out32 = build_model(cfg32).apply({"params": params}, ids)
  out16 = build_model(cfg16).apply({"params": params}, ids)
  logits32 = out32 if family == "gpt" else out32.mlm_logits
  logits16 = out16 if family == "gpt" else out16.mlm_logits
  scale = float(jnp.abs(logits32).max())
  assert float(jnp.abs(logits16 - logits32).max()) < 0.03 * scale
  assert float(jnp.abs(logits16 - logits32).max()) > 0  # bf16 really ran


def _loss_and_grads(cfg, params, batch):
  obj = objectives.build_objective("causal_lm", build_model(cfg))
  norm = obj.normalizers(batch)
  return jax.jit(jax.value_and_grad(lambda p: obj(p, batch, norm, None), has_aux=True))(params)


# float32: the chunked and the whole products sum in other orders; the gradients differ by
# ~1e-6 of their largest entry (1.08e-6 seen on one CPU), bounded at 3e-6.
@pytest.mark.parametrize("dtype,mode,tolerance", [("float32", "auto", 3e-6),
                                                   ("bfloat16", "float32", 1e-2),
                                                   ("bfloat16", "compute", 3e-2)])
@pytest.mark.slow
def test_chunked_lm_loss_equals_the_whole_logits(dtype, mode, tolerance):
  config = config_lib.load_config("gpt_tiny", [("batch_size", "4"), ("model.dtype", dtype),
                                               ("model.matmul_output", mode)])
  batch = {k: jnp.asarray(v) for k, v in bench.synthetic_batch(config).items()}
  batch["loss_mask"] = batch["loss_mask"].at[:, -5:].set(0)  # weights reach the gradient
  cfg = model_config(config)
  params = jit_init(build_model(cfg))(jax.random.key(0))
  (loss, metrics), grads = _loss_and_grads(cfg, params, batch)
  (loss_c, metrics_c), grads_c = _loss_and_grads(cfg.replace(loss_chunk=16), params, batch)
  assert float(loss_c) == pytest.approx(float(loss), rel=max(tolerance, 1e-6) / 10)
  assert float(metrics_c["lm_accuracy"]) == pytest.approx(float(metrics["lm_accuracy"]))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    g_c = grads_c
    for key in path:
      g_c = g_c[key.key]
    scale = float(jnp.abs(g).max()) or 1.0
    assert float(jnp.abs(g_c - g).max()) <= tolerance * scale, jax.tree_util.keystr(path)


def test_chunked_lm_loss_rejects_a_chunk_that_does_not_divide():
  config = config_lib.load_config("gpt_tiny", [("batch_size", "2"), ("model.loss_chunk", "48")])
  cfg = model_config(config)
  batch = {k: jnp.asarray(v) for k, v in bench.synthetic_batch(config).items()}
  params = jit_init(build_model(cfg))(jax.random.key(0))
  with pytest.raises(ValueError, match="does not divide"):
    _loss_and_grads(cfg, params, batch)
  with pytest.raises(ValueError, match="loss_chunk"):
    model_config(config_lib.load_config("bert_tiny", [("model.loss_chunk", "16")]))


@pytest.mark.slow
def test_chunked_lm_loss_never_holds_the_logits_and_computes_model_flops(devices):
  """No buffer of the compiled step is as large as its rows' [B, L, V] logits in float32, and the compiled
  dots still equal the model FLOPs: the gradients come from the forward pass's softmax,
  nothing is recomputed. With the whole logits the same step does hold such a buffer."""
  # 8 rows over the 8 devices' data axis: one row per device.
  # A narrow model, so that the [V, D] table is smaller than a row's logits.
  overrides = [("batch_size", "8"), ("model.vocab_size", "4096"), ("model.hidden_size", "64"),
               ("model.mlp_dim", "256")]
  sizes = {}
  for chunk in ("0", "16"):
    config = config_lib.load_config("gpt_tiny", overrides + [("model.loss_chunk", chunk)])
    step = bench.OurStep(config, bench.synthetic_batch(config))
    dots, _ = step.compiled_flops()
    model_flops = bench.flops_lib.train_flops_per_step(model_config(config), 8,
                                                       int(config.seq_length))
    assert dots == pytest.approx(model_flops, rel=1e-6), chunk
    shapes = re.findall(r"f32\[([\d,]+)\]", step.compiled.as_text())
    sizes[chunk] = max(int(np.prod([int(d) for d in s.split(",")])) for s in shapes)
  logits = int(config.seq_length) * 4096  # one row's [L, V]
  assert sizes["0"] >= logits
  assert sizes["16"] < logits


@pytest.mark.slow
def test_chunked_lm_loss_is_mesh_invariant(devices):
  """Two steps with the chunked loss on a (2, 2, 2) data/fsdp/tensor mesh equal two steps
  with the whole logits on one device."""
  reference = train_helpers.tiny_config("gpt")
  _, state_ref, history_ref = train_helpers.run_steps(reference, (1, 1, 1), steps=2)
  chunked = train_helpers.tiny_config("gpt", **{"model.loss_chunk": 8})
  _, state, history = train_helpers.run_steps(chunked, (2, 2, 2), steps=2)
  for got, expected in zip(history, history_ref):
    for key, value in expected.items():
      assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, got[key], value)
  for x, y in zip(jax.tree.leaves(jax.device_get(state.params)),
                  jax.tree.leaves(jax.device_get(state_ref.params))):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_the_qkv_products_never_transpose_the_4d_kernel():
  """The mixed path runs qkv's products as matrix products: no transpose of the [d, 3, heads,
  head_dim] kernel in the compiled forward and backward (over its three contracted axes XLA
  relaid it out through a 4-D transposing loop, 17-36 ms per BERT-base layer;
  docs/results/2026-11-27-unrolled-layers-cpu.md)."""
  cfg = model_config(config_lib.load_config("gpt_tiny", [("model.dtype", "bfloat16"),
                                                         ("model.matmul_output", "float32")]))
  x = jnp.ones((2, 8, 32), jnp.float32)
  kernel = jnp.ones((32, 3, 4, 8), jnp.float32)

  def loss(x, kernel):
    return precision.einsum(cfg, "bld,dtnh->bltnh", x, kernel).sum()

  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).compile().as_text()
  kernel_dims = sorted(kernel.shape)
  transposed = [line for line in text.splitlines() if " transpose(" in line
                and (m := re.search(r"= \w+\[([\d,]+)\]", line))
                and sorted(map(int, m.group(1).split(","))) == kernel_dims]
  assert not transposed, transposed
