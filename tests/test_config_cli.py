"""Config loading and overrides; the `bertjax` CLI: info, init, import, export."""

import subprocess
import sys

import numpy as np
import pytest

import hf_models
from bertjax import cli, config as config_lib
from bertjax.checkpoints import params as checkpoint
from bertjax.tools.param_report import matches_reference, param_breakdown

# Paper counts (Devlin et al. 2019; Radford et al. 2019 as corrected in the released models;
# Liu et al. 2019; Brown et al. 2020, Table 2.1) and the tolerance each is checked to:
# within 2% for the GPT-3 table, whose figures are rounded labels; BERT-large's "340M" is
# 336.2M, 1.1%, in every implementation.
PAPER_COUNTS = {"bert_base": (110e6, 0.01), "bert_large": (340e6, 0.012),
                "bert_large_lamb": (340e6, 0.012), "roberta_base": (125e6, 0.01),
                "gpt1": (117e6, 0.01), "gpt2:size=small": (124e6, 0.01),
                "gpt2:size=medium": (355e6, 0.01), "gpt2:size=large": (774e6, 0.01),
                "gpt2:size=xl": (1558e6, 0.01), "gpt3:size=125m": (125e6, 0.02),
                "gpt3:size=350m": (350e6, 0.02), "gpt3:size=760m": (760e6, 0.02),
                "gpt3:size=1p3b": (1.3e9, 0.02), "gpt3:size=2p7b": (2.7e9, 0.02),
                "gpt3:size=6p7b": (6.7e9, 0.02), "gpt3:size=13b": (13e9, 0.02),
                # Portes et al. 2023; Warner et al. 2024 (whose figures are truncated: HF's
                # ModernBertForMaskedLM-base has 149,655,232, ours 2,306 more, NSP and the
                # unused layer-0 norm scale). The extension stage has the same model.
                "mosaicbert": (137e6, 0.01), "modernbert:size=base": (149e6, 0.01),
                "modernbert:size=large": (395e6, 0.01),
                "modernbert:size=base,stage=extension": (149e6, 0.01),
                "modernbert:size=large,stage=extension": (395e6, 0.01),
                # Clark et al. 2020, Table 1: the discriminators, rounded (14M is 13.55M, to the
                # million; transformers' ElectraForPreTraining counts exactly ours).
                "electra:size=small": (14e6, 0.035), "electra:size=base": (110e6, 0.01),
                "electra:size=large": (335e6, 0.01),
                # He et al. 2023's model cards: backbone + embedding, each rounded (xsmall's
                # "48M" table is 49.19M: 128,100 x 384).
                "deberta_v3:size=xsmall": (70e6, 0.013), "deberta_v3:size=small": (142e6, 0.01),
                "deberta_v3:size=base": (184e6, 0.01), "deberta_v3:size=large": (435e6, 0.01),
                # Lan et al. 2020, Tables 1 and 4, rounded to the million (base's "12M" is
                # 11.81M; transformers' AlbertForPreTraining counts exactly ours). xxlarge's
                # 235M is not reached by its stated shape: transformers counts 223.2M, as we do.
                "albert:size=base": (12e6, 0.016), "albert:size=large": (18e6, 0.01),
                "albert:size=xlarge": (60e6, 0.017), "albert:size=xxlarge": (235e6, 0.051),
                "albert:size=base,sharing=attention": (64e6, 0.01),
                "albert:size=base,sharing=ffn": (38e6, 0.01),
                "albert:size=base,sharing=none": (89e6, 0.01),
                # Joshi et al. 2020: BERT's shapes (cased vocabulary) plus the SBO head.
                "spanbert:size=base": (110e6, 0.013), "spanbert:size=large": (340e6, 0.01),
                # Sanh et al. 2019: 66M is DistilBertModel's 66.4M (ours adds the MLM head's
                # transform and NSP); distilgpt2's model card 82M.
                "distilbert": (66e6, 0.02), "distilgpt2": (82e6, 0.01),
                # Raffel et al. 2020 (60M, 220M, 770M, 3B, 11B) as transformers counts the
                # released T5 1.0 checkpoints, exactly ours; T5 1.1 as transformers 5 counts it
                # (tied head); Lewis et al. 2020 as transformers counts facebook/bart-*.
                **{f"t5:size={size}": (float(n), 1e-9) for size, n in (
                    ("small", 60_506_624), ("base", 222_903_552), ("large", 737_668_096),
                    ("3b", 2_851_598_336), ("11b", 11_307_321_344))},
                **{f"t5:size={size},version=1.1": (float(n), 1e-9) for size, n in (
                    ("small", 60_511_616), ("base", 222_903_552), ("large", 750_251_008),
                    ("xl", 2_783_959_040), ("xxl", 11_003_736_064))},
                "bart:size=base": (139_420_416.0, 1e-9), "bart:size=large": (406_291_456.0, 1e-9)}
# Counts a stated shape does not reach within rounding (their tolerance says by how much).
UNMATCHED = ("albert:size=xxlarge", "albert:size=base,sharing=none", "distilbert")
# Counts these papers truncate rather than round.
TRUNCATED = ("modernbert",)
# Every config a user can name: each file under configs/ with each variant it lists.
ALL_CONFIGS = sorted(f"{p.stem}:{v}" if v else p.stem
                     for p in config_lib.config_files()
                     for v in config_lib.file_variants(p.stem))


@pytest.mark.parametrize("name", PAPER_COUNTS)
def test_parameter_counts_match_papers(name):
  reference, tolerance = PAPER_COUNTS[name]
  config = config_lib.load_config(name)
  counts = param_breakdown(config_lib.model_config(config))  # eval_shape: abstract
  # Replaced-token detection: the papers count the discriminator (the generator is dropped).
  total = counts.get("discriminator", counts["total"])
  assert config.reference_params == reference
  assert abs(total / reference - 1) < tolerance, total
  if not name.startswith(("gpt3",) + TRUNCATED) and name not in UNMATCHED:
    assert matches_reference(total, int(reference)), total
  if name.startswith(TRUNCATED):
    assert int(reference) <= total < int(reference) + 1_000_000, total


def test_every_config_loads_and_builds_abstractly():
  """Every config under configs/ (each variant) loads, validates and builds its model without
  allocating."""
  names = ALL_CONFIGS
  assert len(names) >= 20, names
  for name in names:
    config = config_lib.load_config(name)
    counts = param_breakdown(config_lib.model_config(config))
    assert counts["total"] > 0 and config.batch_size % max(config.grad_accum_steps, 1) == 0
    if config.finetune.task:
      continue  # a fine-tune's model is its weights' (bertjax.training.finetuning checks it)
    assert config.seq_length <= config.model.max_positions, name
    if name not in (
        "bert_tiny", "gpt_tiny", "bert_tiny_two_phase", "cramming", "modernbert:size=tiny",
        "electra:size=tiny", "electra:size=tiny,objective=mlm", "t5:size=tiny",
        "bart:size=tiny"):
      assert name in PAPER_COUNTS, f"{name}: a paper config without a checked parameter count"


def test_matches_reference_uses_paper_precision():
  assert matches_reference(336_226_108, 340_000_000)  # 10M precision
  assert not matches_reference(346_000_000, 340_000_000)
  assert matches_reference(124_439_808, 124_000_000)  # 1M precision
  assert not matches_reference(125_000_000, 124_000_000)


def test_info_prints_paper_matching_counts(capsys):
  assert cli.main(["info", "--config", "configs/bert_base.py"]) == 0
  out = capsys.readouterr().out
  assert "110,106,428" in out and "matches at the paper's rounding" in out


def test_overrides_are_typed_and_unknown_keys_named(capsys):
  config = config_lib.load_config("bert_tiny", [("model.num_layers", "4"),
                                                ("model.hidden_dropout", "0"),
                                                ("model.scan_layers", "false"),
                                                ("sharding_rules", "fsdp")])
  assert config.model.num_layers == 4 and config.model.hidden_dropout == 0.0
  assert config.model.scan_layers is False and config.sharding_rules == "fsdp"
  with pytest.raises(KeyError, match="model.num_layer'; did you mean model.num_layers"):
    config_lib.load_config("bert_tiny", [("model.num_layer", "4")])
  with pytest.raises(ValueError, match="expected an integer"):
    config_lib.load_config("bert_tiny", [("model.num_layers", "four")])
  assert cli.main(["info", "--config", "bert_tiny", "--config.model.nope=1"]) == 2
  assert "unknown config key 'model.nope'" in capsys.readouterr().err


def test_split_overrides_accepts_both_spellings():
  rest, overrides = config_lib.split_overrides(
      ["info", "--config", "x.py", "--config.model.num_layers=4", "--config.seed", "3"])
  assert rest == ["info", "--config", "x.py"]
  assert overrides == [("model.num_layers", "4"), ("seed", "3")]


def test_split_overrides_needs_a_value():
  with pytest.raises(ValueError, match=r"--config.seed needs a value \(--config.seed=VALUE\)"):
    config_lib.split_overrides(["train", "--config.seed", "--workdir", "w"])
  with pytest.raises(ValueError, match="needs a value"):
    config_lib.split_overrides(["--config.seed"])
  # A negative number after a space is a value.
  assert config_lib.split_overrides(["--config.restore_step", "-1"])[1] == [("restore_step", "-1")]


def test_a_group_is_overridden_key_by_key():
  with pytest.raises(KeyError, match=r"'optimizer' is a group; override one of its keys \(e.g. "
                     r"optimizer\.\w+\)"):
    config_lib.load_config("bert_tiny", [("optimizer", "{}")])


def test_overrides_apply_after_the_variant():
  config = config_lib.load_config("gpt3:size=13b,runlocal", [("model.num_layers", "3")])
  assert config.model.num_layers == 3 and config.model.hidden_size == 128


def test_invalid_model_group_fails_early():
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    config_lib.load_config("bert_tiny", [("model.num_heads", "3")])


@pytest.mark.parametrize("command", ["info", "init", "import", "export"])
def test_every_subcommand_has_useful_help(command):
  out = subprocess.run([sys.executable, "-m", "bertjax", command, "--help"], check=True,
                       capture_output=True, text=True).stdout
  assert "example" in out and len(out) > 300


def test_every_help_page_formats():
  """Each subcommand's --help, nested ones too, in this process: a help text with a bare % (a
  recipe's "6% warmup") made `bertjax finetune --help` a traceback."""
  import argparse
  pages = [cli._parser()]
  while pages:
    parser = pages.pop()
    assert len(parser.format_help()) > 100, parser.prog
    for action in parser._actions:
      if isinstance(action, argparse._SubParsersAction):
        pages.extend(action.choices.values())


def test_import_export_cli_roundtrip(tmp_path, capsys):
  ref = hf_models.bert(tmp_path / "hf")
  (tmp_path / "hf" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
  assert cli.main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "params")]) == 0
  assert "imported BertForPreTraining" in capsys.readouterr().out
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "hf",
                   "--out", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / "vocab.txt").exists()
  reloaded = hf_models.transformers.BertForPreTraining.from_pretrained(tmp_path / "out").eval()
  ids, types, mask, _ = hf_models.batch(101)
  a = hf_models.run(ref, input_ids=ids, token_type_ids=types, attention_mask=mask)
  b = hf_models.run(reloaded, input_ids=ids, token_type_ids=types, attention_mask=mask)
  np.testing.assert_array_equal(a.prediction_logits.numpy(), b.prediction_logits.numpy())
  # A params-only export cast to bf16 restores with bf16 leaves.
  assert cli.main(["export", "--params", str(tmp_path / "params"), "--format", "params",
                   "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
  params, cfg = checkpoint.load_params(tmp_path / "bf16")
  assert cfg.param_dtype == "bfloat16"
  assert {str(x.dtype) for x in __import__("jax").tree.leaves(params)} == {"bfloat16"}


def test_init_writes_a_sharded_checkpoint_that_exports(tmp_path):
  assert cli.main(["init", "--config", "gpt_tiny", "--config.mesh.fsdp=2",
                   "--out", str(tmp_path / "p")]) == 0
  params, cfg = checkpoint.load_params(tmp_path / "p")
  assert cfg.family == "gpt" and cfg.num_layers == 2
  assert cli.main(["export", "--params", str(tmp_path / "p"), "--out",
                   str(tmp_path / "hf")]) == 0
  model = hf_models.transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
  assert model.config.n_layer == 2


def test_export_of_missing_directory_is_a_clear_error(tmp_path, capsys):
  assert cli.main(["export", "--params", str(tmp_path / "nope"), "--out",
                   str(tmp_path / "o")]) == 2
  assert "is not a bertjax params directory" in capsys.readouterr().err


def test_command_keeps_freed_memory_and_asks_for_huge_pages_only_where_it_helps(tmp_path,
                                                                                   monkeypatch):
  """The `bertjax` command re-executes itself once with glibc tunables that keep freed memory
  in the process (one arena, no mmap'd blocks, no trimming), plus huge pages when the kernel's
  THP mode is "madvise" (docs/performance.md: page faults on every step's temporaries); never
  twice, never against a tunable the user chose, never off Linux or when turned off, and only
  for commands that run steps on the CPU: not for a TPU compile or data work (the single
  arena slows the compiler's threads) nor where JAX computes on a TPU or GPU."""
  import sys
  from bertjax.__main__ import malloc_environment
  retain = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
            "glibc.malloc.trim_threshold=1099511627776")
  monkeypatch.setattr(sys, "platform", "linux")
  mode = tmp_path / "enabled"
  mode.write_text("always [madvise] never\n")
  dev = tmp_path / "dev"
  dev.mkdir()

  def environment(environ, argv=("train", "--config", "bert_tiny"), thp=mode):
    return malloc_environment(list(argv), environ, str(thp), str(dev))

  env = environment({"PATH": "/bin"})
  assert env == {"PATH": "/bin", "GLIBC_TUNABLES": retain + ":glibc.malloc.hugetlb=1"}
  assert environment(env) is None  # already set: no second re-exec
  user = "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"
  assert environment({"GLIBC_TUNABLES": user}) == {
      "GLIBC_TUNABLES": user + ":glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"}
  assert environment({"BERTJAX_MALLOC_TUNABLES": "0"}) is None
  assert environment({}, thp=tmp_path / "missing") == {"GLIBC_TUNABLES": retain}
  mode.write_text("[always] madvise never\n")
  assert environment({}) == {"GLIBC_TUNABLES": retain}
  mode.write_text("always madvise [never]\n")
  assert environment({}) == {"GLIBC_TUNABLES": retain}
  mode.write_text("always [madvise] never\n")
  for command in ("compile", "data", "tokenizer", "info", "export", "import", "init", "plot"):
    assert environment({}, argv=(command, "--help")) is None, command
  assert environment({}, argv=()) is None
  for command in ("bench", "finetune", "eval", "doctor", "checkpoint-bench", "generate"):
    assert environment({}, argv=(command,)) is not None, command
  # Where JAX computes on an accelerator the temporaries are in its memory, not in this heap.
  assert environment({"JAX_PLATFORMS": "tpu"}) is None
  assert environment({"JAX_PLATFORMS": "cuda,cpu"}) is None
  (dev / "nvidia0").touch()
  assert environment({}) is None
  assert environment({"JAX_PLATFORMS": "cpu"}) is not None  # the user asked for the CPU
  monkeypatch.setattr(sys, "platform", "darwin")
  assert environment({"JAX_PLATFORMS": "cpu"}) is None


def test_the_host_says_which_platform_jax_will_compute_on_before_jax_starts(tmp_path):
  """TPU chips (v2-v4 /dev/accel0, v5e and later /dev/vfio/N) and GPUs (/dev/nvidiaN, ROCm's
  /dev/kfd) as device files, overridden by the first platform JAX_PLATFORMS names."""
  from bertjax.parallel import host
  dev = tmp_path / "dev"
  (dev / "vfio").mkdir(parents=True)
  (dev / "vfio" / "vfio").touch()  # the container file alone is no chip
  assert host.computes_on_cpu({}, str(dev))
  assert not host.tpu_chips_present(str(dev)) and not host.gpus_present(str(dev))
  (dev / "vfio" / "0").touch()
  assert host.tpu_chips_present(str(dev)) and not host.computes_on_cpu({}, str(dev))
  assert host.computes_on_cpu({"JAX_PLATFORMS": "cpu"}, str(dev))
  assert not host.computes_on_cpu({"JAX_PLATFORMS": "tpu,cpu"}, str(dev))
  for chip in ("accel0", "nvidia1", "kfd"):
    other = tmp_path / chip
    other.mkdir()
    (other / chip).touch()
    assert not host.computes_on_cpu({}, str(other)), chip
  assert (host.tpu_chips_present(str(tmp_path / "accel0")),
          host.gpus_present(str(tmp_path / "nvidia1")),
          host.gpus_present(str(tmp_path / "kfd"))) == (True, True, True)


def test_the_command_sets_its_measured_xla_flags_on_gpu_hosts_only(tmp_path):
  """`bertjax` adds GPU_XLA_FLAGS to XLA_FLAGS for the commands that run steps where JAX
  computes on a GPU; a flag the user set is theirs; BERTJAX_GPU_XLA_FLAGS=0 turns it off."""
  from bertjax.__main__ import GPU_XLA_FLAGS, gpu_xla_flags
  from bertjax.parallel import host
  dev = tmp_path / "dev"
  dev.mkdir()

  def flags(environ, argv=("train", "--config", "bert_tiny")):
    return gpu_xla_flags(list(argv), environ, str(dev))

  assert flags({}) is None  # no GPU here
  assert host.accelerator_platform(str(dev)) is None
  (dev / "nvidia0").touch()
  assert host.computes_on_gpu({}, str(dev)) and host.accelerator_platform(str(dev)) == "cuda"
  assert flags({}) == " ".join(GPU_XLA_FLAGS)
  assert "--xla_gpu_enable_triton_gemm=false" in GPU_XLA_FLAGS
  assert flags({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}) == "--xla_dump_to=/tmp/d " + " ".join(
      GPU_XLA_FLAGS)
  assert flags({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}) is None  # the user's
  assert flags({"BERTJAX_GPU_XLA_FLAGS": "0"}) is None
  assert flags({"JAX_PLATFORMS": "cpu"}) is None
  assert flags({"JAX_PLATFORMS": "cuda"}) is not None
  for command in ("compile", "data", "export", "import"):
    assert flags({}, argv=(command, "--help")) is None, command
  for command in ("bench", "finetune", "eval", "doctor", "generate"):
    assert flags({}, argv=(command,)) is not None, command
  (dev / "accel0").touch()  # a TPU VM: XLA:GPU flags are not for it
  assert flags({}) is None and host.accelerator_platform(str(dev)) == "tpu"
  assert host.computes_on_gpu({"JAX_PLATFORMS": "rocm"}, str(dev))


def test_a_config_imports_its_own_siblings_whatever_else_is_imported(monkeypatch):
  """configs/common.py comes first for a config file, before another module named `common`
  that a process has imported (launch/common.py is one), which is left in place."""
  import sys
  import types
  other = types.ModuleType("common")
  other.__file__ = "/elsewhere/common.py"
  monkeypatch.setitem(sys.modules, "common", other)
  assert config_lib.load_config("bert_base").optimizer.learning_rate == 1e-4
  assert sys.modules["common"] is other
