"""`bertjax doctor` on CPU: every check's line and JSON on 1 and 8 devices and 2 processes, and
each numeric check failing on a broken variant (a kernel handed the wrong mask, a collective
over the wrong axis, a 16-bit accumulator, a timing that does not wait, a checkpoint read back
wrong, a loader giving the wrong shapes). On CPU the fused attention paths run emulated (the
splash kernel in Pallas interpret mode, the cuDNN call through XLA) and the lines say so. The
same command on a GPU is in tests/test_accelerator.py."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import xla_flags

from bertjax import cli
from bertjax import config as config_lib
from bertjax.models import attention
from bertjax.tools import bench, device_checks, doctor

ROOT = Path(__file__).parent.parent
SYNTHETIC = ["--config.data.source=synthetic_markov"]


def _config(**changes):
  overrides = {"data.source": "synthetic_markov", **changes}
  return config_lib.load_config("gpt_tiny", list(overrides.items()))


def _status(checks) -> dict[str, str]:
  return {c.name: c.status for c in checks}


def _doctor_env(devices: int) -> dict[str, str]:
  import os
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices)}


@pytest.mark.slow
def test_doctor_on_one_device_prints_every_check(tmp_path):
  report = tmp_path / "report.json"
  result = subprocess.run(
      [sys.executable, "-m", "bertjax", "doctor", "--config", "gpt_tiny", "--workdir",
       str(tmp_path), "--json", str(report), "--steps", "2", *SYNTHETIC], cwd=ROOT,
      env=_doctor_env(1), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr[-3000:]
  lines = result.stdout.splitlines()
  record = json.loads(report.read_text())
  names = [c["name"] for c in record["checks"]]
  assert names[0] == "environment" and names[-3:] == ["speed", "checkpoint", "loader"]
  kinds = ("padding", "causal", "packed", "local_window")
  assert [n for n in names if n.startswith("attention/")] == (
      [f"attention/splash/{k}" for k in kinds] + [f"attention/cudnn/{k}" for k in kinds])
  # One line per check, in the report's order, each with its status and figure.
  for check, line in zip(record["checks"], [x for x in lines if x[:4] in
                                            ("PASS", "WARN", "FAIL", "SKIP")]):
    assert line.startswith(check["status"].upper()) and check["name"] in line
    assert check["figure"] and check["figure"] in line
  assert sum("interpret mode (no TPU here)" in x for x in lines) == 4
  assert sum("through XLA's implementation (no GPU here)" in x for x in lines) == 4
  statuses = _status([doctor.Check(**c) for c in record["checks"]])
  assert statuses["collectives"] == "skip"  # one device
  assert set(statuses.values()) <= {"pass", "skip"}, statuses
  assert record["failed"] == [] and "doctor:" in lines[-1]


@pytest.mark.slow
def test_doctor_on_eight_devices_checks_every_mesh_axis(devices, tmp_path, capsys):
  """The command in this process (8 simulated devices, a 2x2x2 mesh): every check, its line
  and the JSON."""
  report = tmp_path / "doctor.json"
  assert cli.main(["doctor", "--config", "gpt_tiny", "--workdir", str(tmp_path), "--json",
                   str(report), "--steps", "2", *SYNTHETIC, "--config.mesh.fsdp=2",
                   "--config.mesh.tensor=2"]) == 0
  out = capsys.readouterr().out
  record = json.loads(report.read_text())
  statuses = {c["name"]: c["status"] for c in record["checks"]}
  assert [n for n in statuses if n.startswith("collectives/")] == [
      f"collectives/{axis}/{kind}" for axis in ("data", "fsdp", "tensor")
      for kind in ("all-reduce", "all-gather", "reduce-scatter")]
  assert {"environment", "products/bf16_accumulation", "products/matmul_peak", "speed",
          "checkpoint", "loader", "attention/splash/packed",
          "attention/cudnn/packed"} <= set(statuses)
  assert set(statuses.values()) == {"pass"}, statuses
  for check in record["checks"]:
    assert f"{check['status'].upper():<5} {check['name']}" in out and check["figure"] in out
  environment = record["checks"][0]
  assert environment["values"]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert "row sets disjoint and complete" in environment["detail"]


def _run(config, tmp_path, *names, steps=2):
  return doctor.run_doctor(config, str(tmp_path), checks=names, steps=steps)


@pytest.mark.slow
def test_a_fused_kernel_given_the_wrong_mask_fails(monkeypatch, tmp_path):
  """The cuDNN call handed an all-true mask, splash handed no document ids: every mask that
  hides something fails; causal (the kernels' own flag) still passes."""
  cudnn, splash = attention.cudnn_attention, attention.splash_attention

  def unmasked(mask):
    return attention.AttentionMask(jnp.ones_like(mask.dense_B1LS), None, mask.causal)

  monkeypatch.setattr(attention, "cudnn_attention",
                      lambda c, q, k, v, mask, **kw: cudnn(c, q, k, v, unmasked(mask), **kw))
  monkeypatch.setattr(attention, "splash_attention",
                      lambda c, q, k, v, mask, **kw: splash(c, q, k, v, unmasked(mask), **kw))
  statuses = _status(_run(_config(), tmp_path, "attention"))
  for path in ("splash", "cudnn"):
    assert statuses[f"attention/{path}/causal"] == "pass"
    for kind in ("padding", "packed", "local_window"):
      assert statuses[f"attention/{path}/{kind}"] == "fail", (path, kind)


def test_a_collective_over_the_wrong_axis_fails(devices, monkeypatch, tmp_path):
  collective = device_checks._collective
  swap = {"data": "fsdp", "fsdp": "tensor", "tensor": "data"}
  monkeypatch.setattr(device_checks, "_collective",
                      lambda kind, axis, block: collective(kind, swap[axis], block))
  checks = _run(_config(**{"mesh.fsdp": 2, "mesh.tensor": 2}), tmp_path, "collectives")
  assert len(checks) == 9 and {c.status for c in checks} == {"fail"}
  assert all("hold wrong values" in c.figure for c in checks)


def test_a_16_bit_accumulator_fails_the_product_check(monkeypatch, tmp_path):
  monkeypatch.setattr(device_checks, "bf16_product", lambda a, b: jnp.matmul(
      a, b, preferred_element_type=jnp.bfloat16).astype(jnp.float32))
  statuses = _status(_run(_config(), tmp_path, "products"))
  assert statuses["products/bf16_accumulation"] == "fail"
  assert statuses["products/matmul_peak"] == "pass"


def test_a_timing_that_does_not_wait_for_the_step_fails(monkeypatch, tmp_path):
  run = bench.OurStep.run

  def not_waiting(self, steps):
    times = run(self, steps)
    return [t / 1e4 for t in times]  # as if the clock stopped at dispatch

  monkeypatch.setattr(bench.OurStep, "run", not_waiting)
  (speed,) = _run(_config(), tmp_path, "speed")
  assert speed.status == "fail" and "faster than the matmul peak" in speed.figure


def test_a_checkpoint_read_back_wrong_fails(monkeypatch, tmp_path):
  restore = doctor.restore

  def corrupting(*args):
    tree = restore(*args)
    first = jax.tree.leaves(tree)[0]
    return jax.tree.map(lambda x: x + 1 if x is first else x, tree)

  monkeypatch.setattr(doctor, "restore", corrupting)
  (check,) = _run(_config(), tmp_path, "checkpoint")
  assert check.status == "fail" and "1 leaves read back differ" in check.figure
  assert not list((tmp_path / "doctor").glob("checkpoint-*"))  # cleaned up anyway


def test_a_loader_giving_the_wrong_shapes_fails(monkeypatch, tmp_path):
  import bertjax.data
  make_batches = bertjax.data.make_batches

  def short_rows(*args, **kwargs):
    source = make_batches(*args, **kwargs)
    return ({k: v[:, :-1] if v.ndim > 1 else v for k, v in b.items()} for b in source)

  monkeypatch.setattr(bertjax.data, "make_batches", short_rows)
  (check,) = _run(_config(), tmp_path, "loader")
  assert check.status == "fail" and "input_ids" in check.figure


def test_the_loader_check_skips_without_a_built_dataset(tmp_path):
  (check,) = _run(config_lib.load_config("gpt_tiny"), tmp_path, "loader")
  assert check.status == "skip" and "was not built" in check.detail


def test_a_failed_check_exits_1_and_an_unknown_check_2(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(device_checks, "bf16_product", lambda a, b: jnp.matmul(
      a, b, preferred_element_type=jnp.bfloat16).astype(jnp.float32))
  assert cli.main(["doctor", "--config", "gpt_tiny", "--workdir", str(tmp_path), "--checks",
                   "products"]) == 1
  out = capsys.readouterr().out
  assert "FAIL  products/bf16_accumulation" in out and "1 fail" in out
  record = json.loads((tmp_path / "doctor.json").read_text())
  assert record["failed"] == ["products/bf16_accumulation"]
  assert cli.main(["doctor", "--checks", "speed,kernels"]) == 2
  assert "unknown check(s) kernels" in capsys.readouterr().err


@pytest.mark.slow
def test_doctor_in_two_processes_checks_the_collectives_across_them(tmp_path):
  report = tmp_path / "doctor.json"
  result = subprocess.run(
      [sys.executable, "launch/local.py", "--processes", "2", "--devices", "4", "--",
       sys.executable, "-m", "bertjax", "doctor", "--config", "gpt_tiny", "--workdir",
       str(tmp_path), "--json", str(report), "--steps", "2", *SYNTHETIC], cwd=ROOT,
      env=_doctor_env(4), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  records = [json.loads(report.read_text()),
             json.loads((tmp_path / "doctor.host1.json").read_text())]
  for index, record in enumerate(records):
    assert record["process_index"] == index and record["process_count"] == 2
    statuses = _status([doctor.Check(**c) for c in record["checks"]])
    assert set(statuses.values()) == {"pass"}, statuses
    assert {"collectives/data/all-reduce", "collectives/data/all-gather",
            "collectives/data/reduce-scatter", "attention/splash/padding",
            "products/bf16_accumulation", "speed", "checkpoint", "loader"} <= set(statuses)
    environment = record["checks"][0]
    assert "hosts: 2 x 4 devices; each loads 8 of 16 rows" in environment["detail"]
  assert "[host 1] doctor: " in result.stdout and "[host 0] doctor: " in result.stdout


def test_collective_expectations_are_the_host_arithmetic():
  """_expected, the check's reference, on a 2x3 mesh by hand."""
  values = np.arange(2 * 3 * 6, dtype=np.float32).reshape(2, 3, 6)
  reduced = device_checks._expected("all-reduce", values, 1)
  np.testing.assert_array_equal(reduced[0, 2], values[0].sum(axis=0))
  gathered = device_checks._expected("all-gather", values, 0)
  np.testing.assert_array_equal(gathered[1, 2], np.concatenate([values[0, 2], values[1, 2]]))
  scattered = device_checks._expected("reduce-scatter", values, 1)
  np.testing.assert_array_equal(scattered[1, 2], values[1].sum(axis=0)[4:6])


def test_interconnect_figures_come_from_the_data_sheets():
  class Device:
    def __init__(self, kind):
      self.device_kind = kind
  sheet = device_checks.interconnect_bandwidth
  assert sheet(Device("NVIDIA H100 80GB HBM3")) == 900e9
  assert sheet(Device("TPU v4")) == 600e9  # bertjax.tools.topology's v4 figure, one device
  assert sheet(Device("TPU v5 lite")) == 400e9 and sheet(Device("TPU v5p")) == 1200e9
  assert sheet(Device("TPU v6 lite")) == 800e9
  assert sheet(Device("cpu")) is None and sheet(Device("TPU v3")) is None


def test_a_step_that_does_not_fit_is_measured_at_its_runlocal_shape(monkeypatch, tmp_path):
  real = bench.OurStep.__init__

  def out_of_memory_when_large(self, config, batch):
    if int(config.model.num_layers) > 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")
    real(self, config, batch)

  monkeypatch.setattr(bench.OurStep, "__init__", out_of_memory_when_large)
  config = _config(**{"model.num_layers": 4})
  (speed,) = _run(config, tmp_path, "speed")
  assert speed.status in ("pass", "warn")
  assert "did not fit" in speed.detail and "runlocal shape" in speed.detail
  assert speed.detail.startswith("gpt 2x128")  # runlocal's two layers
