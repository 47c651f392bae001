"""The suite's times, as tests/suite_timing.py recorded them: tables for a results page, and
tests/durations.json, the file order that balances the workers.

  BERTJAX_TEST_TIMES=/tmp/times XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python -m pytest -q
  python tests/durations_table.py /tmp/times            # the tables (markdown)
  python tests/durations_table.py /tmp/times --write    # and refresh tests/durations.json

A test's wall time is split into the compiles inside the test process (JAX's trace, lowering
and backend compile events), the CPU seconds of the processes it started and waited for, and
the rest (steps, I/O, waiting); child CPU can exceed the wall when processes ran at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import suite_timing


def read(directory: Path) -> list[dict]:
  records = []
  for path in sorted(directory.glob("*.jsonl")):
    for line in path.read_text().splitlines():
      if line.strip():
        records.append(json.loads(line))
  if not records:
    raise SystemExit(f"error: no timings under {directory} (run pytest with "
                     "BERTJAX_TEST_TIMES set)")
  return records


def wall(record: dict) -> float:
  return sum(record.get(phase, 0.0) for phase in ("setup", "call", "teardown"))


def tables(records: list[dict], slowest: int = 50) -> list[str]:
  out = []
  total = sum(wall(r) for r in records)
  compile_s = sum(r["compile_s"] for r in records)
  children = sum(r["children_cpu_s"] for r in records)
  out += [f"{len(records)} tests, {total:,.1f} s of test time in all: {compile_s:,.1f} s "
          f"compiling in the test processes ({sum(r['compiles'] for r in records):,} backend "
          f"compiles), {children:,.1f} s CPU in the processes tests started.", ""]
  out += ["| worker | tests | busy s | first start → last end s |", "|---|---|---|---|"]
  by_worker = defaultdict(list)
  for r in records:
    by_worker[r["worker"]].append(r)
  origin = min(r["start"] for r in records)
  for worker, rs in sorted(by_worker.items()):
    end = max(r["start"] + wall(r) for r in rs) - origin
    out.append(f"| {worker} | {len(rs)} | {sum(wall(r) for r in rs):,.1f} | "
               f"{min(r['start'] for r in rs) - origin:,.1f} → {end:,.1f} |")
  out += ["", f"The {slowest} slowest tests:", "",
          "| test | wall s | compile s (count) | child CPU s | rest s |", "|---|---|---|---|---|"]
  for r in sorted(records, key=wall, reverse=True)[:slowest]:
    rest = max(0.0, wall(r) - r["compile_s"] - r["children_cpu_s"])
    out.append(f"| `{r['test']}` | {wall(r):.1f} | {r['compile_s']:.1f} ({r['compiles']}) | "
               f"{r['children_cpu_s']:.1f} | {rest:.1f} |")
  out += repeats(records)
  files = file_totals(records)
  out += ["", "The files by time:", "", "| file | tests | wall s | compile s | child CPU s |",
          "|---|---|---|---|---|"]
  counts = defaultdict(int)
  compiles, child = defaultdict(float), defaultdict(float)
  for r in records:
    f = r["test"].split("::")[0]
    counts[f] += 1
    compiles[f] += r["compile_s"]
    child[f] += r["children_cpu_s"]
  for f, seconds in sorted(files.items(), key=lambda kv: -kv[1]):
    out.append(f"| {f} | {counts[f]} | {seconds:.1f} | {compiles[f]:.1f} | {child[f]:.1f} |")
  return out


def repeats(records: list[dict]) -> list[str]:
  """What a cache of compiled programs could save: the seconds of compiles whose program had
  been compiled before (in the same worker, or anywhere in the run), by device count. Empty
  unless the run recorded its programs (BERTJAX_TEST_COMPILE_KEYS=1)."""
  if not any("programs" in r for r in records):
    return []
  rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0])
  seen_worker: dict[str, set] = defaultdict(set)
  seen_run: set = set()
  for r in sorted(records, key=lambda r: r["start"]):
    for key, devices, seconds in r.get("programs", ()):
      row = rows["1 device" if devices == 1 else "several devices"]
      row[0] += 1
      row[1] += seconds
      if key in seen_worker[r["worker"]]:
        row[2] += 1
        row[3] += seconds
      if key in seen_run:
        row[4] += seconds
      seen_worker[r["worker"]].add(key)
      seen_run.add(key)
  out = ["", "Compiles by program (jit's compile or get, in the test processes):", "",
         "| programs on | compiles | seconds | repeats in the worker (seconds) | "
         "repeats in the run s |", "|---|---|---|---|---|"]
  for name, (n, seconds, again, again_s, run_s) in sorted(rows.items()):
    out.append(f"| {name} | {n:,} | {seconds:,.1f} | {again:,} ({again_s:,.1f}) | {run_s:,.1f} |")
  return out


def file_totals(records: list[dict]) -> dict[str, float]:
  return {f: round(seconds, 1) for f, seconds in
          suite_timing.file_seconds({r["test"]: wall(r) for r in records}).items()}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("directory", type=Path, help="BERTJAX_TEST_TIMES of the run")
  parser.add_argument("--write", action="store_true",
                      help=f"write the files' seconds to {suite_timing.DURATIONS}")
  parser.add_argument("--slowest", type=int, default=50)
  args = parser.parse_args(argv)
  records = read(args.directory)
  print("\n".join(tables(records, args.slowest)))
  if args.write:
    suite_timing.DURATIONS.write_text(json.dumps(
        {"about": "each test's seconds (setup, call, teardown) in one full run, from "
                  "tests/durations_table.py --write: tests/suite_timing.py runs the files "
                  "longest first, tests/fast_tier.py leaves the long tests out of the fast "
                  "tier",
         "tests": {r["test"]: round(wall(r), 2) for r in sorted(records, key=lambda r: r["test"])}},
        indent=0) + "\n")
    print(f"wrote {suite_timing.DURATIONS}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
