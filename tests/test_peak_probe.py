"""The CPU matmul peak against timing outliers (bertjax/training/flops.py): a probe with one
mis-timed run reads the same peak as without it; one probe far above the cached entry does not
move it, a confirmed one does; one log interval above a run's measured peak raises nothing and
never reaches the machine's cache, intervals that keep beating it raise the run's peak (and its
record in the workdir); a resume continues against the peak it recorded, whatever the cache
holds today (bertjax/training/run_start.py)."""

import itertools
import json
import types

import jax.numpy as jnp
import pytest

from bertjax.training import flops, run_start

# Timed runs of a healthy probe, and the same with one run timed short: the interval a run
# once read (0.029 s against a median 0.356 s).
STEADY = [0.356, 0.351, 0.358, 0.356, 0.360]
ONE_SHORT = [0.356, 0.351, 0.029, 0.356, 0.360]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
  """A peak cache of each test's own: the user's is neither read nor written."""
  monkeypatch.setenv("BERTJAX_CACHE", str(tmp_path / "cache"))


def _timed(monkeypatch, seconds: list[float]) -> None:
  """flops' clock made to read `seconds` for its timed runs, one after the other: each run
  reads the clock at its start and at its end."""
  reads = iter(itertools.chain.from_iterable((0.0, s) for s in seconds))
  monkeypatch.setattr(flops, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))


def test_one_mis_timed_run_does_not_move_the_probe(monkeypatch):
  _timed(monkeypatch, STEADY)
  steady = flops.measure_matmul_peak(64, jnp.float32, repeats=5)
  _timed(monkeypatch, ONE_SHORT)
  assert flops.measure_matmul_peak(64, jnp.float32, repeats=5) == steady
  assert steady == 2 * 64 ** 3 / 0.356  # the median run


def _readings(monkeypatch, values: list[float]) -> None:
  probes = iter(values)
  monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: next(probes))


def test_one_probe_far_above_the_cached_peak_is_not_taken_alone(monkeypatch):
  key = flops.cpu_peak_key("float32", 1024)
  _readings(monkeypatch, [4e11, 4e11, 4e11])
  assert flops.cpu_matmul_peak("float32")[0] == 4e11  # a fresh machine: cached
  # One probe reads 2.6x (a run timed wrong), the two that decide read the machine.
  _readings(monkeypatch, [2.6 * 4e11, 4.1e11, 4e11])
  assert flops.cpu_matmul_peak("float32")[0] == 4.1e11
  assert json.loads(flops.cpu_peak_cache().read_text())[key] == 4.1e11
  # Every probe reads twice the entry: the entry was measured under load, and is raised.
  _readings(monkeypatch, [8.2e11, 8.3e11, 8.1e11])
  assert flops.cpu_matmul_peak("float32")[0] == 8.2e11
  assert json.loads(flops.cpu_peak_cache().read_text())[key] == 8.2e11


def test_one_short_interval_raises_no_measured_peak(tmp_path):
  peak = flops.Peak(4e11, "float32", "probe", cache_key=flops.cpu_peak_key("float32", 1024))
  rates = [1e11, 1e11, 12 * 1e11, 1e11, 1e11, 1e11]  # the fourth interval timed 12x short
  assert [peak.mfu(r) for r in rates] == [0.25, 0.25, 1.0, 0.25, 0.25, 0.25]
  assert peak.flops == 4e11
  assert not flops.cpu_peak_cache().exists()  # a step never writes the machine's cache
  # Intervals that keep beating it raise the run's peak to their median, and its record.
  record = tmp_path / run_start.PEAK_RECORD
  peak.keep_in(record)
  mfus = [peak.mfu(r) for r in (5e11, 5.2e11, 5.1e11, 5.3e11)]
  assert all(0 < m <= 1 for m in mfus)
  assert peak.flops == 5.1e11 and json.loads(record.read_text())["flops"] == 5.1e11
  assert not flops.cpu_peak_cache().exists()


def test_a_resume_continues_against_the_peak_the_run_recorded(tmp_path, monkeypatch):
  _readings(monkeypatch, [4e11] * 3)
  started = run_start.run_peak(tmp_path, "float32", resuming=False, is_main=True)
  assert started.flops == 4e11
  # The machine's cache moved since (an entry 2.6x, as one mis-timed interval once made it).
  key = flops.cpu_peak_key("float32", 1024)
  flops.cpu_peak_cache().write_text(json.dumps({key: 2.6 * 4e11}))
  _readings(monkeypatch, [4e11] * 3)
  resumed = run_start.run_peak(tmp_path, "float32", resuming=True, is_main=True)
  assert resumed.flops == 4e11 and resumed.recorded
  assert "(the run's recorded peak: best of 3" in resumed.describe()
  assert json.loads((tmp_path / run_start.PEAK_RECORD).read_text()) == started.as_record()
  # A fresh run in another workdir reads the cache; a resume after a change of dtype measures.
  _readings(monkeypatch, [4e11] * 3)
  assert run_start.run_peak(tmp_path / "other", "float32", False, False).flops == 2.6 * 4e11
  _readings(monkeypatch, [9e11] * 3)
  assert run_start.run_peak(tmp_path, "bfloat16", resuming=True, is_main=True).flops == 9e11
