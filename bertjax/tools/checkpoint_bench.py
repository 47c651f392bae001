"""`bertjax checkpoint-bench`: what asynchronous checkpointing costs a training run.

One process, one compiled step, alternating blocks of `checkpoint.every` steps: a block that
starts with a save (the blocking copy off the devices, then the background write overlapping
the block's steps) and a block without; the cost is the relative difference of their mean
wall times, taken in the same run so machine noise hits both alike. The first save is timed
apart (one-time set-up).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import ml_collections

from bertjax.checkpoints.train_state import TrainCheckpoints
from bertjax.data import make_batches
from bertjax.data.prepare import ensure_dataset
from bertjax.parallel import distributed, sharding
from bertjax.training.trainer import Trainer


def run_checkpoint_bench(config: ml_collections.ConfigDict, blocks: int = 4,
                         workdir: str = "") -> Iterator[str]:
  every = int(config.checkpoint.every)
  if every <= 0:
    raise ValueError("checkpoint.every must be > 0 for the benchmark")
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(workdir or tmp)
    mesh = sharding.mesh_from_config(config)
    trainer = Trainer(config, mesh)
    dataset = ensure_dataset(config, root) if config.data.source == "corpus" else ""
    rows = distributed.local_rows(trainer.data_sharding(), int(config.batch_size))
    batches = make_batches(config, "train", rows, dataset)
    state = trainer.init_state(int(config.seed))
    first = next(batches)
    trainer.compile_step(first)

    def run(n: int):
      nonlocal state
      metrics = None
      for _ in range(n):
        state, metrics = trainer.step(state, distributed.global_batch(
            next(batches), trainer.batch_shardings, rows, int(config.batch_size)))
      jax.block_until_ready(metrics)

    run(5)  # compile and warm up
    checkpoints = TrainCheckpoints(root / "run", config)
    # The first save of a process pays one-time costs (Orbax's thread pools, directory
    # creation, transfer setup): reported apart, as a run pays them once, not per interval.
    start = time.perf_counter()
    checkpoints.save(int(state.step), state, batches, config)
    checkpoints.wait()
    full_save = time.perf_counter() - start
    yield f"first save, written to the end (one-time set-up included): {full_save:.2f} s"
    run(1)
    times: dict[bool, list[float]] = {True: [], False: []}
    blocking: list[float] = []
    for block in range(blocks):
      with_save = block % 2 == 0
      start = time.perf_counter()
      if with_save:
        checkpoints.save(int(state.step), state, batches, config)
        blocking.append(time.perf_counter() - start)
      run(every)
      times[with_save].append(time.perf_counter() - start)
      yield (f"block {block}: {every} steps {'after a save' if with_save else 'no save':12s} "
             f"{times[with_save][-1]:.2f} s")
    checkpoints.close()
    batches.close()
    saving, plain = (sum(times[k]) / len(times[k]) for k in (True, False))
    mean_blocking = sum(blocking) / len(blocking)
    yield (f"per save: {mean_blocking * 1e3:.0f} ms blocking the loop "
           f"({mean_blocking / plain:.2%} of a {every}-step interval); the whole write, had it "
           f"not overlapped training, at most {full_save / plain:.2%}")
    yield (f"async save every {every} steps costs {(saving - plain) / plain:+.1%} of training "
           f"time ({saving:.2f} s vs {plain:.2f} s per block; step {plain / every * 1e3:.0f} ms; "
           f"async_save={bool(config.checkpoint.async_save)})")
