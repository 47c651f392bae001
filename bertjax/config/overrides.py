"""`--config.a.b=value` overrides: found on a command line, checked against the loaded config
and typed like the value they replace.

The parser is our own, small one: ml_collections' typed overrides live in `config_flags`, which
defines absl flags on a global flag registry.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Sequence
from typing import Any

import ml_collections

ConfigDict = ml_collections.ConfigDict


def parse_value(text: str, current: Any, name: str,
                 error: type[ValueError] = ValueError) -> Any:
  """`text` typed like `current` (bool, int, float, str; anything else: a Python literal, or
  the text itself); `name` leads the error message."""
  if isinstance(current, bool):
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
      return True
    if lowered in ("false", "0", "no"):
      return False
    raise error(f"{name}: expected true/false, got {text!r}")
  if isinstance(current, int):
    try:
      return int(text)
    except ValueError:
      raise error(f"{name}: expected an integer, got {text!r}") from None
  if isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      raise error(f"{name}: expected a number, got {text!r}") from None
  if isinstance(current, str):
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _all_keys(config: ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for name, value in config.items():
    keys.append(prefix + name)
    if isinstance(value, ConfigDict):
      keys.extend(_all_keys(value, f"{prefix}{name}."))
  return keys


def apply_override(config: ConfigDict, key: str, text: str) -> None:
  """Sets `config.<key>` from its command-line text, typed like the existing value."""
  node = config
  parts = key.split(".")
  for i, part in enumerate(parts):
    if not isinstance(node, ConfigDict) or part not in node:
      close = difflib.get_close_matches(key, _all_keys(config), n=3)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise KeyError(f"unknown config key {key!r}{hint}")
    if i < len(parts) - 1:
      node = node[part]
  if isinstance(node[parts[-1]], ConfigDict):
    raise KeyError(f"config key {key!r} is a group; override one of its keys "
                   f"(e.g. {key}.{next(iter(node[parts[-1]]))})")
  node[parts[-1]] = parse_value(text, node[parts[-1]], f"--config.{key}")


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
  """Separates `--config.k=v` / `--config.k v` from the other arguments."""
  rest, overrides = [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("--config."):
      body = arg[len("--config."):]
      if "=" in body:
        key, value = body.split("=", 1)
      elif i + 1 < len(args) and not args[i + 1].startswith("--"):
        key, value = body, args[i + 1]
        i += 1
      else:
        raise ValueError(f"{arg} needs a value ({arg}=VALUE)")
      overrides.append((key, value))
    else:
      rest.append(arg)
    i += 1
  return rest, overrides
