"""The checks of the device itself for `bertjax doctor` (bertjax/tools/doctor.py): do its
fused attention kernels, its 16-bit products and its collectives compute the right thing, and
how fast. Each returns `Check`s, one line of the report each. Guide: docs/doctor.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from bertjax import config as config_lib
from bertjax.models import attention
from bertjax.models.config import ModelConfig
from bertjax.tools import topology
from bertjax.training import flops as flops_lib

STATUSES = ("pass", "warn", "fail", "skip")

# Data-sheet interconnect bandwidth per device, bidirectional, bytes/s: NVLink 4 (H100/H200
# SXM) 900 GB/s, NVLink 3 (A100 SXM) 600 GB/s; TPUs from bertjax.tools.topology's table.
GPU_INTERCONNECT = {"NVIDIA H100": 900e9, "NVIDIA H200": 900e9, "NVIDIA A100": 600e9}
# Below this fraction of the data sheet's interconnect figure a collective warns.
MIN_BANDWIDTH_FRACTION = 0.2


@dataclasses.dataclass
class Check:
  """One line of the report."""
  name: str
  status: str             # pass, warn, fail or skip
  figure: str             # the measurement, in words and numbers
  detail: str = ""        # how it was measured, or why it was skipped
  values: dict[str, Any] = dataclasses.field(default_factory=dict)

  def line(self) -> str:
    return f"{self.status.upper():<5} {self.name:<34} {self.figure}" + (
        f"  [{self.detail}]" if self.detail else "")


def platform() -> str:
  return jax.devices()[0].platform


def _scaled_error(out: np.ndarray, ref: np.ndarray) -> float:
  """max |out - ref| over the output's scale (max |ref|)."""
  scale = float(np.abs(ref).max()) or 1.0
  return float(np.abs(out.astype(np.float64) - ref.astype(np.float64)).max()) / scale


# --- attention -----------------------------------------------------------------------------


def _attention_cases(length: int, batch: int = 2) -> dict[str, tuple[Any, np.ndarray, int]]:
  """Mask kind -> (AttentionMask, the query positions whose output is used, window)."""
  rng = np.random.RandomState(length)
  cut = int(rng.randint(length // 4, length // 2))
  padded = np.ones((batch, length), np.int32)
  padded[0, cut:] = 0
  documents = np.ones((batch, length), np.int32)
  documents[0, cut // 2:cut] = 2
  documents[0, cut:] = 0  # padding after two packed documents
  documents[1, length // 3:] = 2
  window = max(1, length // 8)
  return {
      "padding": (attention.encoder_mask(jnp.asarray(padded)), padded.astype(bool), 0),
      "causal": (attention.decoder_mask(length), np.ones((batch, length), bool), 0),
      "packed": (attention.decoder_mask(length, jnp.asarray(documents),
                                        jnp.asarray((documents > 0).astype(np.int32))),
                 documents > 0, 0),
      "local_window": (attention.encoder_mask(jnp.asarray(padded)), padded.astype(bool),
                       window),
  }


def fused_paths(platform_name: str) -> list[tuple[str, Callable[..., jax.Array], str]]:
  """(name, fn(config, q, k, v, mask, window=...), how it runs here) of the fused attention
  kernels this platform runs; on CPU both, emulated. Looked up at call time, so that a test
  can hand the check a broken kernel."""
  def splash(*args, **kwargs):
    return attention.splash_attention(*args, **kwargs)

  def cudnn(*args, **kwargs):
    return attention.cudnn_attention(*args, implementation="cudnn", **kwargs)

  def cudnn_emulated(*args, **kwargs):
    return attention.cudnn_attention(*args, implementation="xla", **kwargs)

  if platform_name == "gpu":
    return [("cudnn", cudnn, "cuDNN fused kernel")]
  if platform_name == "tpu":
    return [("splash", splash, "Pallas splash kernel")]
  return [("splash", splash, "Pallas splash kernel in interpret mode (no TPU here)"),
          ("cudnn", cudnn_emulated, "the cuDNN call through XLA's implementation (no GPU here)")]


def _fused_dtype(name: str, run_dtype: str) -> str:
  """cuDNN's flash attention takes 16-bit inputs only: checked in bfloat16 for a float32 run."""
  return "bfloat16" if name == "cudnn" and run_dtype == "float32" else run_dtype


def _outputs_and_gradients(f: Callable[..., jax.Array], q: jax.Array, k: jax.Array,
                           v: jax.Array, weights: jax.Array
                           ) -> tuple[np.ndarray, list[np.ndarray]]:
  """f(q, k, v), and the gradients of sum(f(q, k, v) * weights) with respect to q, k and v."""
  def loss(q, k, v):
    return (f(q, k, v).astype(jnp.float32) * weights).sum()
  gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  return (np.asarray(jax.jit(f)(q, k, v), np.float32),
          [np.asarray(g, np.float32) for g in gradients])


def _xla_core(cfg: ModelConfig, mask: attention.AttentionMask, window: int
              ) -> Callable[..., jax.Array]:
  """The XLA core in `cfg`'s dtype under `mask` (and a window of `window` keys each side)."""
  dense = mask.dense_B1LS
  if window:
    dense = dense & attention.window_band(dense.shape[-1], window)

  def core(q, k, v):
    dtype = cfg.compute_dtype
    return attention.XlaAttention(cfg).apply({}, q.astype(dtype), k.astype(dtype),
                                             v.astype(dtype), dense)
  return core


def _attention_case(kernel: Callable[..., jax.Array], cfg: ModelConfig,
                    inputs: tuple[jax.Array, ...], mask: attention.AttentionMask,
                    used: np.ndarray, window: int) -> dict[str, float]:
  """The kernel's errors against the float32 XLA core, and the tolerances."""
  q, k, v, weights = inputs
  with jax.default_matmul_precision("highest"):
    ref_out, ref_grads = _outputs_and_gradients(
        _xla_core(cfg.replace(dtype="float32"), mask, window), q, k, v, weights)
    same_out, same_grads = _outputs_and_gradients(_xla_core(cfg, mask, window), q, k, v,
                                                  weights)
  out, grads = _outputs_and_gradients(
      functools.partial(kernel, cfg, mask=mask, window=window), q, k, v, weights)
  # Two units in the last place of the checked dtype (bf16: 2^-6), 1e-5 in float32.
  dtype = jnp.dtype(cfg.dtype)
  floor = 2 * float(jnp.finfo(dtype).eps) if dtype.itemsize < 4 else 1e-5
  return {
      "forward_error": _scaled_error(out[used], ref_out[used]),
      "gradient_error": max(_scaled_error(g, r) for g, r in zip(grads, ref_grads)),
      "forward_tolerance": max(2 * _scaled_error(same_out[used], ref_out[used]), floor),
      "gradient_tolerance": max(
          2 * max(_scaled_error(g, r) for g, r in zip(same_grads, ref_grads)), floor)}


def attention_checks(config: ml_collections.ConfigDict, length: int | None = None,
                     heads: int = 4) -> list[Check]:
  model = config_lib.model_config(config)
  platform_name = platform()
  run_choice = attention.resolve(model, platform_name).attention
  if length is None:
    # Interpret mode is slow: one tile on CPU; a BERT-length sequence on an accelerator.
    length = 128 if platform_name == "cpu" else 512
  head_dim = model.head_dim
  checks = []
  for name, kernel, how in fused_paths(platform_name):
    dtype = _fused_dtype(name, model.dtype)
    cfg = ModelConfig(family="gpt", vocab_size=64, hidden_size=heads * head_dim, num_layers=1,
                      num_heads=heads, mlp_dim=64, max_positions=length, dtype=dtype,
                      attention_dropout=0.0, hidden_dropout=0.0)
    keys = jax.random.split(jax.random.key(0), 4)
    # Inputs rounded to the checked dtype once: the reference sees the same numbers.
    q, k, v = (jax.random.normal(key, (2, length, heads, head_dim)).astype(dtype)
               for key in keys[:3])
    uses = f"; the run uses {run_choice}" if run_choice != name else "; the run uses it"
    for kind, (mask, used, window) in _attention_cases(length).items():
      weights = jax.random.normal(keys[3], q.shape) * used[:, :, None, None]
      try:
        values = _attention_case(kernel, cfg, (q, k, v, weights), mask, used, window)
      except Exception as e:  # noqa: BLE001 - a kernel that does not run is this check's finding
        checks.append(Check(f"attention/{name}/{kind}", "fail",
                            f"did not run: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                            how))
        continue
      ok = (values["forward_error"] <= values["forward_tolerance"]
            and values["gradient_error"] <= values["gradient_tolerance"])
      checks.append(Check(
          f"attention/{name}/{kind}", "pass" if ok else "fail",
          f"forward {values['forward_error']:.2e} (tol {values['forward_tolerance']:.2e}), "
          f"gradients {values['gradient_error']:.2e} (tol {values['gradient_tolerance']:.2e}) "
          f"of scale, {dtype}, L={length}", how + uses,
          {**values, "dtype": dtype, "length": length}))
  return checks


# --- products ------------------------------------------------------------------------------


def product_check(size: int | None = None) -> list[Check]:
  """bf16 products accumulated in float32 against float32, then each dtype's matmul peak."""
  accelerator = platform() != "cpu"
  size = size or (4096 if accelerator else 512)
  a = jax.random.normal(jax.random.key(1), (size, size)).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(2), (size, size)).astype(jnp.bfloat16)
  with jax.default_matmul_precision("highest"):
    reference = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)))
  product = np.asarray(bf16_product(a, b))
  error = _scaled_error(product, reference)
  # float32 accumulation of `size` products: about sqrt(size) x 2^-24 of the scale; a 16-bit
  # accumulator is hundreds of times that.
  tolerance = 1e-4
  checks = [Check("products/bf16_accumulation", "pass" if error <= tolerance else "fail",
                  f"bf16 x bf16 -> float32 off by {error:.2e} of scale (tol {tolerance:.0e}), "
                  f"{size}x{size}x{size}", "operands rounded to bf16 once; reference float32, "
                  "highest precision", {"error": error, "tolerance": tolerance})]
  nominal = flops_lib.device_peak_flops(jax.local_devices()[0])
  peaks = {}
  for dtype in ("bfloat16", "float32"):
    peaks[dtype] = flops_lib.measure_matmul_peak(flops_lib.matmul_peak_size(1024),
                                                 jnp.dtype(dtype))
  figure = ", ".join(f"{d} {p / 1e12:,.1f} TFLOP/s" for d, p in peaks.items())
  values = {"matmul_peak_flops": peaks, "data_sheet_bf16_flops": nominal}
  if nominal:
    fraction = peaks["bfloat16"] / nominal
    values["bf16_fraction_of_data_sheet"] = fraction
    figure += f"; bf16 at {fraction:.0%} of the data sheet's {nominal / 1e12:,.0f} TFLOP/s"
    status = "pass" if fraction >= 0.5 else "warn"
  else:
    status, figure = "pass", figure + "; no data sheet for this device kind"
  checks.append(Check("products/matmul_peak", status, figure,
                      "one device, square matmuls, fastest output form; float32 as the "
                      "platform computes it by default (TF32 on NVIDIA GPUs)", values))
  return checks


def bf16_product(a: jax.Array, b: jax.Array) -> jax.Array:
  """The product the models compute: 16-bit operands, float32 accumulation and result."""
  return jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))(a, b)


# --- collectives ---------------------------------------------------------------------------


# TPU device kinds -> bertjax.tools.topology generation (its ICI figure is per chip).
_TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5p": "v5p",
              "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def interconnect_bandwidth(device: Any) -> float | None:
  """The data sheet's per-device interconnect bandwidth (bidirectional, bytes/s), or None."""
  kind = device.device_kind
  for name, value in GPU_INTERCONNECT.items():
    if kind.startswith(name):
      return value
  for name, generation in sorted(_TPU_KINDS.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(name):
      spec = topology.GENERATIONS[generation]
      return spec.ici_per_chip / spec.devices_per_chip if spec.ici_per_chip else None
  return None


def _collective(kind: str, axis: str, block: jax.Array) -> jax.Array:
  """One device's block [1, ..., 1, n] through the collective over mesh axis `axis`."""
  if kind == "all-reduce":
    return jax.lax.psum(block, axis)
  if kind == "all-gather":
    return jax.lax.all_gather(block, axis, axis=block.ndim - 1, tiled=True)
  return jax.lax.psum_scatter(block, axis, scatter_dimension=block.ndim - 1, tiled=True)


def _expected(kind: str, values: np.ndarray, axis_index: int) -> np.ndarray:
  """What every device should hold, laid out like the global output (mesh axes leading)."""
  total = values.sum(axis=axis_index, keepdims=True)
  ways = values.shape[axis_index]
  if kind == "all-reduce":
    return np.broadcast_to(total, values.shape)
  if kind == "all-gather":
    gathered = np.concatenate(np.split(values, ways, axis=axis_index), axis=-1)
    return np.broadcast_to(gathered, values.shape[:-1] + (values.shape[-1] * ways,))
  n = values.shape[-1] // ways
  chunks = [np.take(total, 0, axis=axis_index)[..., i * n:(i + 1) * n] for i in range(ways)]
  return np.stack(chunks, axis=axis_index)


def collective_checks(mesh: jax.sharding.Mesh, bytes_per_device: int | None = None,
                      repeats: int = 5) -> list[Check]:
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  if not axes:
    return [Check("collectives", "skip", f"one device per mesh axis ({dict(mesh.shape)}): no "
                  "collective to measure")]
  accelerator = platform() != "cpu"
  bytes_per_device = bytes_per_device or (64 * 2**20 if accelerator else 2**20)
  mesh_shape = tuple(mesh.shape[a] for a in mesh.axis_names)
  n = bytes_per_device // 4
  n -= n % math.lcm(*mesh_shape)
  # Small integers: float32 sums are exact, so any wrong partner shows.
  values = np.random.RandomState(0).randint(0, 64, mesh_shape + (n,)).astype(np.float32)
  spec = PartitionSpec(*mesh.axis_names, None)
  global_in = jax.make_array_from_callback(values.shape, NamedSharding(mesh, spec),
                                           lambda index: values[index])
  sheet = interconnect_bandwidth(jax.local_devices()[0])
  checks = []
  for axis in axes:
    ways, axis_index = mesh.shape[axis], mesh.axis_names.index(axis)
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
      run = jax.jit(jax.shard_map(functools.partial(_collective, kind, axis), mesh=mesh,
                                  in_specs=spec, out_specs=spec, check_vma=False))
      out = run(global_in)
      expected = _expected(kind, values, axis_index)
      wrong = sum(not np.array_equal(np.asarray(shard.data), expected[shard.index])
                  for shard in out.addressable_shards)
      best = float("inf")
      for _ in range(repeats):
        start = time.perf_counter()
        run(global_in).block_until_ready()
        best = min(best, time.perf_counter() - start)
      # Bus bandwidth (NCCL's convention: comparable across collectives and device counts).
      moved = {"all-reduce": 2 * (ways - 1) / ways * bytes_per_device,
               "all-gather": (ways - 1) * bytes_per_device,
               "reduce-scatter": (ways - 1) / ways * bytes_per_device}[kind]
      bandwidth = moved / best
      name = f"collectives/{axis}/{kind}"
      figure = (f"{bandwidth / 1e9:,.2f} GB/s bus bandwidth over {ways} devices, "
                f"{bytes_per_device / 2**20:,.0f} MiB per device, {best * 1e3:,.2f} ms")
      v = {"bus_bytes_per_second": bandwidth, "seconds": best, "ways": ways,
           "bytes_per_device": bytes_per_device, "wrong_shards": wrong}
      if wrong:
        checks.append(Check(name, "fail", f"{wrong} device(s) hold wrong values; " + figure,
                            "checked value by value against the host's sum", v))
        continue
      if sheet:
        fraction = bandwidth / sheet
        v["fraction_of_data_sheet"] = fraction
        checks.append(Check(name, "pass" if fraction >= MIN_BANDWIDTH_FRACTION else "warn",
                            figure + f", {fraction:.0%} of the data sheet's "
                            f"{sheet / 1e9:,.0f} GB/s", "values exact", v))
      else:
        checks.append(Check(name, "pass", figure, "values exact; no data-sheet interconnect "
                            f"figure for {jax.local_devices()[0].device_kind}", v))
  return checks
