"""How a benchmark times steps: blocks dispatched back to back with one wait, for our step
(`bench.OurStep`) and the reference's (`bench_hf.ReferenceStep`) alike; guide:
docs/performance.md (what one run does, item 2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def block_times(dispatch: Callable[[], Any], wait: Callable[[Any], None],
                steps: int) -> list[float]:
  """`steps` steps dispatched back to back, as a training loop does (the host prepares the
  next step while the device runs this one), and one wait for the last: each step's time is
  the block's mean. Waiting after every step would add the host's dispatch of each step (on a
  GPU: argument handling, the command buffer's update;
  docs/results/2026-11-28-h200-gpu-session.md) to the device's time. Returned once per step,
  so that medians over blocks weigh blocks by steps."""
  start = time.perf_counter()
  last = None
  for _ in range(steps):
    last = dispatch()
  wait(last)
  return [(time.perf_counter() - start) / steps] * steps
