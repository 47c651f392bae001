"""Model FLOPs per training step and device peaks, for MFU.

Model FLOPs count the work the model needs, not what the program happens to do (PaLM, App. B):
6·N per training token for the layer stack's matmul parameters, plus attention's
12·layers·seq·width (no causal halving), plus 6·vocab·width per position whose vocabulary
projection is computed, plus BERT's small heads. On CPU the XLA core skips the causal score
blocks above the diagonal from 512 tokens (`attention.causal_query_blocks`), so the compiled
dots read below the model FLOPs by them.

The guide: docs/training.md, 'Metrics' (MFU and peaks).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from bertjax import paths
from bertjax.data import decoder_length, schema
from bertjax.models import ModelConfig, relative

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per chip (per GPU), from the vendors' data sheets.
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v2": 45e12, "TPU v3": 123e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
    "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
    "TPU v6e": 918e12, "NVIDIA A100": 312e12, "NVIDIA H100": 989e12, "NVIDIA H200": 989e12,
}


def matmul_params(cfg: ModelConfig) -> int:
  """Parameters of the layer stack that take part in a matmul per token (QKV and output
  projections, MLP in and out: a gated MLP's input projection is twice as wide), excluding
  embedding tables and heads."""
  d, f = cfg.hidden_size, cfg.mlp_dim
  return cfg.num_layers * (4 * d * d + (3 if cfg.mlp_gated else 2) * d * f)


def encoder_decoder_flops_per_step(cfg: ModelConfig, batch_size: int, encoder_length: int,
                                   decoder_length: int) -> float:
  """Model FLOPs of one training step of an encoder-decoder (T5, BART): the encoder's layers
  over its tokens; the decoder's self-attention, cross-attention (its keys and values projected
  from every encoder token, in every decoder layer) and MLP over its tokens; the LM head on
  every decoder token. Attention projections are hidden_size x heads x head_dim (T5's head
  width need not be hidden_size / heads)."""
  d, f, inner = cfg.hidden_size, cfg.mlp_dim, cfg.num_heads * cfg.head_dim
  mlp = (3 if cfg.mlp_gated else 2) * d * f
  encoder_tokens, decoder_tokens = batch_size * encoder_length, batch_size * decoder_length
  encoder = cfg.num_layers * (6 * (4 * d * inner + mlp) + 12 * encoder_length * inner)
  decoder = cfg.decoder_depth * (6 * (6 * d * inner + mlp)
                                 + 12 * (decoder_length + encoder_length) * inner)
  cross_kv = cfg.decoder_depth * 6 * 2 * d * inner
  head = 6 * cfg.vocab_size * d
  return float(encoder * encoder_tokens + (decoder + head) * decoder_tokens
               + cross_kv * encoder_tokens)


def train_flops_per_step(cfg: ModelConfig, batch_size: int, seq_length: int,
                         predictions_per_seq: int | None = None) -> float:
  """Model FLOPs of one training step (forward + backward) of `batch_size` sequences.

  predictions_per_seq: positions per sequence that reach the MLM / LM head (BERT's
  max_predictions with gathered positions); None means every position (GPT, or MLM logits
  everywhere). BERT's heads: the MLM transform (width² per predicted position), the pooler
  (width² per sequence) and the 2-way NSP classifier.
  """
  d, e = cfg.hidden_size, cfg.embedding_width
  tokens = batch_size * seq_length
  predicted = batch_size * (seq_length if predictions_per_seq is None else predictions_per_seq)
  stack = (6 * matmul_params(cfg) + 12 * cfg.num_layers * seq_length * d) * tokens
  if cfg.position_embedding == "relative":
    # DeBERTa: per term, every query (c2p) or key (p2c) against all 2·span table rows, and
    # the table's projection to position keys / queries once per layer.
    rows, terms = 2 * relative.span(cfg), len(relative.terms(cfg))
    stack += 6 * cfg.num_layers * terms * (rows * d * tokens + rows * d * d)
  projection = 6 * e * d * tokens if e != d else 0
  if cfg.has_generator:
    # Replaced-token detection: the generator's MLM step at the predicted positions, and the
    # discriminator's head (dense and one logit) on every token.
    generator = train_flops_per_step(cfg.generator_config(), batch_size, seq_length,
                                     predictions_per_seq)
    generator -= 6 * 2 * cfg.generator_hidden_size * batch_size  # it has no sentence head
    return float(stack + projection + 6 * (d * d + d) * tokens + generator)
  vocab = 6 * cfg.vocab_size * e * predicted
  heads = cfg.family_record.head_flops(cfg, batch_size, predicted)
  return float(stack + projection + vocab + heads)


def run_flops_per_step(cfg: ModelConfig, config: Any, batch_size: int | None = None,
                       seq_length: int | None = None) -> float:
  """Model FLOPs of one training step of the run `config` (its objective decides which
  positions reach the vocabulary: MLM's gathered predictions, every position for a causal or
  encoder-decoder LM, none for a fine-tuning head); `batch_size` and `seq_length` where a phase
  or a ramp stage differs from the config's."""
  b = int(config.batch_size) if batch_size is None else batch_size
  length = int(config.seq_length) if seq_length is None else seq_length
  objective = schema.objective(config.objective)
  if cfg.is_encoder_decoder:
    return encoder_decoder_flops_per_step(cfg, b, length, decoder_length(config))
  predictions = (None if objective.causal else
                 int(config.max_predictions) if objective.masked_lm else 0)
  return train_flops_per_step(cfg, b, length, predictions)


def device_peak_flops(device: jax.Device) -> float | None:
  """Nominal peak of an accelerator, or None when the kind is not in the table (CPU)."""
  kind = device.device_kind
  for name, peak in sorted(PEAK_FLOPS_BY_DEVICE_KIND.items(), key=lambda kv: -len(kv[0])):
    if kind.startswith(name) or name in kind:
      return peak
  return None


def nominal_peak_flops() -> float | None:
  """The data-sheet peak (bf16, dense) of all the devices together, or None where the device
  kind has no data sheet (CPU)."""
  nominal = device_peak_flops(jax.local_devices()[0])
  return None if nominal is None else nominal * jax.device_count()


def measured_peak_devices() -> int:
  """How many times one device's measured matmul peak counts in this process's peak: once on
  CPU, where simulated devices share the host's cores; once per local device elsewhere."""
  return 1 if jax.default_backend() == "cpu" else jax.local_device_count()


def matmul_peak_size(cpu_size: int) -> int:
  """The square size a matmul peak is timed at: 8192 on an accelerator, where smaller products
  leave the chip far below its peak (docs/results/2026-11-27-h100-scan-and-peak.md), and
  `cpu_size` on a CPU, where 8192³ takes minutes and a few hundred already reach the peak."""
  return cpu_size if jax.default_backend() == "cpu" else 8192


def measure_matmul_peak(size: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
  """FLOP/s of a square matmul on the default device, operands in `dtype`: from the median of
  `repeats` timed runs, in the fastest form the backend has for that dtype.

  The median, not the best: with the best, one run timed short (a clock or scheduler hiccup)
  would be the peak, and every MFU against it. Load only slows runs, so a probe under load
  reads low, never high.

  For a 16-bit dtype both outputs are timed, the 16-bit one and the float32 accumulator
  (`preferred_element_type`), and the faster counts: TPUs and GPUs write bf16 at full speed,
  XLA's CPU backend only float32 (its bf16-output matmul is a third as fast), and a peak
  measured the slow way would flatter every MFU against it.

  One probe of the CPU's peak (`cpu_matmul_peak`, no data sheet applies) and `bertjax bench`'s
  in-process reference for MFU.
  """
  dtype = jnp.dtype(dtype)
  a = jnp.ones((size, size), dtype)
  b = jnp.ones((size, size), dtype)
  outputs = [dtype] if dtype.itemsize >= 4 else [dtype, jnp.dtype(jnp.float32)]
  fastest = float("inf")
  for out in outputs:
    matmul = jax.jit(lambda x, y, out=out: jnp.matmul(x, y, preferred_element_type=out))
    matmul(a, b).block_until_ready()
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      matmul(a, b).block_until_ready()
      seconds.append(time.perf_counter() - start)
    fastest = min(fastest, statistics.median(seconds))
  return 2 * size ** 3 / fastest


# The CPU probe: a square matmul of this size, `measure_matmul_peak`'s median of this many runs.
CPU_PROBE_SIZE = 1024
CPU_PROBE_REPEATS = 5
# How far one probe may move a cached CPU peak on its own: beyond it, the median of more probes
# decides. Unloaded readings of one machine lie within a few percent of each other
# (docs/results/2026-11-28-auto-dtype-cpu.md); a jump past this is a timing fault or a first
# entry measured under load, and only more probes tell which.
PLAUSIBLE_FACTOR = 1.5
# A run's measured peak is raised to the median rate of its last log intervals once that many
# of them are at hand and their median beats it: one interval timed short never moves it.
RAISE_WINDOW = 5
RAISE_AFTER = 3


class Peak:
  """The peak FLOP/s that MFU is measured against, for all the devices of a run together.

  Accelerators: the data sheet's. CPU: no data sheet applies; the machine's matmul probe
  (`cpu_matmul_peak`), identified by `cache_key`. Where the run's log intervals keep beating a
  measured peak (the median of the last `RAISE_WINDOW`, once `RAISE_AFTER` are at hand), the
  run's peak is raised to that median, so MFU is never above 100%; an interval above the peak
  on its own is clipped to 100%. Steps never write the machine's cache: a step's rate is not
  the matmul probe its entries hold, and one mis-timed interval once raised an entry 2.6x.
  `keep_in` records the peak in the run's workdir, rewritten whenever it is raised, so a resume
  continues against it (bertjax.training.run_start.run_peak)."""

  def __init__(self, flops: float, dtype: str, source: str, cache_key: str | None = None,
               recorded: bool = False) -> None:
    self.flops = flops
    self.dtype = dtype
    self.source = source
    self.cache_key = cache_key  # set for a measured peak: the machine and probe it is of
    self.recorded = recorded  # read from the run's record (a resume), not measured now
    self.record: Any = None  # the run's record of it (`keep_in`), a path
    self._recent: deque[float] = deque(maxlen=RAISE_WINDOW)
    self._clip_noted = False

  def describe(self) -> str:
    kept = "the run's recorded peak: " if self.recorded else ""
    return f"peak {self.flops:.3g} FLOP/s for {self.dtype} ({kept}{self.source})"

  def mfu(self, achieved: float) -> float:
    """`achieved` FLOP/s (one log interval's) as a fraction of the peak, at most 1."""
    if self.cache_key is not None:
      self._recent.append(achieved)
      typical = statistics.median(self._recent)
      if len(self._recent) >= RAISE_AFTER and typical > self.flops:
        log.warning("the last %d log intervals ran at a median %.3g FLOP/s, above the %s; "
                    "raising the run's peak to it", len(self._recent), typical,
                    self.describe())
        self.flops = typical
        self._write_record()
    if achieved <= self.flops:
      return achieved / self.flops
    if not self._clip_noted:  # once: every later interval would say the same
      self._clip_noted = True
      log.warning("a log interval ran at %.3g FLOP/s, above the %s; MFU clipped to 100%%",
                  achieved, self.describe())
    return 1.0

  def as_record(self) -> dict[str, Any]:
    return {"flops": self.flops, "dtype": self.dtype, "source": self.source,
            "cache_key": self.cache_key}

  def keep_in(self, record: Any) -> None:
    """Records the peak in `record` (a path in the run's workdir), now and whenever raised."""
    self.record = record
    self._write_record()

  def _write_record(self) -> None:
    if self.record is None:
      return
    try:  # best effort: without it a resume measures its peak again
      self.record.write_text(json.dumps(self.as_record(), indent=2) + "\n")
    except OSError as e:
      log.warning("could not record the run's peak in %s: %s", self.record, e)


def recorded_peak(record: dict[str, Any], dtype: str) -> Peak | None:
  """The measured peak a run recorded (`Peak.as_record`), where it still applies: the model's
  dtype and this machine's probe (`cpu_peak_key`) are the ones it was measured for. None where
  not: a resume on another machine, or after a change of dtype, measures its own."""
  if (nominal_peak_flops() is not None or record.get("dtype") != dtype
      or record.get("cache_key") != cpu_peak_key(dtype, CPU_PROBE_SIZE)):
    return None
  return Peak(float(record["flops"]), dtype, str(record["source"]), record["cache_key"],
              recorded=True)


def cpu_peak_cache() -> Path:
  """Measured CPU peaks by machine, kept from run to run (under $BERTJAX_CACHE)."""
  return paths.cache_root() / "cpu_matmul_peaks.json"


def _cpu_model() -> str:
  # The model name is what identifies the hardware; platform.processor() is empty on Linux.
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cpu_peak_key(dtype: str, size: int = CPU_PROBE_SIZE) -> str:
  """What a measured CPU peak depends on: the CPU, its cores, XLA (jax's version) and the
  matmul's dtype and size, timed as `measure_matmul_peak` times it (entries of the best single
  run, before the median, are not read)."""
  return (f"{_cpu_model()} | {os.cpu_count()} cores | jax {jax.__version__} | "
          f"{dtype} {size}x{size} fastest output, median of {CPU_PROBE_REPEATS}")


def _load_cached_peaks() -> dict[str, float]:
  try:
    peaks = json.loads(cpu_peak_cache().read_text())
  except (OSError, ValueError):
    return {}
  return peaks if isinstance(peaks, dict) else {}


def _store_cached_peak(key: str, value: float) -> None:
  """Best effort: a cache that cannot be written only means measuring again next time."""
  try:
    cache = cpu_peak_cache()
    cache.parent.mkdir(parents=True, exist_ok=True)
    peaks = _load_cached_peaks()
    peaks[key] = max(value, peaks.get(key, 0.0))
    # Written whole and renamed: processes that start together never read half a file.
    temp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(peaks, indent=2, sort_keys=True) + "\n")
    os.replace(temp, cache)
  except OSError as e:
    log.warning("could not cache the measured peak in %s: %s", cpu_peak_cache(), e)


def cpu_matmul_peak(dtype: str, size: int = CPU_PROBE_SIZE,
                    probes: int = 3) -> tuple[float, str, str]:
  """(peak FLOP/s, its source, cache key) of this machine's CPU for `dtype` matmuls.

  Without a cached entry: the best of `probes` probes, then cached. With one: one more probe
  per run, so a first entry measured under load does not stay the peak; the higher of the two
  counts, and is cached. A probe more than `PLAUSIBLE_FACTOR` above the entry is not taken on
  its own: the median of it and `probes - 1` more decides. A probe under the entry never lowers
  it (load only slows a probe); far under it, the run says so."""
  key = cpu_peak_key(dtype, size)

  def measure() -> float:
    return measure_matmul_peak(size, jnp.dtype(dtype), CPU_PROBE_REPEATS)

  cached = _load_cached_peaks().get(key)
  if not isinstance(cached, (int, float)) or cached <= 0:
    readings = [measure() for _ in range(probes)]
    log.info("CPU %s matmul peak probes: %s FLOP/s", dtype,
             ", ".join(f"{r:.3g}" for r in readings))
    _store_cached_peak(key, max(readings))
    return max(readings), f"best of {probes} {size}² matmul probes, now cached", key
  reading = measure()
  if reading > cached * PLAUSIBLE_FACTOR:
    readings = [reading, *(measure() for _ in range(probes - 1))]
    reading = statistics.median(readings)
    log.info("a CPU %s matmul probe read %.2fx the cached peak %.3g; the median of %s FLOP/s "
             "counts", dtype, readings[0] / cached, cached,
             ", ".join(f"{r:.3g}" for r in readings))
  if reading > cached:
    _store_cached_peak(key, reading)
  elif reading * PLAUSIBLE_FACTOR < cached:
    log.info("this run's CPU %s matmul probe read %.3g FLOP/s, %.2fx under the cached peak "
             "%.3g: a machine under load, or an entry to delete (%s)", dtype, reading,
             cached / reading, cached, cpu_peak_cache())
  return (max(cached, reading), f"best measured {size}² matmul, cached in {cpu_peak_cache()}",
          key)


def run_peak(dtype: str) -> Peak:
  """The peak of all the devices a run trains on, for matmuls in `dtype` (the model's compute
  dtype)."""
  nominal = nominal_peak_flops()
  if nominal is not None:
    note = "" if dtype == "bfloat16" else f"; the model computes in {dtype}"
    return Peak(nominal, "bfloat16", f"{jax.device_count()} x "
                f"{jax.local_devices()[0].device_kind}, data sheet, dense{note}")
  # Simulated CPU devices share one host's cores: the host's peak is the run's
  # (measured_peak_devices is 1).
  flops, source, key = cpu_matmul_peak(dtype)
  return Peak(flops, dtype, source, key)
