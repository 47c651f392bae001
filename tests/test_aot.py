"""Ahead-of-time compilation of the train step for named TPU topologies.

Topology names, the HLO reader and the abstract batches are tested everywhere. Compiling needs
libtpu (the TPU compiler, `pip install 'bertjax[tpu]'`; no TPU is needed): without it those
tests skip with the reason in the skip and in a warning, so a missing libtpu is never silent.
Their models are small so that the three TPU compiles take about half a minute on 2 cores
(bert_base on v4-16 compiles in about 110 s; see the report's measurements).
"""


import numpy as np
import pytest

from bertjax.config import load_config
from bertjax.data import make_batches
from bertjax.tools import aot, hlo
from bertjax.tools import topology
from bertjax.tools.topology import GENERATIONS, parse_topology

GiB = 2 ** 30


@pytest.mark.parametrize("name, generation, chips, devices, topology, hbm_gib", [
    ("v2-8", "v2", 4, 8, "v2:2x2", 8),
    ("v3-32", "v3", 16, 32, "v3:4x4", 16),
    ("v4-8", "v4", 4, 4, "v4:2x2x1", 32),
    ("v4-16", "v4", 8, 8, "v4:2x2x2", 32),
    ("v4-64", "v4", 32, 32, "v4:2x4x4", 32),
    ("v4-128", "v4", 64, 64, "v4:4x4x4", 32),
    ("v5p-64", "v5p", 32, 32, "v5:2x4x4", 96),
    ("v5p-256", "v5p", 128, 128, "v5:4x4x8", 96),
    ("v5e-16", "v5e", 16, 16, "v5e:4x4", 16),
    ("v5litepod-16", "v5e", 16, 16, "v5e:4x4", 16),
    ("v5e-8", "v5e", 8, 8, "v5e:2x4", 16),
    ("v6e-64", "v6e", 64, 64, "v6e:8x8", 32),
    ("v6e-256", "v6e", 256, 256, "v6e:16x16", 32),
    ("v4:4x4x12", "v4", 192, 192, "v4:4x4x12", 32),
])
def test_topology_names(name, generation, chips, devices, topology, hbm_gib):
  spec = parse_topology(name)
  assert (spec.generation, spec.chips, spec.devices, spec.topology_name) == \
      (generation, chips, devices, topology)
  assert spec.hbm_per_device == pytest.approx(hbm_gib * GiB)
  assert spec.peak_flops_per_device * spec.devices == pytest.approx(
      GENERATIONS[generation].peak_per_chip * chips)


@pytest.mark.parametrize("name", ["v7-8", "v4-12", "v4-4", "tpu", "v4", "v5e:4x4x4", "a100-8"])
def test_unknown_topology_lists_the_accepted_forms(name):
  with pytest.raises(ValueError, match="accepted forms: v2-N, v3-N"):
    parse_topology(name)


HLO = """\
HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0}, f32[16,4]{1,0})->f32[8,4]{1,0}}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(13)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%fused_matmul (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %convolution.1 = f32[8,4]{1,0} convolution(%param_0, %param_1), dim_labels=bf_io->bf
}

%body (p.1: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p.1 = (s32[], f32[8,4]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i.1, %two)
  %x = f32[8,16]{1,0} constant({...})
  %w = f32[16,4]{1,0} constant({...})
  %fusion.1 = f32[8,4]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_matmul
  %all-reduce.1 = f32[8,4]{1,0} all-reduce(%fusion.1), replica_groups={}, to_apply=%add
  %ag-start = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%all-reduce.1), dimensions={0}
  %ag-done = f32[8,4]{1,0} all-gather-done(%ag-start)
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%next, %ag-done)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

ENTRY %main (x.1: f32[8,16], w.1: f32[16,4]) -> f32[8,4] {
  %x.1 = f32[8,16]{1,0} parameter(0)
  %w.1 = f32[16,4]{1,0} parameter(1)
  %dot.1 = f32[8,4]{1,0} dot(%x.1, %w.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c1 = s32[] constant(1)
  %init = (s32[], f32[8,4]{1,0}) tuple(%c1, %dot.1)
  %while.1 = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body
  %ar = (f32[8,4]{1,0}, f32[4]{0}) all-reduce(%dot.1, %b.1), replica_groups={}, to_apply=%add
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%while.1), index=1
}
"""


def test_hlo_reader_counts_matmuls_and_collectives_times_loop_trips():
  stats = hlo.analyze_hlo(HLO)
  matmul = 2 * 8 * 16 * 4
  # for (i = 1; i < 13; i += 2): 6 trips (the SPMD partitioner's windowed einsums step by 2)
  assert stats.matmul_flops == matmul * (1 + 6)  # the dot + 6 trips of the fused convolution
  assert stats.collectives == {"all-reduce": [7, (6 * 32 + 32 + 4) * 4],
                               "all-gather": [6, 6 * 32 * 4]}
  assert stats.unknown_trip_counts == 0


def test_convolution_flops_follow_xla_over_dilated_windows():
  # A batched matmul as the TPU compiler writes it: batch folded into a base-dilated window,
  # one valid input element per output position: 2 * 32 * 12 * 128 * 128 * 64 FLOPs.
  ins = hlo._parse_instr(
      "  %c = f32[32,12,128,128]{2,3,1,0} convolution(%a, %b), window={size=32x12 "
      "stride=31x11 lhs_dilate=32x12}, dim_labels=0b1f_0o1i->01bf")
  shapes = {"a": "f32[32,128,12,64]{3,2,1,0}", "b": "f32[32,128,12,64]{3,2,1,0}"}
  assert hlo._conv_flops(ins, shapes) == 2 * 32 * 12 * 128 * 128 * 64


@pytest.mark.parametrize("name", ["bert_tiny", "gpt_tiny"])
def test_abstract_batch_matches_the_data_pipeline(name):
  config = load_config(name, [("data.source", "synthetic_markov")])
  real = next(make_batches(config, "train", range(config.batch_size)))
  abstract = aot.abstract_batch(config)
  assert {k: (v.shape, np.dtype(v.dtype)) for k, v in abstract.items()} == \
      {k: (v.shape, v.dtype) for k, v in real.items()}


def test_missing_libtpu_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(topology, "libtpu_available", lambda: False)
  with pytest.raises(RuntimeError, match=r"pip install 'bertjax\[tpu\]'"):
    aot.compile_for_topology(load_config("bert_tiny"), "v4-16")


@pytest.mark.slow
def test_bert_compiles_for_v4_16_fits_and_flops_match(libtpu):
  report = aot.compile_for_topology(load_config("bert_tiny"), "v4-16")
  assert report.fits and report.shortfall_bytes == 0
  assert report.topology.devices == 8 and report.mesh == {"data": 8, "fsdp": 1, "tensor": 1}
  assert 0 < report.total_bytes < report.hbm_bytes
  # No duplicated compute under sharding (the analytic count is a little generous).
  assert 0.9 < report.flops_ratio <= 1.05
  assert "all-reduce" in report.collectives  # the gradient all-reduce of data parallelism
  text = aot.format_report(report)
  assert "fits          yes" in text and "ratio" in text


@pytest.mark.slow
def test_fsdp_gpt_on_v5p_gathers_weights(libtpu):
  config = load_config("gpt_tiny", [("mesh.data", "1"), ("mesh.fsdp", "-1")])
  report = aot.compile_for_topology(config, "v5p-16")
  assert report.fits and report.mesh["fsdp"] == 8
  assert 0.9 < report.flops_ratio <= 1.05
  assert "all-gather" in report.collectives


def test_a_config_that_cannot_fit_says_by_how_much(libtpu):
  # 1.7B parameters, pure data parallel on v5e (16 GiB): fp32 weights and Adam moments alone
  # are 18.8 GiB per device. (On v4-8's 32 GiB the compiler squeezes the same model in by
  # rematerialising, 1.2x the FLOPs, after 4 minutes of compiling.)
  config = load_config("gpt_tiny", [("model.num_layers", "2"), ("model.hidden_size", "8192"),
                                    ("model.num_heads", "32"), ("model.mlp_dim", "32768")])
  report = aot.compile_for_topology(config, "v5e-4")
  assert not report.fits
  assert report.total_bytes > 18 * GiB and 0 < report.shortfall_bytes < report.total_bytes
  assert report.hbm_bytes <= 16 * GiB  # what the compiler may use (HBM less reserved)
  assert report.flops_ratio == pytest.approx(1.0, abs=0.05)  # from the unpartitioned program
  assert "NO: short by" in aot.format_report(report)


def test_a_mesh_that_does_not_divide_the_topology_is_named(libtpu):
  config = load_config("bert_tiny", [("mesh.tensor", "3")])
  with pytest.raises(ValueError, match=r"mesh .*'tensor': 3.* does not divide v4-16 \(8 devices\)"):
    aot.compile_for_topology(config, "v4-16")
  config = load_config("bert_tiny", [("mesh.data", "4"), ("mesh.fsdp", "4")])
  with pytest.raises(ValueError, match="v4-16 .8 devices.*What works"):
    aot.compile_for_topology(config, "v4-16")


def test_a_batch_that_does_not_divide_the_data_ways_is_named(libtpu):
  config = load_config("bert_tiny", [("batch_size", "12")])
  with pytest.raises(ValueError, match="batch_size=12 .* 8 data-parallel ways"):
    aot.compile_for_topology(config, "v4-16")


@pytest.mark.slow
def test_compile_command_phase_two_and_exit_status(libtpu, capsys):
  from bertjax import cli
  assert cli.main(["compile", "--config", "bert_tiny_two_phase", "--topology", "v4-16",
                   "--step", "240"]) == 0
  out = capsys.readouterr().out
  assert "(phase 2 at step 240)" in out and "batch           32 x 128 tokens" in out
  assert "fits          yes" in out
  code = cli.main(["compile", "--config", "gpt_tiny", "--topology", "v5e-4",
                   "--config.model.num_layers=2", "--config.model.hidden_size=8192",
                   "--config.model.num_heads=32", "--config.model.mlp_dim=32768"])
  assert code == 1
  assert "does not fit" in capsys.readouterr().err
  code = cli.main(["compile", "--config", "bert_tiny", "--topology", "v4-16",
                   "--config.mesh.tensor=3"])
  assert code == 2 and "does not divide v4-16" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_prints_what_each_host_loads_on_one_slice_and_on_two(libtpu, capsys):
  """The pre-flight line for a single slice, and a 2-slice job (data parallel across the
  slices over DCN, FSDP within each) that compiles."""
  from bertjax import cli
  assert cli.main(["compile", "--config", "bert_tiny", "--topology", "v4-16"]) == 0
  out = capsys.readouterr().out
  assert ("hosts           2 x 4 devices; each loads 16 of 32 rows (0.5 of the documents); "
          "row sets disjoint and complete") in out
  assert cli.main(["compile", "--config", "gpt_tiny", "--topology", "v5e-16", "--slices", "2",
                   "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.batch_size=64",
                   "--config.sharding_rules=fsdp"]) == 0
  out = capsys.readouterr().out
  assert "x 2 slices over DCN (32 devices)" in out
  assert "mesh            {'data': 2, 'fsdp': 16, 'tensor': 1}" in out
  assert ("hosts           8 x 4 devices in 2 slices; each loads 8 of 64 rows (0.125 of "
          "the documents); row sets disjoint and complete") in out
  assert "fits          yes" in out


@pytest.mark.slow
def test_a_2_slice_gradient_all_reduce_crosses_slices(libtpu):
  """Data parallel across 2 slices: the compiled program all-reduces the gradients."""
  config = load_config("bert_tiny", [("mesh.data", "-1")])
  report = aot.compile_for_topology(config, "v4-16", num_slices=2)
  assert report.mesh == {"data": 16, "fsdp": 1, "tensor": 1}
  assert report.topology.total_devices == 16 and report.fits
  assert "all-reduce" in report.collectives
  assert 0.9 < report.flops_ratio <= 1.05


@pytest.mark.slow
def test_splash_attention_compiles_into_the_tpu_program(libtpu):
  """model.attention=auto without attention dropout picks the Pallas splash kernel for a TPU
  topology (compiled, not interpreted, under shard_map); the report says so and projects
  compute and communication time."""
  config = load_config("gpt_tiny", [("model.attention_dropout", "0.0"),
                                    ("mesh.data", "2"), ("mesh.fsdp", "2"), ("mesh.tensor", "2")])
  report = aot.compile_for_topology(config, "v5e-8")
  assert report.fits and report.attention == "splash"
  assert any("Pallas kernel call(s)" in note for note in report.notes)
  # The attention core is in the kernel, not among the dots: compiled < model FLOPs.
  assert 0.8 < report.flops_ratio < 1.0
  assert report.communication_seconds > 0 and report.compute_seconds > 0
  assert report.projected_step_seconds == max(report.compute_seconds,
                                               report.communication_seconds)
  text = aot.format_report(report)
  assert "attention=splash" in text and "at 400 GB/s ICI" in text and "-bound" in text


@pytest.mark.parametrize("attrs,group", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", 4),
    ("replica_groups=[2,4]<=[8], dimensions={0}", 4),
    ("replica_groups=[16,4]<=[4,16]T(1,0)", 4),
    ("replica_groups={}, to_apply=%add", None),
])
def test_replica_group_sizes_and_ring_wire_bytes(attrs, group):
  assert hlo._group_size(attrs) == group
  n = 8
  # Ring algorithms: a device sends (n-1)/n of an all-gather's result, of a reduce-scatter's
  # input, and twice that of an all-reduce.
  assert hlo._wire_bytes("all-gather", 800.0, n) == 700.0
  assert hlo._wire_bytes("reduce-scatter", 100.0, n, full=800.0) == 700.0
  assert hlo._wire_bytes("all-reduce", 800.0, n) == 1400.0
  assert hlo._wire_bytes("collective-permute", 800.0, n) == 800.0
  # The reader's total: with no group stated the whole size counts (all devices, large n).
  stats = hlo.analyze_hlo(HLO)
  assert stats.wire_bytes == 2 * stats.collectives["all-reduce"][1] + stats.collectives[
      "all-gather"][1]
