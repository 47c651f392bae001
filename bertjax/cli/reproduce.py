"""`bertjax reproduce`: every paper config's reproduction contract (targets with sources,
reference points, launch command, slice, expected time, what is verified here), and the golden
curves of the families' tiny runs (record, check)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bertjax.cli.common import EXIT_FAILED, OVERRIDES_EPILOG, Add

Overrides = list[tuple[str, str]]


def cmd_reproduce(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.tools import reproduce_report
  if args.record or args.check:
    return _golden(args, overrides)
  if overrides:
    raise ValueError("config overrides apply to --check (a broken variant of a golden run)")
  lines = (reproduce_report.details(args.config) if args.config
           else reproduce_report.listing())
  for line in lines:
    print(line)
  return 0


def _golden(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.config.loader import CONFIGS_DIR
  from bertjax.reproduction import registry
  from bertjax.tools import golden_runs
  if not args.workdir:
    raise ValueError("--record and --check train: give --workdir DIR for their runs")
  logging.getLogger("bertjax").setLevel(logging.INFO)
  root = Path(args.workdir)
  if args.record:
    if overrides:
      raise ValueError("a golden curve is recorded from the config as written; overrides "
                       "apply to --check")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    out_dir = Path(args.out) if args.out else CONFIGS_DIR / registry.GOLDEN_DIR
    for name in args.record:
      print(f"wrote {golden_runs.record(name, seeds, root, out_dir)}")
    return 0
  status = 0
  for name in args.check:
    checked, found = golden_runs.check(name, root, overrides)
    verdict = "inside its golden band" if not found else "OFF its golden band"
    print(f"{name}: {checked} evals checked, {verdict}")
    for deviation in found:
      print(f"  {deviation}")
    status = status or (EXIT_FAILED if found else 0)
  return status


def register(add: Add) -> None:
  p = add("reproduce", "what each paper config should reach, and the golden tiny curves",
          "Without arguments: every paper config with its targets (paper table, model card or "
          "log, as the source says) and the golden curves. With CONFIG: its contract, launch "
          "command, slice and expected time from its compile report, and what was verified "
          "here (parameter count, compile fit, its family's golden curve). --record trains a "
          "golden run with each seed and writes configs/golden/NAME.json; --check trains it "
          "with seed 0 (and any --config overrides: a broken variant) and exits 1 when an eval "
          "leaves the band (docs/reproducing.md).",
          "examples:\n  bertjax reproduce\n  bertjax reproduce gpt2:size=small\n"
          "  bertjax reproduce --record bert_base:runlocal --seeds 0,1,2 --workdir /tmp/golden\n"
          "  bertjax reproduce --check bert_base:runlocal --workdir /tmp/check "
          "--config.data.mask_prob=0.10\n\n" + OVERRIDES_EPILOG, cmd_reproduce)
  p.add_argument("config", nargs="?", default="",
                 help="a config with its variant (e.g. gpt2:size=small); none: list them all")
  p.add_argument("--record", nargs="+", metavar="GOLDEN_RUN", default=[],
                 help="record these golden runs' curves (e.g. bert_base:runlocal)")
  p.add_argument("--check", nargs="+", metavar="GOLDEN_RUN", default=[],
                 help="train these golden runs with seed 0 and check them against their curves")
  p.add_argument("--seeds", default="0,1,2", help="seeds of --record (at least 3)")
  p.add_argument("--workdir", default="", help="directory for the runs of --record/--check")
  p.add_argument("--out", default="", help="where --record writes (default configs/golden)")
