"""`bertjax compile --fit`: the fastest projected setting of a config that fits a TPU slice.

Searched: the attention implementation, the remat policy and the number of micro-batches; for
each (attention, remat) pair the search compiles from the fewest micro-batches up and stops at
the first that fits, and the fitting setting with the shortest projected step wins. Every
compile runs in a child process, so that a compiler crash is reported as such and skipped.

The guide: docs/reproducing.md, '`bertjax compile --fit`'.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable

import ml_collections

from bertjax import config as config_lib
from bertjax.tools import aot


@dataclasses.dataclass
class Trial:
  """One compiled setting: its overrides and what the compiler said."""
  overrides: dict[str, str]
  outcome: str                  # "fits", "does not fit", "compiler crash", "error"
  total_gib: float | None = None
  step_ms: float | None = None
  detail: str = ""
  # Accepted by the compiler above the HBM the table lists: kept as a last resort.
  no_headroom: bool = False

  def line(self) -> str:
    settings = " ".join(f"--config.{k}={v}" for k, v in self.overrides.items())
    numbers = [f"{self.total_gib:.2f} GiB" if self.total_gib is not None else "",
               f"step {self.step_ms:.1f} ms" if self.step_ms is not None else ""]
    numbers = ", ".join(n for n in numbers if n)
    return f"  {self.outcome:15s} {settings}" + (f"  ({numbers})" if numbers else "") + (
        f"  {self.detail}" if self.detail else "")


def search_space(config: ml_collections.ConfigDict, without_attention_dropout: bool = False
                 ) -> list[list[dict[str, str]]]:
  """Settings to try: one list per (attention, remat) pair, micro-batches ascending (while
  they divide the batch; the compile refuses micro-batches the mesh cannot split).
  `without_attention_dropout`: the fused kernel's ladders with model.attention_dropout=0, a
  change of the recipe offered only when nothing fits as written."""
  model = config.model
  no_dropout = float(model.attention_dropout) == 0
  if without_attention_dropout:
    if no_dropout:
      return []
    attentions, extra = ["auto"], {"model.attention_dropout": "0.0"}
  else:
    attentions, extra = (["auto", "xla"] if no_dropout else ["xla"]), {}
  remats = ["none", "dots"] + (["full"] if model.dtype == "float32" else [])
  accum, accums = int(config.grad_accum_steps), []
  while accum <= int(config.batch_size) and int(config.batch_size) % accum == 0:
    accums.append(accum)
    accum *= 2
  return [[{**extra, "model.attention": a, "model.remat_policy": r, "grad_accum_steps": str(k)}
           for k in accums] for a, r in itertools.product(attentions, remats)]


def search(config_name: str, overrides: list[tuple[str, str]], topology: str, mfu: float,
           slices: int, report: Callable[[Trial], None] = lambda t: None
           ) -> tuple[Trial | None, list[Trial]]:
  """(best fitting trial or None, every trial), compiling each setting in a child process."""
  config = config_lib.load_config(config_name, overrides)
  trials = []
  for without_dropout in (False, True):
    if any(t.outcome == "fits" for t in trials):
      break  # the recipe as written fits: no reason to change it
    for ladder in search_space(config, without_dropout):
      for setting in ladder:
        trial = _run_one(config_name, overrides, setting, topology, mfu, slices)
        trials.append(trial)
        report(trial)
        # More micro-batches only make the step slower, and a batch the mesh cannot split
        # into k micro-batches it cannot split into 2k either.
        if trial.outcome in ("fits", "error"):
          break
  fitting = [t for t in trials if t.outcome == "fits"]
  best = min(fitting, key=lambda t: (t.no_headroom, t.step_ms)) if fitting else None
  return best, trials


def _run_one(config_name: str, overrides: list[tuple[str, str]], setting: dict[str, str],
             topology: str, mfu: float, slices: int) -> Trial:
  config = config_lib.load_config(config_name, list(overrides) + list(setting.items()))
  try:
    # The search reports each outcome on its own line: the child's libtpu noise is dropped.
    result = aot.compile_in_child(config, topology, mfu, slices, quiet=True)
  except concurrent.futures.process.BrokenProcessPool:
    return Trial(setting, "compiler crash", detail="libtpu crashed compiling this setting")
  except ValueError as e:
    return Trial(setting, "error", detail=str(e).splitlines()[0][:200])
  outcome = "fits" if result.fits else "does not fit"
  tight = result.fits and result.total_bytes > result.hbm_bytes
  return Trial(setting, outcome, result.total_bytes / 2 ** 30,
               result.projected_step_seconds * 1e3 if result.fits else None,
               "accepted by the compiler with no headroom (over the table's HBM)" if tight
               else "", tight)
