"""`bertjax bench --gpu-session`: the lent GPU's one command, tested at CPU size so that nothing
is debugged on the device — the profile reader on a real GPU trace (an excerpt of an H200's),
the purposes of XLA:GPU's library calls, the waves and the device lock, the timed blocks, and
the whole session reduced (jobs, tier, page, traces)."""

import gzip
import json
import tarfile
import threading
import time
from pathlib import Path

import pytest

from bertjax.tools import gpu_session, profiles

EXCERPT = Path(__file__).parent / "golden" / "h200_bert_large_trace_excerpt.json.gz"


def _excerpt(tmp_path, extra_events=()):
  with gzip.open(EXCERPT) as f:
    data = json.loads(f.read())
  data["traceEvents"] += list(extra_events)
  path = tmp_path / "excerpt.trace.json.gz"
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": data["traceEvents"]}, f)
  return str(path), data


def test_the_reader_splits_a_gpu_trace_by_kernel_purpose_and_timeline(tmp_path):
  """300 kernels of BERT-large's step on an H200, replayed from a command buffer (their hlo_op
  is the buffer's name): each is attributed by its kernel name to the fusion it runs or to its
  library's kind (cuBLAS GEMMs, cuDNN attention), and the timeline adds up."""
  host = [{"ph": "X", "pid": 701, "tid": 5, "ts": 0.0, "dur": 870.0, "name": "ParseArguments"},
          {"ph": "X", "pid": 701, "tid": 5, "ts": 900.0, "dur": 920.0,
           "name": "command_buffer::update"}]
  path, data = _excerpt(tmp_path, host)
  kernels = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1]
  summary = profiles.summarize_trace(path, data["purposes"], steps=1)
  assert summary["host"] == {"argument handling_us_per_step": 870.0,
                             "command buffer updates_us_per_step": 920.0}
  total_us = sum(e["dur"] for e in kernels)
  assert summary["op_seconds_per_step"] == pytest.approx(total_us / 1e6)
  purposes = summary["by_purpose"]
  assert {"matmul", "attention: fused kernel", "layer norm", "MLP activation",
          "dropout: random bits and masks"} <= set(purposes)
  assert "unattributed" not in purposes
  assert sum(v["share"] for v in purposes.values()) == pytest.approx(1.0)
  kinds = summary["by_kernel_class"]
  assert {"gemm", "attention (fused)", "other (elementwise, reductions)"} <= set(kinds)
  t = summary["timeline"]
  assert t["kernels_per_step"] == len(kernels)
  assert t["busy_us_per_step"] <= t["window_us_per_step"] and 0.5 < t["busy_share"] <= 1.0
  span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
  assert t["window_us_per_step"] == pytest.approx(span)
  assert summary["top_kernels"][0]["us_per_step"] >= summary["top_kernels"][-1]["us_per_step"]
  lines = "\n".join(profiles.format_summary(summary, "ours"))
  assert "kernels a step" in lines and "| gemm |" in lines


def test_derived_lines_do_not_count_twice_and_modules_split_the_idle_time(tmp_path):
  """The profiler may add "XLA Ops" / "XLA Modules" lines on the device beside its streams,
  built from the same kernels: only the streams count. The module line's spans (one execution
  of the program each) tell idle time inside the program from idle time between steps: here
  the second half of the kernels moved 500 µs later, after an execution that ends with the
  first half."""
  _, data = _excerpt(tmp_path)
  meta = [e for e in data["traceEvents"] if e.get("ph") != "X"]
  kernels = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1]
  half = len(kernels) // 2
  kernels = kernels[:half] + [{**e, "ts": e["ts"] + 500.0} for e in kernels[half:]]
  end_of_first = kernels[half - 1]["ts"] + kernels[half - 1]["dur"]
  derived = [{"ph": "M", "pid": 1, "tid": 90, "name": "thread_name",
              "args": {"name": "XLA Ops"}},
             {"ph": "M", "pid": 1, "tid": 91, "name": "thread_name",
              "args": {"name": "XLA Modules"}},
             *({**e, "tid": 90} for e in kernels)]
  execution = {"ph": "X", "pid": 1, "tid": 91, "ts": kernels[0]["ts"],
               "dur": end_of_first - kernels[0]["ts"], "name": "jit_train_step"}

  def summary(events, name):
    path = tmp_path / f"{name}.trace.json.gz"
    with gzip.open(path, "wt") as f:
      json.dump({"traceEvents": meta + events}, f)
    return profiles.summarize_trace(str(path), data["purposes"], steps=1)

  alone = summary(kernels, "alone")
  with_lines = summary(kernels + derived + [execution], "lines")
  assert with_lines["op_seconds_per_step"] == pytest.approx(alone["op_seconds_per_step"])
  gap = kernels[half]["ts"] - end_of_first
  assert gap >= 500.0
  # Without the module line every gap is inside the program; with it, this one is between.
  assert alone["timeline"]["idle_in_step_us_per_step"] == pytest.approx(gap)
  assert with_lines["timeline"]["idle_in_step_us_per_step"] == 0
  assert with_lines["timeline"]["idle_between_steps_us_per_step"] == pytest.approx(gap)


def test_library_calls_have_purposes_of_their_own():
  """XLA:GPU's cuBLAS GEMMs and cuDNN attention are custom calls: matmul and fused attention,
  not what their JAX source path would say."""
  from bertjax.tools import hlo
  text = """HloModule jit_f

ENTRY %main (p0: bf16[64,256], p1: bf16[256,32]) -> bf16[64,32] {
  %p0 = bf16[64,256]{1,0} parameter(0)
  %p1 = bf16[256,32]{1,0} parameter(1)
  %custom-call.1 = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(bf16[64,256]{1,0} %p0, bf16[256,32]{1,0} %p1), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/optimizer/dot_general"}
  %custom-call.2 = (bf16[64,32]{1,0}, u8[0]{0}) custom-call(bf16[64,256]{1,0} %p0, bf16[256,32]{1,0} %p1), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/encoder/attention/dot_product_attention"}
  %custom-call.3 = (bf16[64,32]{1,0}) custom-call(bf16[64,256]{1,0} %p0), custom_call_target="__cudnn$norm", metadata={op_name="jit(f)/encoder/attention/x"}
  ROOT %get-tuple-element = bf16[64,32]{1,0} get-tuple-element((bf16[64,32]{1,0}, s8[4194304]{0}) %custom-call.1), index=0
}
"""
  purposes = hlo.instruction_purposes(text)
  assert purposes["custom-call.1"] == "matmul"
  assert purposes["custom-call.2"] == "attention: fused kernel"
  assert purposes["custom-call.3"] == "attention: mask, softmax"  # by its source path


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_NNT", "gemm"),
    ("gemm_fusion_dot_154", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention (fused)"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*)", "attention (fused)"),
    ("pytorch_flash::flash_fwd_kernel<...>", "attention (fused)"),
    ("aten::addmm", "gemm"),
    ("triton_poi_fused_gelu_gelu_backward_view_9", "other (elementwise, reductions)"),
    ("input_add_reduce_fusion_7", "other (elementwise, reductions)"),
    ("Memset 0", "memcpy/memset"),
])
def test_kernel_kinds(name, kind):
  assert profiles.kernel_class(name) == kind


def test_a_block_waits_once_and_gives_its_mean():
  """Steps are dispatched back to back and the block waits for the last one only, as a
  training loop runs them; each step's time is the block's mean."""
  from bertjax.tools import timing
  dispatched, waited = [], []

  def dispatch():
    time.sleep(0.01)
    dispatched.append(len(dispatched))
    return len(dispatched)

  times = timing.block_times(dispatch, waited.append, 4)
  assert dispatched == [0, 1, 2, 3] and waited == [4]
  assert len(times) == 4 and len(set(times)) == 1 and times[0] >= 0.01


def test_waves_fit_their_slots_and_the_heavy_row_goes_with_few():
  jobs = gpu_session.plan(variants=("default", "triton-gemm"),
                          variant_rows=("BERT-large s512",))
  assert [j.slots for j in jobs] == [2, 2, 2, 3, 1]
  queue = list(jobs)
  waves = []
  while queue:
    waves.append([j.name for j in gpu_session._next_wave(queue, 5)])
  assert waves == [["BERT-large s512 / default", "GPT-2 medium s1024 / default"],
                   ["T5-base s512/114 / default", "GPT-2 XL s1024 / default"],
                   ["BERT-large s512 / triton-gemm"]]
  with pytest.raises(ValueError, match="unknown rows"):
    gpu_session.plan(rows=("GPT-2 tiny",))
  with pytest.raises(ValueError, match="unknown variants"):
    gpu_session.plan(variants=("fastest",))


def test_flags_of_a_variant_replace_the_same_flags():
  assert gpu_session.with_flags("--a=1 --xla_gpu_enable_triton_gemm=false",
                                "--xla_gpu_enable_triton_gemm=true") == (
      "--a=1 --xla_gpu_enable_triton_gemm=true")
  assert gpu_session.with_flags("", "") == ""


def test_a_timing_turn_waits_for_its_wave_to_compile(tmp_path):
  """A job times only once every job of its wave has compiled (no compile beside a timed
  step), and one job at a time (the lock)."""
  (tmp_path / "jobs").mkdir()
  mine, other = gpu_session.Job("BERT-large s512", "default", True), gpu_session.Job(
      "GPT-2 medium s1024", "default", True)
  for job in (mine, other):
    (tmp_path / "jobs" / f"{job.slug}.compiling").touch()
  entered = []

  def take_turn(job):
    with gpu_session.timing_turn(tmp_path, job, wait_seconds=30):
      entered.append((job.name, time.time()))
      time.sleep(0.3)

  first = threading.Thread(target=take_turn, args=(mine,))
  first.start()
  time.sleep(0.5)
  assert not entered  # the other job is still compiling
  second = threading.Thread(target=take_turn, args=(other,))
  second.start()  # its marker goes: both may time now, one after the other
  first.join(10)
  second.join(10)
  assert [name for name, _ in entered] == [mine.name, other.name]
  assert entered[1][1] - entered[0][1] >= 0.3


@pytest.mark.slow
def test_the_gpu_session_runs_reduced_on_cpu(tmp_path, capsys):
  """The command a lent GPU runs, at toy size: two rows against transformers and a variant in
  their waves, the tier (skipping here), the page, the JSON and the traces' archive."""
  from bertjax import cli
  out = tmp_path / "session"
  code = cli.main(["bench", "--gpu-session", str(out), "--reduced", "--steps", "1", "--pairs",
                   "1", "--rows", "BERT-large s512,T5-base s512/114", "--variants",
                   "triton-gemm", "--variant-rows", "BERT-large s512", "--tier-select",
                   "bf16_policy", "--max-jobs", "4", "--seconds", "600"])
  assert code == 0, (out / "gpu-session.md").read_text()
  session = json.loads((out / "gpu-session.json").read_text())
  records = {(r["job"]["row"], r["job"]["variant"]): r for r in session["jobs"]}
  assert set(records) == {("BERT-large s512", "default"), ("T5-base s512/114", "default"),
                          ("BERT-large s512", "triton-gemm")}
  assert not [r["error"] for r in records.values() if "error" in r]
  bert = records[("BERT-large s512", "default")]
  assert bert["median_ratio"] > 0 and bert["hf"]["step_seconds_median"] > 0
  assert "matmul" in bert["profile"]["by_purpose"] and bert["hf_profile"]["top_kernels"]
  variant = records[("BERT-large s512", "triton-gemm")]
  assert "--xla_gpu_enable_triton_gemm=true" in variant["job"]["xla_flags"]
  assert "hf" not in variant
  tier = session["tier"]
  assert [t["name"] for t in tier["tests"]] == [
      "test_the_bf16_policy_writes_bf16_activations_and_float32_logits_here"]
  assert tier["tests"][0]["outcome"] == "skipped"  # no accelerator here
  page = (out / "gpu-session.md").read_text()
  for text in ("## The accelerator tier", "## The GPU table", "| BERT-large s512 |",
               "| T5-base s512/114 |", "## Variants of our step", "triton-gemm",
               "### BERT-large s512 / default", "**transformers**"):
    assert text in page, text
  with tarfile.open(out / "traces.tar.gz") as tar:
    names = tar.getnames()
  assert any(n.endswith("program.hlo.txt.gz") for n in names)
  assert any(n.endswith(".trace.json.gz") for n in names)
  assert f"page: {out / 'gpu-session.md'}" in capsys.readouterr().out
