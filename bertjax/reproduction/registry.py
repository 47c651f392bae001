"""Where contracts are found: a config file's CONTRACTS (by variant), a golden curve under
configs/golden/, or a JSON file named directly.

    load_contract("gpt2:size=small")            # the file's CONTRACTS["size=small"]
    load_contract("bert_base:runlocal")         # configs/golden/bert_base_runlocal.json
    load_contract("runs/my_contract.json")      # any contract file (tests, a user's own)
"""

from __future__ import annotations

from pathlib import Path

from bertjax.config import loader
from bertjax.reproduction.contract import Contract, read

# The golden curves of the runlocal runs, beside the config files that declare them.
GOLDEN_DIR = "golden"


def golden_name(config_name: str) -> str:
  """The file stem of a config's golden curve: 'deberta_v3:size=xsmall,runlocal' ->
  'deberta_v3_size_xsmall_runlocal'."""
  return "".join(c if c.isalnum() else "_" for c in config_name).strip("_")


def golden_path(config_file: str, config_name: str) -> Path:
  """configs/golden/NAME.json beside `config_file` (a config module's __file__)."""
  return Path(config_file).resolve().parent / GOLDEN_DIR / f"{golden_name(config_name)}.json"


def golden_contracts(config_file: str, config_name: str) -> dict[str, Contract]:
  """{variant: contract} for a config file's CONTRACTS: the golden curve recorded for
  `config_name` (`bertjax reproduce --record`), or {} while none is recorded."""
  path = golden_path(config_file, config_name)
  if not path.exists():
    return {}
  variant = config_name.partition(":")[2]
  return {loader.variant_key(variant): read(path)}


def load_contract(ref: str) -> Contract:
  """The contract `ref` names (module docstring); a ValueError naming it when there is none."""
  if ref.endswith(".json"):
    return read(ref)
  name, _, variant = ref.partition(":")
  key = loader.variant_key(variant)
  contracts = loader.file_contracts(name)
  if key not in contracts:
    offered = ", ".join(f"{name}:{k}" if k else name for k in contracts) or "none"
    raise ValueError(f"{ref}: no reproduction contract for this config (its file has: "
                     f"{offered})")
  contract = contracts[key]
  if not isinstance(contract, Contract):
    raise ValueError(f"{ref}: CONTRACTS[{key!r}] is a {type(contract).__name__}, not a "
                     "bertjax.reproduction.Contract")
  return contract
