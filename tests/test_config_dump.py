"""Every paper config resolves to the values checked in under tests/golden/resolved_configs.json.

The dump was written from the configs before they were rewritten as variants; a refactor of
configs/ or bertjax/config.py that changes any resolved value (a learning rate, a layer count,
a step count, a derived model setting) fails here with the key that moved. Regenerate only for
an intended change: `python tests/test_config_dump.py --write`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from bertjax.config import CONFIGS_DIR, load_config, model_config

GOLDEN = Path(__file__).parent / "golden" / "resolved_configs.json"
# The config names users and docs pass to --config (each must keep resolving).
NAMES = sorted(p.stem for p in CONFIGS_DIR.glob("*.py") if not p.stem.startswith("_"))


def resolved(name: str) -> dict:
  """The config as a run sees it: every key after loading and validation, plus the model
  config derived from it."""
  config = load_config(name)
  return {"config": json.loads(config.to_json_best_effort()),
          "model": dataclasses.asdict(model_config(config))}


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())))
def test_resolved_config_unchanged(name):
  want = _flat(json.loads(GOLDEN.read_text())[name])
  have = _flat(resolved(name))
  moved = {k: (want.get(k, "<absent>"), have.get(k, "<absent>"))
           for k in sorted(set(want) | set(have)) if want.get(k, "<absent>") != have.get(k, "<absent>")}
  assert not moved, f"{name}: resolved values changed (golden, now): {moved}"


def test_every_config_has_a_golden_entry():
  assert set(NAMES) <= set(json.loads(GOLDEN.read_text())), (
      "a config without a golden entry: add it with `python tests/test_config_dump.py --write`")


if __name__ == "__main__" and "--write" in sys.argv:
  GOLDEN.parent.mkdir(exist_ok=True)
  GOLDEN.write_text(json.dumps({n: resolved(n) for n in NAMES}, indent=1, sort_keys=True) + "\n")
  print(f"wrote {GOLDEN} ({len(NAMES)} configs)")
