"""`bertjax bench --table gpu`: the GPU benchmark table — BERT-large at 512 tokens, GPT-2 medium
and XL at 1024 and T5-base at 512/114, bf16 train steps (our `Trainer` step against
`transformers` in its fastest setting on the same GPU: bf16 autocast, SDPA attention, fused
AdamW, `torch.compile`),
each row one `bench.run_benchmark` with the two alternating in one process. Guide:
docs/performance.md, "The GPU table".

`reduced=True` shrinks every row to a few narrow layers and short sequences, the same code path
at CPU size: the suite runs it so that the table cannot rot.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from bertjax import config as config_lib
from bertjax.tools import bench
from bertjax.training import flops as flops_lib


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  config: str
  overrides: tuple[tuple[str, str], ...]


# Attention dropout 0 everywhere: the fused kernels (cuDNN here, flash SDPA in torch) are what a
# GPU run uses, and ours have none; one micro-batch, no remat: each row fits one H100. Layers
# unrolled: on a GPU the scanned stack is slower and larger (the configs scan for TPU pods'
# compile times; docs/results/2026-11-27-h100-scan-and-peak.md).
_FAST = (("model.dtype", "bfloat16"), ("model.attention", "auto"),
         ("model.attention_dropout", "0.0"), ("grad_accum_steps", "1"),
         ("model.remat_policy", "none"), ("model.scan_layers", "false"))
TABLES: dict[str, tuple[Row, ...]] = {
    "gpu": (
        Row("BERT-large s512", "bert_large",
            (("batch_size", "16"), ("seq_length", "512"), ("max_predictions", "76")) + _FAST),
        Row("GPT-2 medium s1024", "gpt2:size=medium",
            (("batch_size", "8"), ("seq_length", "1024")) + _FAST),
        # T5 1.0 base as pre-trained (span corruption, 512 input and 114 target tokens), with
        # AdamW on both sides (the config's Adafactor has no fused torch counterpart); its
        # relative position biases keep attention in XLA einsums (no fused kernel takes them),
        # so its attention dropout stays (transformers' T5 has one dropout rate for all).
        Row("T5-base s512/114", "t5:size=base",
            (("batch_size", "32"), ("seq_length", "512"), ("optimizer.name", "adamw"))
            + _FAST + (("model.attention_dropout", "0.1"),)),
        # One sequence: its float32 weights and AdamW moments (25 GB), ours and the
        # reference's, and both steps' activations share one 80 GB GPU.
        Row("GPT-2 XL s1024", "gpt2:size=xl",
            (("batch_size", "1"), ("seq_length", "1024")) + _FAST),
    ),
}
# The CPU-sized form of every row (the suite's): same configs and code, a toy shape.
REDUCED = (("model.num_layers", "2"), ("model.hidden_size", "64"), ("model.num_heads", "2"),
           ("model.mlp_dim", "128"), ("model.vocab_size", "512"), ("batch_size", "8"),
           ("seq_length", "64"), ("model.dtype", "bfloat16"))


def config_overrides(row: Row, reduced: bool = False) -> dict[str, str]:
  overrides = dict(row.overrides)
  if reduced:
    overrides.update(REDUCED)
    if "max_predictions" in overrides:
      overrides["max_predictions"] = "8"
  return overrides


def row_config(row: Row, reduced: bool = False):
  return config_lib.load_config(row.config, list(config_overrides(row, reduced).items()))


# Our step and the reference share the GPU in each row's process: JAX allocates on demand, up
# to this fraction of the memory, leaving the rest to PyTorch's allocator.
CHILD_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.55"}


def row_record(table: str, name: str, reduced: bool, steps: int, pairs: int,
               torch_compile: bool) -> dict[str, Any]:
  """One row's bench.run_benchmark record, in this process."""
  row = next(r for r in TABLES[table] if r.name == name)
  return bench.run_benchmark(row_config(row, reduced), steps=steps, pairs=pairs, compare="hf",
                             peak_size=flops_lib.matmul_peak_size(512),
                             reference_compile=torch_compile,
                             log=lambda line: print(line, file=sys.stderr, flush=True))


def _in_child(*args: Any) -> dict[str, Any]:
  """`row_record` in a fresh process: the previous row's memory (JAX's arena, PyTorch's cache)
  is returned to the device, as on the GPU it otherwise is not."""
  for key, value in CHILD_ENV.items():
    os.environ.setdefault(key, value)
  with concurrent.futures.ProcessPoolExecutor(
      max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(row_record, *args).result()


def run_table(name: str = "gpu", *, reduced: bool = False, steps: int = 5, pairs: int = 3,
              torch_compile: bool = True, rows: tuple[str, ...] = (), json_path: str = "",
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
  """One record per row (bench.run_benchmark's, with the row's name), each row in its own
  process; a row that fails to run (out of memory, a compile error) is recorded with its
  error and the table goes on. `json_path`: the records so far are written there after each
  row (a table cut short by a machine's time limit keeps its finished rows)."""
  if name not in TABLES:
    raise ValueError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
  unknown = set(rows) - {r.name for r in TABLES[name]}
  if unknown:
    raise ValueError(f"unknown rows {sorted(unknown)}; the {name} table has "
                     f"{', '.join(r.name for r in TABLES[name])}")
  records = []
  for row in TABLES[name]:
    if rows and row.name not in rows:
      continue
    log(f"--- {row.name}")
    try:
      record = _in_child(name, row.name, reduced, steps, pairs, torch_compile)
    except Exception as e:  # noqa: BLE001 - one row's failure is that row's result
      record = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      log(f"{row.name}: {record['error']}")
    record["row"] = row.name
    record["overrides"] = config_overrides(row, reduced)
    records.append(record)
    if json_path:
      write_records(records, json_path)
  return records


def _ms(x: float) -> str:
  return f"{x * 1e3:,.1f}"


def format_table(records: list[dict[str, Any]]) -> str:
  """Markdown: one line per row, ours against the reference, MFU against the data sheet's bf16
  peak and against the bf16 matmul peak measured in the same process."""
  lines = [("| row | ours ms/step | ours tokens/s | MFU (data sheet) | MFU (measured peak) | "
            "transformers ms/step | its MFU (torch peak) | ours/transformers throughput |"),
           "|---|---|---|---|---|---|---|---|"]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['row']} | failed: {r['error']} |||||||")
      continue
    o, h = r["ours"], r.get("hf", {})
    nominal = o.get("mfu_vs_nominal_peak")
    lines.append(
        f"| {r['row']} | {_ms(o['step_seconds_median'])} | {o['tokens_per_second']:,.0f} | "
        f"{'n/a' if nominal is None else f'{nominal:.1%}'} | "
        f"{o['mfu_vs_xla_matmul_peak']:.1%} | {_ms(h['step_seconds_median'])} | "
        f"{h['mfu_vs_torch_matmul_peak']:.1%} | {r['median_ratio']:.2f}x |")
  if records and "machine" in records[0]:
    m = records[0]["machine"]
    lines.append("")
    lines.append(f"machine: {m['devices']} x {m['device_kind']}, jax {m['jax']}; reference: "
                 + "; ".join(sorted({r['hf']['model'].split(' (')[1].rstrip(')')
                                     for r in records if 'hf' in r})))
  return "\n".join(lines)


def write_records(records: list[dict[str, Any]], path: str) -> None:
  with open(path, "w") as f:
    json.dump(records, f, indent=1, default=float)
