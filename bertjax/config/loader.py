"""Config files: `NAME_OR_PATH[:VARIANT]` loaded, overridden and validated.

A config file is a Python file (under configs/, or any path) with a `get_config()` returning a
ConfigDict built on bertjax.config.schema. The text after the first ':' is a comma-separated
list of `key=value` or bare `key` items (`configs/gpt3.py:size=13b`, `gpt2:size=xl,runlocal`),
as ml_collections' `config_flags` and big_vision spell it: the file's `get_config(arg)`
receives it and reads it with `parse_arg`; `runlocal` is taken out first and applied by the
loader to any config (bertjax.config.runlocal). A config file may import the modules beside it
(configs/common.py holds the papers' shared training recipes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import traceback
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ml_collections

from bertjax.config import phases
from bertjax.config.overrides import apply_override, parse_value
from bertjax.config.runlocal import RUNLOCAL, runlocal
from bertjax.config.schema import model_config
from bertjax.config.validate import validate_training

ConfigDict = ml_collections.ConfigDict

# configs/ next to the package in a source checkout; `--config bert_base` looks there.
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


# A config file's reproduction contracts, by variant (bertjax.reproduction).
CONTRACTS = "CONTRACTS"


class VariantError(ValueError):
  """A config variant (the text after ':') that the file does not offer; the loader names the
  file in front of the message."""



T = TypeVar("T")


def _variant_items(arg: str | None) -> list[tuple[str, str | None]]:
  """'size=13b,runlocal' -> [('size', '13b'), ('runlocal', None)] (blank items skipped)."""
  items = []
  for item in (arg or "").split(","):
    key, sep, value = item.strip().partition("=")
    if key.strip():
      items.append((key.strip(), value.strip() if sep else None))
    elif sep or item.strip():
      raise VariantError(f"variant item {item.strip()!r} has no key (expected key=value)")
  return items


def parse_arg(arg: str | None, **spec: Any) -> types.SimpleNamespace:
  """A config file's variant, typed (big_vision's `parse_arg`): `spec` names each key the file
  accepts with its default; `key=value` is typed like the default (`_parse_value`) and a bare
  `key` sets a bool to True. An unknown key is a VariantError naming the accepted ones.

    arg = parse_arg(arg, size="")          # in get_config(arg=None)
  """
  values = dict(spec)
  for key, text in _variant_items(arg):
    if key not in spec:
      raise VariantError(f"unknown variant key {key!r} (accepted: "
                         f"{', '.join([*spec, RUNLOCAL])})")
    if text is None:
      if not isinstance(spec[key], bool):
        raise VariantError(f"variant key {key!r} needs a value ({key}=...)")
      values[key] = True
    else:
      values[key] = parse_value(text, spec[key], f"variant {key}", VariantError)
  return types.SimpleNamespace(**values)


def choose(options: Mapping[str, T], key: str, value: str) -> T:
  """`options[value]`, or a VariantError listing the values `key` accepts (none given: the
  file needs one)."""
  if value in options:
    return options[value]
  allowed = "|".join(options)
  said = f"{key}={value!r} is not one of {allowed}" if value else f"needs a variant {key}={allowed}"
  raise VariantError(f"{said} (e.g. :{key}={next(iter(options))})")


def config_files(directory: Path = CONFIGS_DIR) -> list[Path]:
  """The config files of `directory`: its modules with a get_config() (not their helpers, such
  as configs/common.py)."""
  return sorted(p for p in directory.glob("*.py") if "def get_config(" in p.read_text())


def file_variants(name_or_path: str) -> tuple[str, ...]:
  """The variants a config file lists in its VARIANTS (a file without: ("",), only itself);
  what the tests enumerate to load every config a user can name."""
  return tuple(getattr(_load_module(_resolve_path(name_or_path).resolve()), "VARIANTS", ("",)))


def variant_key(variant: str) -> str:
  """A variant in one spelling, whatever the order of its items: sorted, `runlocal` last
  ('runlocal,size=xsmall' -> 'size=xsmall,runlocal'); how CONTRACTS keys are compared."""
  items = _variant_items(variant)
  return ",".join(sorted(key if text is None else f"{key}={text}" for key, text in items
                         if key != RUNLOCAL) + [RUNLOCAL for key, _ in items
                                                if key == RUNLOCAL][:1])


def _module_contracts(module: types.ModuleType) -> dict[str, Any]:
  return {variant_key(key): value for key, value in getattr(module, CONTRACTS, {}).items()}


def file_contracts(name_or_path: str) -> dict[str, Any]:
  """The CONTRACTS of a config file (variant -> its reproduction contract, keys in
  `variant_key`'s spelling; docs/reproducing.md): {} for a file without."""
  return _module_contracts(_load_module(_resolve_path(name_or_path).resolve()))


def _contract_ref(path: Path, module: types.ModuleType, variant: str) -> str:
  """`config.contract` for the config file `path` loaded with `variant`: its name with the
  variant when the file has a contract for it (a file under configs/ by its name, any other by
  its absolute path), else empty."""
  key = variant_key(variant)
  if key not in _module_contracts(module):
    return ""
  name = path.stem if path.parent == CONFIGS_DIR.resolve() else str(path)
  return f"{name}:{key}" if key else name


def _resolve_path(path_or_name: str) -> Path:
  path = Path(path_or_name)
  if path.exists():
    return path
  candidate = CONFIGS_DIR / (path_or_name if path_or_name.endswith(".py")
                             else f"{path_or_name}.py")
  if candidate.exists():
    return candidate
  available = [p.stem for p in config_files()] if CONFIGS_DIR.exists() else []
  raise FileNotFoundError(f"config file {path_or_name!r} not found"
                          + (f"; configs in {CONFIGS_DIR}: {', '.join(available)}"
                             if available else ""))


def _where(error: BaseException, path: Path) -> str:
  """file:line of the innermost frame of the config file in a traceback."""
  frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == path]
  return f"{path}:{frames[-1].lineno}" if frames else str(path)


@contextlib.contextmanager
def _siblings_importable(directory: Path) -> Iterator[None]:
  """A config file imports the modules beside it, as a script does (`import common`): they
  come first, before any module of the same name already imported (launch/ has a `common`
  too), and are forgotten afterwards, so that configs in another directory get their own."""
  siblings = {p.stem for p in directory.glob("*.py")}
  shadowed = {name: sys.modules.pop(name) for name in siblings if name in sys.modules}
  before = set(sys.modules)
  sys.path.insert(0, str(directory))
  try:
    yield
  finally:
    sys.path.remove(str(directory))
    for name in set(sys.modules) - before:
      if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == directory:
        del sys.modules[name]
    sys.modules.update(shadowed)


def _load_module(path: Path) -> types.ModuleType:
  spec = importlib.util.spec_from_file_location(f"bertjax_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    with _siblings_importable(path.parent):
      spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
  except Exception as e:  # noqa: BLE001 - a user's file: name where it failed, no traceback
    raise ValueError(f"{_where(e, path)}: loading the config failed: "
                     f"{type(e).__name__}: {e}") from None
  if not hasattr(module, "get_config"):
    raise ValueError(f"{path} has no get_config() function")
  return module


def load_config_file(name: str) -> ConfigDict:
  """The ConfigDict of `NAME_OR_PATH[:VARIANT]`: the file's get_config(VARIANT) (get_config()
  without one), then `runlocal` when the variant says so. A file that does not load or does not
  return a ConfigDict, or a variant it does not offer, is a one-line ValueError naming the
  file."""
  path_or_name, _, variant = name.partition(":")
  path = _resolve_path(path_or_name).resolve()
  try:
    items = _variant_items(variant)
  except VariantError as e:
    raise ValueError(f"{path}: {e}") from None
  local = any(key == RUNLOCAL for key, _ in items)
  if any(key == RUNLOCAL and text is not None for key, text in items):
    raise ValueError(f"{path}: {RUNLOCAL} takes no value (write :{RUNLOCAL})")
  arg = ",".join(key if text is None else f"{key}={text}" for key, text in items
                 if key != RUNLOCAL)
  module = _load_module(path)
  if arg and not inspect.signature(module.get_config).parameters:
    raise ValueError(f"{path} has no variants (got {arg!r}); every config accepts "
                     f":{RUNLOCAL}")
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except VariantError as e:
    raise ValueError(f"{path}: {e}") from None
  except Exception as e:  # noqa: BLE001
    raise ValueError(f"{_where(e, path)}: get_config() failed: {type(e).__name__}: {e}"
                     ) from None
  if not isinstance(config, ConfigDict):
    raise ValueError(f"{path}: get_config() returned a {type(config).__name__}; it must "
                     "return an ml_collections.ConfigDict (e.g. base_config(bert_model()))")
  config = runlocal(config) if local else config
  if "contract" in config:
    config.contract = _contract_ref(path, module, variant)
  return config


def load_config(name: str, overrides: Sequence[tuple[str, str]] = ()) -> ConfigDict:
  """Loads `NAME_OR_PATH[:VARIANT]` (`load_config_file`), applies overrides, and validates."""
  config = load_config_file(name)
  for key, value in overrides:
    apply_override(config, key, value)
  model_config(config)  # fails early, naming the key, on an invalid model group
  validate_training(config)
  phases.validate(config)
  return config
