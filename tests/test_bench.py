"""`bertjax bench`: the model FLOPs formula against what XLA compiles, and the
harness's plumbing at toy size. No timing is asserted: speed is a benchmark's business.

The runs of the transformers/PyTorch reference (`--compare hf`, `--best`) are marked `benchmark`
and deselected by default: `python -m pytest -m benchmark tests/test_bench.py` runs them."""

import json

import jax
import numpy as np
import pytest

from bertjax import config as config_lib
from bertjax.training import flops
from bertjax.config import model_config
from bertjax.tools import bench

# A one-layer, 32-wide model: the bench's plumbing, not its speed.
TOY_OVERRIDES = ["--config.model.num_layers=1", "--config.model.hidden_size=32",
                 "--config.model.num_heads=2", "--config.model.mlp_dim=64",
                 "--config.model.vocab_size=512", "--config.batch_size=8",
                 "--config.seq_length=32", "--config.max_predictions=5"]
SMALL = [("model.hidden_size", "256"), ("model.mlp_dim", "1024"), ("model.num_heads", "4"),
         ("model.vocab_size", "2048"), ("batch_size", "16")]


@pytest.mark.parametrize("name", ["bert_tiny", "gpt_tiny"])
@pytest.mark.slow
def test_model_flops_formula_matches_xla(name, devices):
  """Unrolled layers, so XLA's cost_analysis sees every layer: it counts elementwise work too
  (softmax, LayerNorm, AdamW), so it sits a few percent above; the dots alone match exactly."""
  config = config_lib.load_config(name, SMALL + [("model.scan_layers", "False")])
  step = bench.OurStep(config, bench.synthetic_batch(config))
  dots, xla_cost = step.compiled_flops()
  model = flops.train_flops_per_step(model_config(config), 16, int(config.seq_length),
                                     bench.predictions_per_seq(config))
  assert dots == pytest.approx(model, rel=1e-6)  # exact: no matmul recomputed, none wasted
  assert xla_cost == pytest.approx(model, rel=0.10)
  assert xla_cost >= dots


@pytest.mark.slow
def test_scanned_layers_compile_the_same_dots(devices):
  """With scan-over-layers, cost_analysis counts the loop body once; the trip-counted dots
  the report uses still equal the formula."""
  config = config_lib.load_config("bert_tiny", SMALL + [("model.num_layers", "3")])
  step = bench.OurStep(config, bench.synthetic_batch(config))
  dots, xla_cost = step.compiled_flops()
  model = flops.train_flops_per_step(model_config(config), 16, int(config.seq_length), 20)
  assert dots == pytest.approx(model, rel=1e-6)  # exact: no matmul recomputed, none wasted
  assert xla_cost < 0.8 * model


def test_synthetic_bert_batch_is_like_real_data():
  config = config_lib.load_config("bert_tiny", [("batch_size", "6")])
  batch = bench.synthetic_batch(config)
  length, masked = int(config.seq_length), round(0.15 * int(config.seq_length))
  assert batch["masked_lm_weights"].sum(axis=1).tolist() == [min(masked, 20)] * 6
  for row in range(6):
    real = batch["masked_lm_positions"][row][batch["masked_lm_weights"][row] > 0]
    assert len(set(real.tolist())) == len(real) and 0 < real.min() and real.max() < length - 1
    np.testing.assert_array_equal(batch["masked_lm_ids"][row][:len(real)],
                                  batch["input_ids"][row][real])
  assert set(np.unique(batch["token_type_ids"])) == {0, 1}


@pytest.mark.benchmark
def test_bench_compares_with_transformers_and_writes_a_record(tmp_path, devices, capsys):
  pytest.importorskip("torch", reason="the hf extra (torch) is needed for --compare hf")
  from bertjax import cli
  out = tmp_path / "bench.json"
  overrides = TOY_OVERRIDES
  for name in ("bert_tiny", "gpt_tiny"):
    assert cli.main(["bench", "--config", name, "--compare", "hf", "--steps", "2", "--pairs",
                     "2", "--json", str(out)] + overrides) == 0
    text = capsys.readouterr().out
    assert "bertjax" in text and "hf torch" in text and "median" in text
    record = json.loads(out.read_text())
    assert len(record["pairs_ratio"]) == 2 and record["median_ratio"] > 0
    assert record["hf"]["params"] == record["ours"]["params"]
    assert record["ours"]["compiled_dot_flops"] == pytest.approx(
        record["ours"]["model_flops"], rel=0.01)
    assert 0 < record["ours"]["mfu_vs_xla_matmul_peak"]
    # Hugging Face projects every position onto the vocabulary; ours only the masked ones.
    if name == "bert_tiny":
      assert record["hf"]["model_flops"] > record["ours"]["model_flops"]
    else:
      assert record["hf"]["model_flops"] == record["ours"]["model_flops"]


@pytest.mark.fast  # the fast tier's test of bertjax.tools.guard_bench
def test_bench_compare_guard_times_three_variants_and_writes_a_record(tmp_path, capsys):
  """`--compare guard` at toy size: its plumbing (the ratios are the results page's)."""
  from bertjax import cli
  out = tmp_path / "guard.json"
  assert cli.main(["bench", "--config", "gpt_tiny", "--compare", "guard", "--steps", "1",
                   "--pairs", "2", "--json", str(out)] + TOY_OVERRIDES) == 0
  assert "medians: detector" in capsys.readouterr().out
  record = json.loads(out.read_text())
  assert set(record["seconds"]) == {"plain", "detector", "skip"}
  assert len(record["ratios"]["skip"]) == 2 and record["median_ratio"]["detector"] > 0


def test_bench_best_without_compare_is_a_user_error(capsys):
  from bertjax import cli
  assert cli.main(["bench", "--config", "bert_tiny", "--best"] + TOY_OVERRIDES) == 2
  assert "--compare hf" in capsys.readouterr().err


@pytest.mark.benchmark
def test_bench_best_compares_the_fastest_precision_of_each(tmp_path, devices, capsys):
  """--best: ours and the reference each in float32 and bf16 (autocast), per-dtype peaks, the
  fastest of each compared."""
  pytest.importorskip("torch", reason="the hf extra (torch) is needed for --compare hf")
  from bertjax import cli
  out = tmp_path / "best.json"
  overrides = TOY_OVERRIDES
  assert cli.main(["bench", "--config", "bert_tiny", "--compare", "hf", "--best", "--steps", "1",
                   "--pairs", "2", "--json", str(out)] + overrides) == 0
  text = capsys.readouterr().out
  assert "hf torch bf16 autocast" in text and "best vs best" in text and "bf16 vs fp32" in text
  record = json.loads(out.read_text())
  assert set(record["ours_by_dtype"]) == set(record["hf_by_precision"]) == {"float32",
                                                                             "bfloat16"}
  assert record["hf_by_precision"]["bfloat16"]["precision"] == "bf16 autocast"
  peaks = record["peak"]
  assert set(peaks["xla_matmul_flops_by_dtype"]) == set(peaks["torch_matmul_flops_by_dtype"]) \
      == {"float32", "bfloat16"}
  assert len(record["best_pairs_ratio"]) == 2 and record["best_median_ratio"] > 0
  assert len(record["ours_bf16_over_fp32_pairs"]) == 2
  fastest_ours = min(r["step_seconds_median"] for r in record["ours_by_dtype"].values())
  fastest_hf = min(r["step_seconds_median"] for r in record["hf_by_precision"].values())
  assert record["ours"]["step_seconds_median"] >= fastest_ours
  assert fastest_hf > 0
  # Each dtype's MFU is against that dtype's own peak.
  for dtype, run in record["ours_by_dtype"].items():
    assert run["mfu_vs_xla_matmul_peak"] == pytest.approx(
        run["model_flops_per_second"] / peaks["xla_matmul_flops_by_dtype"][dtype])


def test_bf16_matmul_peak_is_timed_in_its_fastest_form(monkeypatch):
  """A 16-bit peak times the 16-bit and the float32 output and keeps the faster; float32
  times one form."""
  import jax.numpy as jnp
  seen = []
  real_matmul = jnp.matmul

  def spy(x, y, preferred_element_type=None):
    seen.append((str(x.dtype), str(jnp.dtype(preferred_element_type))))
    return real_matmul(x, y, preferred_element_type=preferred_element_type)
  monkeypatch.setattr(jnp, "matmul", spy)
  assert flops.measure_matmul_peak(64, jnp.bfloat16, repeats=1) > 0
  assert set(seen) == {("bfloat16", "bfloat16"), ("bfloat16", "float32")}
  seen.clear()
  assert flops.measure_matmul_peak(64, jnp.float32, repeats=1) > 0
  assert set(seen) == {("float32", "float32")}


@pytest.mark.fast  # the fast tier's test of bertjax.tools.decode_bench
def test_decode_bench_reports_each_cache_size(capsys):
  from bertjax import cli
  assert cli.main(["bench", "--config", "gpt_tiny", "--decode", "24,40", "--new-tokens", "8",
                   "--config.model.num_layers=1", "--config.model.hidden_size=32",
                   "--config.model.num_heads=2", "--config.model.mlp_dim=64",
                   "--config.model.vocab_size=97"]) == 0
  text = capsys.readouterr().out
  assert "KV cache" in text and text.count("\n") >= 3
  assert cli.main(["bench", "--config", "bert_tiny", "--decode", "24"]) == 2
  assert "--decode needs a GPT config" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_splits_op_time_by_purpose(tmp_path, devices):
  """Every profiled op is one of the compiled program's instructions, sorted by what it does:
  the matmuls, and the dropout the tiny BERT runs, both show up; the shares add up."""
  from bertjax.tools import hlo
  config = config_lib.load_config("bert_tiny", [("batch_size", "8"), ("model.num_layers", "2")])
  step = bench.OurStep(config, bench.synthetic_batch(config))
  purposes = hlo.instruction_purposes(step.compiled.as_text())
  assert "matmul" in purposes.values() and "dropout: random bits and masks" in purposes.values()
  assert not any(name.startswith("while") for name in purposes)  # containers are not timed
  from bertjax.tools import profiles
  profile = profiles.profile_step(step, str(tmp_path / "trace"), steps=1)
  shares = profile["by_purpose"]
  assert {"matmul", "dropout: random bits and masks", "optimizer update"} <= set(shares)
  assert sum(v["share"] for v in shares.values()) == pytest.approx(1.0)
  assert profile["op_seconds_per_step"] > 0 and profile["matmul_flops_per_second"] > 0
  assert profile["trace"].startswith(str(tmp_path))


# An XLA:GPU optimized-HLO gemm: the dot became a cuBLAS call whose result is a tuple with its
# workspace, the dimension numbers in the backend config.
_GPU_GEMM_HLO = """HloModule jit_f, entry_computation_layout={(bf16[64,256]{1,0}, bf16[256,32]{1,0})->bf16[64,32]{1,0}}

ENTRY %main (p0: bf16[64,256], p1: bf16[256,32]) -> bf16[64,32] {
  %p0 = bf16[64,256]{1,0} parameter(0)
  %p1 = bf16[256,32]{1,0} parameter(1)
  %custom-call.1 = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %p0, bf16[256,32]{1,0} %p1), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"alpha_imag":0,"epilogue":"DEFAULT"}}
  ROOT %get-tuple-element = bf16[64,32]{1,0} get-tuple-element((bf16[64,32]{1,0}, s8[4194304]{0}) %custom-call.1), index=0
}
"""


def test_cublas_gemm_calls_count_as_matmul_flops():
  """On a GPU most dots compile to cuBLAS custom calls: they count (2 x 64 x 32 x 256); the
  accelerator tier checks a whole step's count against the formula on the GPU."""
  from bertjax.tools import hlo
  assert hlo.analyze_hlo(_GPU_GEMM_HLO).matmul_flops == 2 * 64 * 32 * 256
  other = _GPU_GEMM_HLO.replace("__cublas$gemm", "__cudnn$norm")
  assert hlo.analyze_hlo(other).matmul_flops == 0


@pytest.mark.slow
def test_the_gpu_table_runs_reduced_on_cpu(tmp_path, capsys):
  """`bench --table gpu --reduced`: every row's code path (its config, a child process, ours
  against transformers) at toy size, the table and the JSON; no timing is asserted."""
  from bertjax import cli
  from bertjax.tools import bench_table
  path = tmp_path / "table.json"
  # The BERT row and one GPT row (the other GPT row is the same code at another size).
  names = [row.name for row in bench_table.TABLES["gpu"]][::2]
  assert cli.main(["bench", "--table", "gpu", "--reduced", "--no-torch-compile", "--steps", "1",
                   "--pairs", "1", "--rows", ",".join(names), "--json", str(path)]) == 0
  records = json.loads(path.read_text())
  assert [r["row"] for r in records] == names
  out = capsys.readouterr().out
  for record in records:
    assert record["config"]["dtype"] == "bfloat16" and record["ours"]["step_seconds_median"] > 0
    assert record["config"]["scan_layers"] is False  # the faster form on a GPU
    assert "bf16 autocast" in record["hf"]["model"] and len(record["pairs_ratio"]) == 1
    assert f"| {record['row']} |" in out
  assert records[0]["overrides"]["max_predictions"] == "8"  # BERT: predictions fit 64 tokens
  assert cli.main(["bench", "--table", "gpu", "--rows", "GPT-2 tiny"]) == 2
  assert "GPT-2 medium s1024" in capsys.readouterr().err


def test_the_matmul_peak_is_timed_at_full_size_on_an_accelerator(monkeypatch):
  """At the CPU's size (2048²) an H100 read a fifth of its peak and MFU read 124-253%
  (docs/results/2026-11-27-h100-scan-and-peak.md)."""
  assert flops.matmul_peak_size(2048) == 2048  # this CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert flops.matmul_peak_size(2048) == 8192
