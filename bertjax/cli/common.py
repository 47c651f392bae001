"""What the command modules of the CLI share: exit statuses, common help texts, how a
command is added to the parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# Exit statuses, the same for every command (docs/training.md has the table); 3, a peer
# process lost, is bertjax.parallel.distributed.EXIT_PEER_LOST; 5, a hardware fault (a replay
# did not reproduce the trouble), and 6, a hang, are bertjax.resilience.watchdog's: the
# launchers restart a run on 3, 5 and 6.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_COMPILER_CRASH = 0, 1, 2, 4
EXIT_HARDWARE, EXIT_HUNG = 5, 6

OVERRIDES_EPILOG = ("Any key of the config file can be overridden on the command line, e.g.\n"
                     "  --config.model.num_layers=4 --config.mesh.fsdp=2")

SOURCE_HELP = ("a corpus: kind:path[@weight][?key=value&...], kinds wikipedia, "
              "wikiextractor, text, bert_lines, lines, jsonl, parquet, tfds; options "
              "name, language, encoding, text_field, id_field, id_separator, keep_lists, "
              "max_line_bytes, split, data_dir (docs/data.md); `embedded` is the packaged "
              "Wikipedia sample (repeatable)")

# add(name, help, description, epilog, handler) -> the command's parser; a handler takes the
# parsed arguments and the `--config.*` overrides and returns the exit status.
Add = Callable[..., argparse.ArgumentParser]
