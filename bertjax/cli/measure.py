"""The commands that measure without training for real: `info` (parameter counts), `compile`
(a TPU slice's compiled step, on this machine), `bench`, `checkpoint-bench` and `doctor`. They
import bertjax.tools inside the handlers, so the CLI loads no tooling until one of them runs."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bertjax import config as config_lib
from bertjax.cli.common import EXIT_COMPILER_CRASH, EXIT_FAILED, EXIT_USAGE, OVERRIDES_EPILOG, Add

Overrides = list[tuple[str, str]]


def _human(n: int) -> str:
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.1f}{unit}"
  return str(n)


def cmd_info(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.tools.param_report import matches_reference, param_breakdown, trainable_report
  config = config_lib.load_config(args.config, overrides)
  model = config_lib.model_config(config)
  counts = param_breakdown(model)
  print(f"config         {args.config}")
  print(f"model          {model.family}: {model.num_layers} layers, width {model.hidden_size}, "
        f"{model.num_heads} heads (dim {model.head_dim}), MLP {model.mlp_dim}, "
        f"vocab {model.vocab_size}, positions {model.max_positions}")
  print(f"numerics       {model.norm_position}-LN, {model.activation}, eps "
        f"{model.layer_norm_eps:g}, dtype {model.dtype} (params {model.param_dtype}), "
        f"scan_layers={model.scan_layers}, remat={model.remat_policy}")
  print("parameters")
  groups = ("embeddings", "layers", "heads", "non_embedding", "total")
  for group in groups + (("generator", "discriminator") if "generator" in counts else ()):
    print(f"  {group:13s}{counts[group]:>15,d}  ({_human(counts[group])})")
  reference = int(config.get("reference_params", 0) or 0)
  # An RTD paper counts its discriminator, the model fine-tuned.
  counted = counts.get("discriminator", counts["total"])
  if reference:
    diff = (counted - reference) / reference
    verdict = ("matches at the paper's rounding" if matches_reference(counted, reference)
               else "within 1% of the paper's figure" if abs(diff) < 0.01
               else "DOES NOT match the paper's figure")
    print(f"  {'paper':13s}{reference:>15,d}  ({_human(reference)}; ours {diff:+.2%}, {verdict})")
  # Trainable against total under optimizer.freeze, with LoRA/adapters/prefixes per target.
  trainable = trainable_report(model, str(config.optimizer.get("freeze", "none")))
  if trainable:
    print(trainable)
  return 0


def cmd_compile(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.config import phases
  from bertjax.tools import aot
  config = config_lib.load_config(args.config, overrides)
  if args.step is not None:
    config = phases.config_at(config, args.step)
  if args.fit:
    return _compile_fit(args, overrides)
  import concurrent.futures
  try:
    report = aot.compile_in_child(config, args.topology, args.mfu, args.slices)
  # BrokenProcessPool is a RuntimeError subclass: it must come first.
  except concurrent.futures.process.BrokenProcessPool:
    print(f"bertjax compile: error: the TPU compiler (libtpu) crashed compiling "
          f"{args.config} for {args.topology}; known with libtpu 0.0.42 for "
          "model.dtype=bfloat16 with model.remat_policy=full or dots_no_batch (use dots, or "
          "float32)", file=sys.stderr)
    return EXIT_COMPILER_CRASH
  except RuntimeError as e:  # libtpu missing: say what to install
    print(f"bertjax compile: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  print(f"config         {args.config}"
        + (f" (phase {phases.phase_of(config, args.step) + 1} at step {args.step})"
           if args.step is not None else ""))
  print(aot.format_report(report))
  if not report.fits:
    print(f"bertjax compile: error: does not fit: {args.config} needs "
          f"{report.total_bytes / 2**30:.2f} GiB per device on {args.topology}, "
          f"{report.shortfall_bytes / 2**30:.2f} GiB more than the device's "
          f"{report.hbm_bytes / 2**30:.1f} GiB (try config.mesh.fsdp / config.mesh.tensor, "
          "config.model.remat_policy, config.grad_accum_steps, config.model.dtype=bfloat16)",
          file=sys.stderr)
    return EXIT_FAILED
  return 0


def _compile_fit(args: argparse.Namespace, overrides: Overrides) -> int:
  """`bertjax compile --fit`: search settings, one line per compile, then the winner's
  overrides (exit 0) or why none fits (exit 1)."""
  from bertjax.tools import fit, topology
  if not topology.libtpu_available():
    print(f"bertjax compile: error: {topology.LIBTPU_MISSING}", file=sys.stderr)
    return EXIT_USAGE
  if args.step is not None:
    print("bertjax compile: error: --fit searches the config as written; compile a later phase "
          "with its overrides (e.g. --config.seq_length=512) instead of --step", file=sys.stderr)
    return EXIT_USAGE
  print(f"searching settings of {args.config} that fit {args.topology} (one compile each):")
  best, trials = fit.search(args.config, overrides, args.topology, args.mfu, args.slices,
                            report=lambda trial: print(trial.line(), flush=True))
  if best is None:
    print(f"bertjax compile: error: no setting searched fits {args.topology}: "
          f"{sum(t.outcome == 'does not fit' for t in trials)} too large, "
          f"{sum(t.outcome == 'compiler crash' for t in trials)} compiler crash(es), "
          f"{sum(t.outcome == 'error' for t in trials)} refused (see the lines above); try a "
          "larger slice, more fsdp or tensor ways (config.mesh), or bf16 (model.dtype)",
          file=sys.stderr)
    return EXIT_FAILED
  changed = "model.attention_dropout" in best.overrides
  print(f"fastest fitting setting (projected step {best.step_ms:.1f} ms, "
        f"{best.total_gib:.2f} GiB per device)"
        + (": nothing fits with the recipe's attention dropout; this drops it (the fused "
           "attention kernel has none), a change of the recipe:" if changed else ":"))
  print("  " + " ".join(f"--config.{k}={v}" for k, v in best.overrides.items()))
  return 0


def _gpu_session(args: argparse.Namespace) -> int:
  from bertjax.tools import gpu_session
  split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
  try:
    jobs = gpu_session.plan(split(args.rows), ("default",) + split(args.variants),
                            split(args.variant_rows))
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  session = gpu_session.run_session(
      args.gpu_session, jobs=jobs, reduced=args.reduced, tier=args.tier,
      tier_select=args.tier_select,
      seconds=args.seconds, max_jobs=args.max_jobs, steps=args.steps, pairs=args.pairs,
      log=lambda line: print(line, file=sys.stderr, flush=True))
  print(f"page: {Path(args.gpu_session) / 'gpu-session.md'}")
  failed = [r["job"] for r in session["jobs"] if "error" in r]
  tier = session.get("tier") or {}
  return EXIT_FAILED if failed or tier.get("returncode") not in (None, 0, 5) else 0


def cmd_bench(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.tools import bench
  if args.gpu_session:
    return _gpu_session(args)
  if args.table:
    from bertjax.tools import bench_table
    rows = tuple(r for r in args.rows.split(",") if r)
    known = {r.name for r in bench_table.TABLES.get(args.table, ())}
    if args.table not in bench_table.TABLES or set(rows) - known:
      print(f"error: unknown table {args.table!r} or rows {sorted(set(rows) - known)}; tables: "
            + "; ".join(f"{t}: {', '.join(r.name for r in rs)}"
                        for t, rs in bench_table.TABLES.items()), file=sys.stderr)
      return EXIT_USAGE
    records = bench_table.run_table(
        args.table, reduced=args.reduced, steps=args.steps, pairs=args.pairs,
        torch_compile=args.torch_compile, rows=rows, json_path=args.json,
        log=lambda line: print(line, file=sys.stderr, flush=True))
    print(bench_table.format_table(records))
    if args.json:
      print(f"records written to {args.json}")
    return EXIT_FAILED if any("error" in r for r in records) else 0
  if not args.config:
    print("error: bench needs --config (or --table)", file=sys.stderr)
    return EXIT_USAGE
  config = config_lib.load_config(args.config, overrides)
  if args.time_to:
    from bertjax.tools import time_to
    try:
      target = time_to.parse_target(args.time_to)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return EXIT_USAGE
    try:
      record = time_to.time_to(args.config, overrides, target, workdir=args.workdir,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return EXIT_USAGE
    _report(record, time_to.format_record(record), args.json)
    return 0 if record["reached"] else EXIT_FAILED
  if args.decode:
    from bertjax.tools import decode_bench
    rows = decode_bench.decode_benchmark(config, [int(x) for x in args.decode.split(",")],
                                         new_tokens=args.new_tokens)
    print(decode_bench.format_decode_benchmark(rows))
    return 0

  def log(line):
    print(line, file=sys.stderr, flush=True)

  if args.compare == "integrity":
    from bertjax.tools import integrity_bench
    try:
      record = integrity_bench.integrity_overhead(config, steps=args.steps, pairs=args.pairs,
                                                  log=log)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return EXIT_USAGE
    _report(record, integrity_bench.format_record(record), args.json)
    return 0
  if args.compare == "guard":
    from bertjax.tools import guard_bench
    record = guard_bench.guard_overhead(config, steps=args.steps, pairs=args.pairs, log=log)
    _report(record, guard_bench.format_record(record), args.json)
    return 0
  if args.best and not args.compare:
    print("error: --best compares with a reference: add --compare hf", file=sys.stderr)
    return 2
  record = bench.run_benchmark(config, steps=args.steps, pairs=args.pairs,
                               compare=args.compare or None, best=args.best,
                               profile_dir=args.profile or None, log=log)
  _report(record, bench.format_record(record), args.json)
  return 0


def _report(record: dict, text: str, json_path: str) -> None:
  """A measurement's text on stdout, and its record at --json where asked."""
  from bertjax.tools import bench
  print(text)
  if json_path:
    bench.write_record(record, json_path)
    print(f"record written to {json_path}")


def cmd_checkpoint_bench(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.tools.checkpoint_bench import run_checkpoint_bench
  config = config_lib.load_config(args.config, overrides)
  logging.getLogger("bertjax").setLevel(logging.INFO)
  for line in run_checkpoint_bench(config, blocks=args.blocks, workdir=args.workdir):
    print(line, flush=True)
  return 0


def cmd_doctor(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.parallel import distributed
  from bertjax.tools import doctor
  config = config_lib.load_config(args.config, overrides)
  checks = tuple(c for c in args.checks.split(",") if c) if args.checks else doctor.CHECKS
  unknown = set(checks) - set(doctor.CHECKS)
  if unknown:
    print(f"error: unknown check(s) {', '.join(sorted(unknown))}; checks: "
          f"{', '.join(doctor.CHECKS)}", file=sys.stderr)
    return EXIT_USAGE
  distributed.initialize(config.distributed)
  import jax
  prefix = f"[host {jax.process_index()}] " if jax.process_count() > 1 else ""
  workdir = args.workdir or doctor.default_workdir()
  found = doctor.run_doctor(config, workdir, checks=checks, steps=args.steps,
                            projected_mfu=args.mfu,
                            report=lambda c: print(prefix + c.line(), flush=True))
  path = doctor.write_report(found, args.json or f"{workdir}/doctor.json", args.config)
  print(f"{prefix}doctor: {doctor.summary(found)}; report {path}")
  return EXIT_FAILED if any(c.status == "fail" for c in found) else 0


def register(add: Add) -> None:
  p = add("info", "print a config's model and parameter counts",
          "Builds the model abstractly (no memory is allocated) and prints its shape, numerics "
          "and parameter counts by group, next to the paper's count when the config states it.",
          "example:\n  bertjax info --config configs/bert_large.py\n\n" + OVERRIDES_EPILOG,
          cmd_info)
  p.add_argument("--config", required=True,
                 help="config file (configs/<name>.py) or the name of one under configs/")

  p = add("compile", "compile the train step for a TPU topology, on this machine",
          "Compiles the config's real train step (its mesh, shardings, batch, remat and "
          "accumulation) for a named Cloud TPU slice with libtpu's compile-only client, on a "
          "CPU machine, and prints per-device memory (arguments, temporaries, generated code, "
          "total against the chip's HBM, fits or not), the compiled FLOPs per step against the "
          "analytic model FLOPs, the collectives and their bytes, the compile time and a step "
          "time projected at --mfu. Before compiling it checks, for every host of the "
          "slice(s), which rows of each global batch that host would load (one line: hosts, rows "
          "each, disjoint and complete). Exit status 1 when it does not fit (the shortfall "
          "named), 2 when the mesh or the per-host layout does not work on the slice, 4 when "
          "the TPU compiler crashes. Needs libtpu (bertjax[tpu]), not a TPU.",
          "examples:\n  bertjax compile --config configs/bert_base.py --topology v4-16\n"
          "  bertjax compile --config configs/bert_large.py --topology v4-64 --step 900000\n"
          "  bertjax compile --config configs/gpt3.py:size=6p7b --topology v5p-256\n"
          "  bertjax compile --config configs/roberta_base.py --topology v5e-16 --slices 2\n"
          "  bertjax compile --config configs/gpt2.py:size=xl --topology v6e-16 --fit\n\n"
          + OVERRIDES_EPILOG, cmd_compile)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--topology", required=True,
                 help="Cloud TPU accelerator type: v2-8, v3-32, v4-16, v5p-256, v5e-16 "
                 "(v5litepod-16), v6e-64, ...")
  p.add_argument("--slices", type=int, default=1,
                 help="number of such slices in a multi-slice job (over the data-center "
                 "network; config.dcn_mesh splits the mesh axes over them)")
  p.add_argument("--step", type=int, default=None,
                 help="compile the phase this step trains in (e.g. BERT's phase 2 at 900000)")
  p.add_argument("--mfu", type=float, default=0.5,
                 help="fraction of the bf16 peak the matmuls are projected at (0.5)")
  p.add_argument("--fit", action="store_true",
                 help="search attention implementation, remat policy and micro-batches for "
                 "the fastest projected setting that fits, and print its overrides (one "
                 "compile per setting tried)")

  p = add("doctor", "check this machine or slice before paying for a run",
          "Runs, on every host of the run (one process each, as `bertjax train` runs): the "
          "environment and the mesh's per-host row layout; the platform's fused attention "
          "kernels against the XLA core (forward and gradients; padding, causal, packed and "
          "local-window masks; on CPU the splash kernel in interpret mode and the cuDNN call "
          "through XLA, said so); bf16 products against float32 and the matmul peaks; "
          "all-reduce, all-gather and reduce-scatter over each mesh axis, checked value by "
          "value and timed against the data sheet's interconnect; a few steps of the config "
          "(its runlocal shape where it does not fit) with MFU against the data sheet, the "
          "--mfu that calibrates `bertjax compile`; checkpoint write/read to the workdir; "
          "the loader's batches/s against the step's. One line per check (pass, warn, fail, "
          "skip), a JSON report, exit status 1 when a check fails. Guide: docs/doctor.md.",
          "examples:\n  bertjax doctor --config configs/bert_base.py\n"
          "  bertjax doctor --config configs/gpt2.py:size=medium --workdir gs://b/doctor\n"
          "  python launch/local.py --processes 2 --devices 4 -- bertjax doctor "
          "--config configs/gpt_tiny.py\n\n" + OVERRIDES_EPILOG, cmd_doctor)
  p.add_argument("--config", default="modernbert.py:size=tiny",
                 help="config file or name under configs/ (the README's main job)")
  p.add_argument("--workdir", default="",
                 help="where the checkpoint check writes (local or gs://) and the loader "
                 "check looks for WORKDIR/data/dataset; default a cache directory")
  p.add_argument("--json", default="", help="the report (default WORKDIR/doctor.json)")
  p.add_argument("--checks", default="",
                 help="comma-separated subset of: environment, attention, products, "
                 "collectives, speed, checkpoint, loader (default all)")
  p.add_argument("--steps", type=int, default=5, help="timed train steps (5)")
  p.add_argument("--mfu", type=float, default=0.5,
                 help="the MFU `bertjax compile` projects at, to compare with (0.5)")

  p = add("checkpoint-bench", "measure what asynchronous checkpointing costs",
          "Trains the config in alternating blocks of checkpoint.every steps, one starting with "
          "a save and one without, and prints the relative cost of saving (same process, so "
          "noise hits both).",
          "example:\n  bertjax checkpoint-bench --config configs/bert_tiny.py\n\n"
          + OVERRIDES_EPILOG, cmd_checkpoint_bench)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--blocks", type=int, default=4, help="blocks, half with a save (4)")
  p.add_argument("--workdir", default="", help="keep data and checkpoints here (temp)")

  p = add("bench", "measure the train step: throughput, MFU, and against transformers",
          "Measures, in one process: the device's matmul peak, our jitted train step's compile "
          "time and median step time on a synthetic batch of the config's shape, tokens/s, "
          "model FLOPs per step (6·N·tokens + attention + the vocabulary projection actually "
          "computed) next to the FLOPs XLA compiled, MFU and memory. --compare hf runs the "
          "same model, batch, AdamW and dropout in Hugging Face transformers (PyTorch), in the "
          "same precision (bf16: under torch.autocast), alternately with ours and prints the "
          "throughput ratio of each pair and their median; with --best both run in float32 "
          "and in bf16 and the fastest of each are compared. "
          "--decode measures generation instead: milliseconds per new token with the KV cache "
          "at each cache size, against recomputing the whole sequence.",
          "examples:\n  bertjax bench --config configs/bert_base.py --config.batch_size=8 "
          "--compare hf --json bert_base.json\n  bertjax bench --config configs/bert_base.py "
          "--config.batch_size=8 --compare hf --best\n"
          "  bertjax bench --config configs/gpt2.py:size=small "
          "--config.batch_size=2 --config.seq_length=1024 --compare hf\n"
          "  bertjax bench --config configs/gpt2.py:size=small --decode 128,512,1024\n"
          "  bertjax bench --config configs/modernbert.py:size=tiny "
          "--time-to 'eval/mlm_accuracy>=0.26' --json time_to.json\n\n"
          + OVERRIDES_EPILOG, cmd_bench)
  p.add_argument("--config", default="", help="config file or name under configs/")
  p.add_argument("--compare", choices=["hf", "guard", "integrity"], default="",
                 help="hf: also run the Hugging Face transformers (PyTorch) reference; guard: "
                      "our step with the spike guard against our step without it; integrity: "
                      "the integrity check at its cadence against the step, on the config's "
                      "mesh")
  p.add_argument("--best", action="store_true",
                 help="with --compare hf: time ours and the reference each in float32 and in "
                      "bf16 (the reference under torch.autocast) and compare the fastest of "
                      "each, and our bf16 step with our fp32 step")
  p.add_argument("--steps", type=int, default=5, help="timed steps per block (5)")
  p.add_argument("--pairs", type=int, default=3,
                 help="blocks of ours (each followed by one of the reference's) (3)")
  p.add_argument("--json", default="", help="also write the record here")
  p.add_argument("--profile", default="", metavar="DIR",
                 help="also profile 2 steps into DIR and split their op time by purpose "
                      "(matmul, dropout, layer norm, softmax, buffer fills, scan slicing, "
                      "optimizer...)")
  p.add_argument("--decode", default="",
                 help="GPT generation instead: comma-separated cache sizes, e.g. 128,512,1024")
  p.add_argument("--time-to", dest="time_to", default="", metavar="[SPLIT/]METRIC>=VALUE",
                 help="the wall time to train the config from a fresh workdir (`bertjax train` "
                 "in its own process, data and compile included) until an eval record meets "
                 "this, e.g. eval/mlm_accuracy>=0.26 (<= for losses); exit 1 if the run ends "
                 "first")
  p.add_argument("--workdir", default="", help="with --time-to: the (fresh) workdir; default: "
                 "a new temporary one")
  p.add_argument("--table", default="",
                 help="run a benchmark table instead of one config: gpu (BERT-large s512, "
                 "GPT-2 medium and XL s1024, bf16, against transformers; docs/performance.md)")
  p.add_argument("--reduced", action="store_true",
                 help="with --table: every row at toy size (the code path, on a CPU)")
  p.add_argument("--rows", default="", help="with --table: only these rows (comma-separated "
                 "names as the table prints them)")
  p.add_argument("--torch-compile", dest="torch_compile", action=argparse.BooleanOptionalAction,
                 default=True, help="with --table: the reference through torch.compile (on)")
  p.add_argument("--gpu-session", dest="gpu_session", default="", metavar="OUT",
                 help="a lent GPU's whole session into OUT: the accelerator tier, the gpu "
                 "table with profiles (ours and the reference's kernels), --variants, and the "
                 "results page OUT/gpu-session.md (docs/doctor.md)")
  p.add_argument("--variants", default="", help="with --gpu-session: variants of our step "
                 "to time beside each row (comma-separated; bertjax/tools/gpu_session.py)")
  p.add_argument("--variant-rows", dest="variant_rows", default="",
                 help="with --gpu-session: the rows the variants run on (default: all run)")
  p.add_argument("--tier", action=argparse.BooleanOptionalAction, default=True,
                 help="with --gpu-session: run the accelerator tier first (on)")
  p.add_argument("--tier-select", dest="tier_select", default="",
                 help="with --gpu-session: only the tier's tests this pytest -k expression "
                 "selects")
  p.add_argument("--seconds", type=float, default=450,
                 help="with --gpu-session: the session's deadline (450)")
  p.add_argument("--max-jobs", dest="max_jobs", type=int, default=4,
                 help="with --gpu-session: a wave's slots (4): a job against the reference "
                 "takes 2, ours alone 1, GPT-2 XL's one more")
  p.add_argument("--new-tokens", dest="new_tokens", type=int, default=32,
                 help="--decode: new tokens per timed generation (32)")
