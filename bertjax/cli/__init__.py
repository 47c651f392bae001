"""The `bertjax` command: one entry point, one subcommand per job (the command modules beside
this one register them).

Config overrides follow ml_collections' convention, `--config.model.num_layers=4`, and may
appear anywhere on the command line; an unknown key is an error naming it. A user's mistake
ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

from bertjax import config as config_lib
from bertjax.cli import data, finetune, measure, reproduce, train, weights
from bertjax.cli.common import EXIT_USAGE

# The order of `bertjax --help`.
COMMAND_MODULES = (train, finetune, weights, data, measure, reproduce)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="bertjax", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Pre-train BERT and GPT language models with JAX, from a CPU to TPU pods.",
      epilog=textwrap.dedent("""\
          examples:
            bertjax info --config configs/bert_base.py
            bertjax import path/to/hf_bert --out runs/bert_params
            bertjax export --params runs/bert_params --format hf --out runs/bert_hf
          Run `bertjax <command> --help` for each command's options."""))
  sub = parser.add_subparsers(dest="command", required=True, metavar="command")

  def add(name: str, help_: str, description: str, epilog: str,
          fn: Callable | None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(fn=fn)
    return p

  for module in COMMAND_MODULES:
    module.register(add)
  return parser


class _QuietLibraryNoise(logging.Filter):
  """Drops what Orbax and TensorStore print from their background threads when a checkpoint
  read or write fails: the failure reaches the command as an exception and is reported once,
  in one line; the same error logged (with its traceback) by each worker thread adds nothing."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      return False
    return "exception was never retrieved" not in record.getMessage()


def _quiet_library_noise() -> None:
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_QuietLibraryNoise())
  default_hook = sys.unraisablehook

  def unraisable(info) -> None:
    # TensorStore callbacks that land after a failed Orbax operation closed its event loop.
    if isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(
        info.exc_value):
      return
    default_hook(info)

  sys.unraisablehook = unraisable


def main(argv: Sequence[str] | None = None) -> int:
  logging.basicConfig(level=logging.WARNING,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
  _quiet_library_noise()
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    rest, overrides = config_lib.split_overrides(argv)
  except ValueError as e:
    print(f"bertjax: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  args = _parser().parse_args(rest)
  try:
    return args.fn(args, overrides)
  except (KeyError, ValueError, OSError) as e:
    # A user's mistake or the machine's (a path, a config, a full disk): one line, no traceback.
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"bertjax {args.command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
