"""What `bertjax reproduce` prints: every paper config's contract (targets and sources), and
for one config also its launch command, the slice and expected time of its compile report and
what was verified here (parameter count, compile fit, the golden curve guarding its family).

The guide: docs/reproducing.md.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator

from bertjax import config as config_lib
from bertjax.config.loader import CONFIGS_DIR, file_contracts, variant_key
from bertjax.reproduction import golden
from bertjax.reproduction.contract import Contract
from bertjax.tools.param_report import matches_reference, param_breakdown

# The compile reports a source checkout holds (docs/compile_reports, tests/test_compile_reports.py).
REPORTS_DIR = CONFIGS_DIR.parent / "docs" / "compile_reports"


def paper_configs() -> list[str]:
  """Every config a user can name that reproduces a paper: each file's variants, less the
  tiny CPU configs (a name with "tiny") and the fine-tuning ones."""
  names = []
  for path in config_lib.config_files():
    for variant in config_lib.file_variants(str(path)):
      name = f"{path.stem}:{variant}" if variant else path.stem
      if "tiny" in name or config_lib.load_config_file(str(path) + (f":{variant}" if variant
                                                                     else "")).finetune.task:
        continue
      names.append(name)
  return names


def contract_of(name: str) -> Contract | None:
  path, _, variant = name.partition(":")
  return file_contracts(path).get(variant_key(variant))


def _tokens(tokens: float) -> str:
  for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if tokens >= size:
      return f"{tokens / size:.3g}{unit}"
  return f"{tokens:.0f}"


def _contract_lines(contract: Contract, points: bool) -> Iterator[str]:
  if contract.missing:
    yield f"  target  none verified: {contract.missing}"
  for target in contract.targets:
    note = f" ({target.note})" if target.note else ""
    yield f"  target  {target.metric} = {target.value:g}{note}  [{target.source}]"
  if not contract.points:
    return
  if not points:
    sources = sorted({p.source for p in contract.points})
    yield (f"  curve   {len(contract.points)} reference points of "
           f"{', '.join(contract.metrics)}  [{'; '.join(sources)}]")
    return
  if contract.conditions:
    yield f"  measured on: {contract.conditions}"
  for metric in contract.metrics:
    for p in contract.curve(metric):
      step = f" (step {p.step})" if p.step else ""
      yield (f"  point   {metric} {p.value:.4g} in [{p.low:.4g}, {p.high:.4g}] at "
             f"{_tokens(p.tokens)} tokens{step}  [{p.source}]")


def listing() -> list[str]:
  """Every paper config with its targets and sources, then the golden curves."""
  lines = []
  for name in paper_configs():
    contract = contract_of(name)
    if contract is None:
      lines += [f"{name}: NO CONTRACT (add one to configs/{name.partition(':')[0]}.py)", ""]
      continue
    lines += [f"{name}: {contract.paper}", *_contract_lines(contract, points=False), ""]
  lines.append("golden curves (each family's runlocal run; tests/test_golden_curves.py):")
  for run in golden.GOLDEN_RUNS:
    contract = contract_of(run.config)
    if contract is None:
      lines.append(f"  {run.family:11s} {run.config}: not recorded "
                   f"(bertjax reproduce --record {run.config} --workdir DIR)")
      continue
    rec = contract.recorded
    lines.append(f"  {run.family:11s} {run.config}: {len(contract.points)} points of "
                 f"{', '.join(contract.metrics)}; seeds {rec.get('seeds')}, recorded "
                 f"{rec.get('date')} on {rec.get('machine')}")
  return lines


def _launch_commands(name: str) -> list[str]:
  """The commands the config file's docstring gives (its launch recipe)."""
  path = CONFIGS_DIR / f"{name.partition(':')[0]}.py"
  doc = re.match(r'\s*"""(.*?)"""', path.read_text(), re.S)
  lines, continued = [], False
  for line in (doc.group(1) if doc else "").splitlines():
    text = line.strip()
    if continued or text.startswith(("bertjax ", "python launch/", "python3 launch/")):
      lines.append(text)
      continued = text.endswith("\\")
  return lines


@functools.cache
def _reports() -> tuple[dict, ...]:
  """Every compile report, read once (the contract table asks for each config's)."""
  return tuple(json.loads(path.read_text()) for path in sorted(REPORTS_DIR.glob("*.json")))


def _by_slice(name: str) -> dict[str, list[dict]]:
  """The compile reports of `name` as written (no overrides), by slice, phases in order."""
  by_slice: dict[str, list[dict]] = {}
  for data in _reports():
    if data["config"] == name and not data["overrides"]:
      by_slice.setdefault(data["topology"], []).append(data)
  return by_slice


def _compile_lines(name: str) -> list[str]:
  """Each slice a compile report of `name` (as written) covers: memory, fit, expected time."""
  lines = []
  for topology, reports in _by_slice(name).items():
    fits = all(r["report"]["fits"] for r in reports)
    gib = " / ".join(f"{r['report']['total_bytes'] / 2**30:.1f}" for r in reports)
    hbm = reports[0]["report"]["hbm_bytes"] / 2**30
    seconds = sum(r["train_steps"] * r["report"]["projected_step_seconds"] for r in reports)
    hours = seconds / 3600
    when = f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"
    lines.append(f"  {topology}: {gib} GiB per chip of {hbm:.1f} "
                 f"({'fits' if fits else 'DOES NOT FIT'}); expected {when} at 50% MFU "
                 f"(compiled {reports[0]['date']}, jax {reports[0]['jax']}; "
                 f"docs/compile_reports)")
  return lines


def guard_of(name: str) -> golden.GoldenRun | None:
  """The golden run guarding `name`'s learning (its file's, or its family's)."""
  return golden.guard_of(name.partition(":")[0])


def details(name: str) -> list[str]:
  """One config's contract and what stands behind it here."""
  config = config_lib.load_config(name)
  contract = contract_of(name)
  lines = [f"{name}: {contract.paper if contract else 'no contract'}"]
  if contract:
    lines += list(_contract_lines(contract, points=True))
  launch = _launch_commands(name)
  if launch:
    lines += ["launch (the config file's docstring):", *(f"  {c}" for c in launch)]
  compiled = _compile_lines(name)
  lines += ["compiled for:", *(compiled or ["  no compile report (bertjax compile --config "
                                            f"{name} --topology SLICE)"])]
  lines.append("verified here:")
  reference = int(config.get("reference_params", 0) or 0)
  if reference:
    counts = param_breakdown(config_lib.model_config(config))
    counted = counts.get("discriminator", counts["total"])
    same = (matches_reference(counted, reference)
            or abs(counted - reference) / reference < 0.02)
    lines.append(f"  parameters {counted:,} against the paper's {reference:,}: "
                 f"{'matches' if same else 'DOES NOT match'} (tests/test_config_cli.py)")
  if compiled:
    lines.append("  compiles for the slices above with the TPU compiler "
                 "(tests/test_compile_reports.py holds the reports to the config)")
  run = guard_of(name)
  if run is not None:
    guard = contract_of(run.config)
    state = (f"recorded {guard.recorded.get('date')} with seeds {guard.recorded.get('seeds')}"
             if guard else "not recorded")
    lines.append(f"  learning: the golden curve of {run.config} ({run.family}), {state}; "
                 "tests/test_golden_curves.py trains it and fails off its band")
  return lines


# docs/reproducing.md's contract table, between these lines (tests/test_reproduce.py checks
# that the page holds the table the contracts make).
TABLE_BEGIN = ("<!-- contract table, generated from the configs' CONTRACTS by "
               "bertjax.tools.reproduce_report -->")
TABLE_END = "<!-- end of contract table -->"


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def _said_once(source: str) -> str:
  """'the same row' for a source that repeats the previous target's (bertjax.reproduction
  .contract resolves it to the full source)."""
  return source[source.rindex("[the same ") + 1:-1] if "[the same " in source else source


def markdown_table() -> str:
  """The table of docs/reproducing.md: config, paper, targets with their sources, and what is
  verified here."""
  lines = [TABLE_BEGIN, "",
           "| config | paper | targets (source) | verified here |", "|---|---|---|---|"]
  for name in paper_configs():
    contract = contract_of(name)
    config = config_lib.load_config(name)
    if contract is None:
      lines.append(f"| `{name}` | - | no contract | - |")
      continue
    targets = [f"{t.metric} **{t.value:g}** ({_said_once(t.source)})" for t in contract.targets]
    if contract.points:
      origin = contract.points[0].source.split(" (")[0].split(":")[0]
      targets.append(f"{len(contract.points)} reference points of "
                     f"{', '.join(contract.metrics)} ({origin})")
    if contract.missing:
      targets.append(f"none verified: {contract.missing}")
    verified = []
    if int(config.get("reference_params", 0) or 0):
      verified.append("parameter count")
    slices = list(_by_slice(name))
    if slices:
      verified.append(f"compiled for {', '.join(slices)}")
    run = guard_of(name)
    if run is not None:
      verified.append(f"learning: golden `{run.config}`")
    lines.append(f"| `{name}` | {contract.paper} | {_cell('<br>'.join(targets))} | "
                 f"{'; '.join(verified)} |")
  lines += ["", TABLE_END]
  return "\n".join(lines)
