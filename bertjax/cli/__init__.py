"""The `bertjax` command: one entry point, one subcommand per job.

Config overrides follow ml_collections' convention, `--config.model.num_layers=4`, and may
appear anywhere on the command line; an unknown key is an error naming it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Sequence

from bertjax.checkpoints import weights as weights_lib
from bertjax.cli import finetune as cli_finetune
from bertjax import config as config_lib
from bertjax import paths

_EPILOG_OVERRIDES = ("Any key of the config file can be overridden on the command line, e.g.\n"
                     "  --config.model.num_layers=4 --config.mesh.fsdp=2")


def _human(n: int) -> str:
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.1f}{unit}"
  return str(n)


def cmd_info(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
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
  for group in ("embeddings", "layers", "heads", "non_embedding", "total"):
    print(f"  {group:13s}{counts[group]:>15,d}  ({_human(counts[group])})")
  reference = int(config.get("reference_params", 0) or 0)
  if reference:
    diff = (counts["total"] - reference) / reference
    verdict = ("matches at the paper's rounding" if matches_reference(counts["total"], reference)
               else "within 1% of the paper's figure" if abs(diff) < 0.01
               else "DOES NOT match the paper's figure")
    print(f"  {'paper':13s}{reference:>15,d}  ({_human(reference)}; ours {diff:+.2%}, {verdict})")
  # Trainable against total under optimizer.freeze, with LoRA/adapters/prefixes per target.
  trainable = trainable_report(model, str(config.optimizer.get("freeze", "none")))
  if trainable:
    print(trainable)
  return 0


def cmd_compile(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
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


def _compile_fit(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  """`bertjax compile --fit`: search settings, one line per compile, then the winner's
  overrides (exit 0) or why none fits (exit 1)."""
  from bertjax.tools import aot, fit
  if not aot.libtpu_available():
    print(f"bertjax compile: error: {aot.LIBTPU_MISSING}", file=sys.stderr)
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


def cmd_generate(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.inference import generate
  from bertjax.data.tokenizers import load_tokenizer
  # Any weights: params-only, a workdir, a fine-tuned OUT/best (LoRA on its base included).
  weights = weights_lib.load_weights(args.params)
  params, model = weights.params, weights.config
  tokenizer_path = args.tokenizer or weights.tokenizer
  if tokenizer_path is None:
    raise ValueError(f"{args.params} holds no tokenizer/; pass --tokenizer")
  tokenizer = load_tokenizer(tokenizer_path)
  if model.family == "bert":
    for text in args.prompt:
      found = generate.fill_mask(params, model, tokenizer, text, top_k=args.top_k or 5)
      print(text)
      for slot in (found if isinstance(found[0], list) else [found]):
        for token, prob in slot:
          print(f"  {prob:.4f}  {token}")
    return 0
  stops = [tokenizer.token_id(t) for t in args.stop]
  if not args.stop and getattr(tokenizer, "style", None) == "gpt":
    stops = [tokenizer.token_id("<|endoftext|>")]
  prompts = [tokenizer.encode(p) for p in args.prompt]
  outputs = generate.generate(
      params, model, prompts,
      max_new_tokens=args.max_new_tokens, do_sample=args.sample,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      num_beams=args.num_beams, length_penalty=args.length_penalty,
      repetition_penalty=args.repetition_penalty,
      no_repeat_ngram_size=args.no_repeat_ngram_size, stop_tokens=stops, seed=args.seed)
  for text, prompt, new in zip(args.prompt, prompts, outputs):
    print(f"{text}{generate.continuation_text(tokenizer, prompt, new)}")
  return 0


def cmd_data_task(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  import json

  from bertjax.finetune.article_task import make_article_task
  summary = make_article_task(args.source, args.out, num_articles=args.articles,
                              train_sizes=args.train_sizes, dev_per_article=args.dev_per_article,
                              seed=args.seed)
  print(json.dumps(summary, indent=2))
  return 0


def cmd_data_qa_task(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  import json

  from bertjax.finetune.qa_task import make_qa_task
  summary = make_qa_task(args.source, args.out, num_train=args.train_questions,
                         num_dev=args.dev_questions, seed=args.seed)
  print(json.dumps(summary, indent=2))
  return 0


def cmd_train(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.training import loop
  from bertjax.training.metrics import TrainingDiverged
  config = config_lib.load_config(args.config, overrides)
  logging.getLogger("bertjax").setLevel(logging.INFO)
  try:
    loop.train_and_evaluate(config, args.workdir)
  except TrainingDiverged as e:
    print(f"bertjax train: {e}", file=sys.stderr)
    return EXIT_FAILED
  return 0


def cmd_plot(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.training import plot
  return plot.cmd_plot(args)


def cmd_init(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  import jax

  from bertjax.checkpoints import params as checkpoint

  from bertjax.parallel import sharding
  from bertjax.models import build_model, init_params
  config = config_lib.load_config(args.config, overrides)
  model_cfg = config_lib.model_config(config)
  mesh = sharding.mesh_from_config(config)
  rules = sharding.resolve_rules(config.sharding_rules)
  params, _ = sharding.sharded_init(functools.partial(init_params, build_model(model_cfg)),
                                    jax.random.key(config.seed), mesh, rules)
  out = checkpoint.save_params(args.out, params, model_cfg)
  print(f"wrote randomly initialised {model_cfg.family} parameters to {out}")
  return 0


def cmd_import(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax import hf
  from bertjax.checkpoints import params as checkpoint
  if overrides:
    raise ValueError("import takes no --config overrides (the HF config.json decides)")
  params, model_cfg, report = hf.import_hf(args.hf_dir, scan_layers=not args.no_scan)
  out = checkpoint.save_params(args.out, params, model_cfg)
  tokenizer = out / "tokenizer"
  tokenizer.mkdir(exist_ok=True)
  # Every tokenizer file, bertjax's own (spm.model, casing) included, so that an exported run
  # imports back with the same ids.
  copied = hf.copy_tokenizer_files(args.hf_dir, tokenizer)
  print(report.summary())
  print(f"wrote {out}" + (f" (tokenizer: {', '.join(copied)})" if copied else ""))
  return 0


def cmd_export(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax import hf
  from bertjax.checkpoints import params as checkpoint
  if overrides:
    raise ValueError("export takes no --config overrides")
  if bool(args.params) == bool(args.workdir):
    raise ValueError("give exactly one of --params DIR or --workdir DIR")
  if args.format == "peft" and args.workdir:
    raise ValueError("--format peft exports a fine-tuned OUT/best: give it with --params")
  if args.workdir:
    from bertjax.checkpoints.weights import run_params
    params, model_cfg, tokenizer, step = run_params(args.workdir, args.step)
    print(f"exporting step {step} of {args.workdir}")
  elif (paths.path(args.params) / weights_lib.FINETUNE_FILE).is_file() or args.format == "peft":
    return cli_finetune.export_finetuned(args)
  else:
    params, model_cfg = checkpoint.load_params(args.params)
    tokenizer = checkpoint.tokenizer_dir(args.params)
  dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype)
  if args.format == "hf":
    out = hf.export_hf(params, model_cfg, args.out, dtype, tokenizer)
    print(f"wrote a Hugging Face {hf.hf_config_dict(model_cfg)['architectures'][0]} directory "
          f"to {out} ({dtype})")
    if tokenizer is None:
      # Said here: AutoTokenizer on the export would fail much later, far from the cause.
      print(f"{args.params or args.workdir} has no tokenizer/: wrote weights only (a "
            "tokenizer/ holding spm.model or vocab.txt adds the files AutoTokenizer reads)")
  else:
    import jax
    import jax.numpy as jnp
    cast = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    params = jax.tree.map(lambda x: x.astype(cast), params)
    out = checkpoint.save_params(args.out, params, model_cfg.replace(param_dtype=dtype))
    if tokenizer:
      paths.copy_tree(tokenizer, out / "tokenizer")
      # The Hugging Face files too, so every export's tokenizer loads in `transformers`.
      hf.export_tokenizer(tokenizer, out / "tokenizer", model_cfg.max_positions)
    print(f"wrote a params-only checkpoint to {out} ({dtype})")
  return 0


def cmd_data_build(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.data.build import BuildOptions, build_dataset
  from bertjax.data.sources import parse_sources
  logging.getLogger("bertjax").setLevel(logging.INFO)
  options = BuildOptions(num_shards=args.num_shards, num_workers=args.workers,
                         eval_fraction=args.eval_fraction, process_index=args.process_index,
                         process_count=args.process_count, max_documents=args.max_documents,
                         language=args.language, lowercase=not args.cased,
                         dedup=not args.keep_duplicates)
  summary = build_dataset(parse_sources(args.source), args.tokenizer, args.out, options)
  print(f"built {args.out} (process {args.process_index} of {args.process_count})")
  for line in summary.lines():
    print("  " + line)
  return 0


def cmd_data_bench(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.tools.data_bench import run_bench
  logging.getLogger("bertjax").setLevel(logging.INFO)
  for line in run_bench(args.source or ["embedded"], tokenizer=args.tokenizer,
                        objective=args.objective, seq_length=args.seq_length,
                        batch_size=args.batch_size, workers=args.workers,
                        out=args.out):
    print(line)
  return 0


def cmd_checkpoint_bench(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.tools.checkpoint_bench import run_checkpoint_bench
  config = config_lib.load_config(args.config, overrides)
  logging.getLogger("bertjax").setLevel(logging.INFO)
  for line in run_checkpoint_bench(config, blocks=args.blocks, workdir=args.workdir):
    print(line, flush=True)
  return 0


def cmd_bench(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.tools import bench
  config = config_lib.load_config(args.config, overrides)
  if args.decode:
    from bertjax.tools import decode_bench
    rows = decode_bench.decode_benchmark(config, [int(x) for x in args.decode.split(",")],
                                         new_tokens=args.new_tokens)
    print(decode_bench.format_decode_benchmark(rows))
    return 0
  log = (lambda line: print(line, file=sys.stderr, flush=True))
  if args.best and not args.compare:
    print("error: --best compares with a reference: add --compare hf", file=sys.stderr)
    return 2
  record = bench.run_benchmark(config, steps=args.steps, pairs=args.pairs,
                               compare=args.compare or None, best=args.best,
                               profile_dir=args.profile or None, log=log)
  print(bench.format_record(record))
  if args.json:
    bench.write_record(record, args.json)
    print(f"record written to {args.json}")
  return 0


def cmd_tokenizer_train(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
  from bertjax.data.prepare import corpus_sentences
  from bertjax.data.sources import parse_sources
  from bertjax.data.tokenizers import train_sentencepiece
  logging.getLogger("bertjax").setLevel(logging.INFO)
  with paths.local_output(args.out) as local:  # SentencePiece writes local files
    train_sentencepiece(corpus_sentences(parse_sources(args.source), args.language), local,
                        vocab_size=args.vocab_size, model_type=args.model_type,
                        style=args.style, lowercase=args.lowercase,
                        character_coverage=args.character_coverage,
                        max_sentences=args.max_sentences)
  print(f"wrote a {args.style}-style {args.model_type} SentencePiece tokenizer "
        f"({args.vocab_size} pieces) to {paths.path(args.out)}")
  return 0


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="bertjax", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Pre-train BERT and GPT language models with JAX, from a CPU to TPU pods.",
      epilog=textwrap.dedent("""\
          examples:
            bertjax info --config configs/bert_base.py
            bertjax import path/to/hf_bert --out runs/bert_params
            bertjax export --params runs/bert_params --format hf --out runs/bert_hf
          Run `bertjax <command> --help` for each command's options."""))
  sub = parser.add_subparsers(dest="command", required=True, metavar="command")

  def add(name: str, help_: str, description: str, epilog: str,
          fn: Callable) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=description, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(fn=fn)
    return p

  p = add("info", "print a config's model and parameter counts",
          "Builds the model abstractly (no memory is allocated) and prints its shape, numerics "
          "and parameter counts by group, next to the paper's count when the config states it.",
          "example:\n  bertjax info --config configs/bert_large.py\n\n" + _EPILOG_OVERRIDES,
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
          + _EPILOG_OVERRIDES, cmd_compile)
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

  cli_finetune.add_commands(add)

  p = add("generate", "sample text from a GPT, or fill masks with a BERT",
          "GPT parameters: continues each --prompt with a KV cache in one jitted decode loop: "
          "greedy (default), sampling (--sample with --temperature/--top-k/--top-p, "
          "deterministic for --seed) or beam search (--num-beams, --length-penalty); "
          "--repetition-penalty and --no-repeat-ngram-size as in transformers; stops at "
          "--stop tokens (default: <|endoftext|> for GPT tokenizers). BERT parameters: fill-"
          "mask, the top-k tokens and probabilities at each [MASK] of each --prompt.",
          "examples:\n  bertjax generate --params runs/gpt_tiny/params --prompt 'The history of' "
          "--max-new-tokens 40 --sample --top-p 0.9 --seed 1\n  bertjax generate --params "
          "runs/gpt_tiny/params --prompt 'In 1850' --num-beams 4\n  bertjax generate --params "
          "runs/bert_tiny/params --prompt 'The [MASK] sat on the mat.' --top-k 5",
          cmd_generate)
  p.add_argument("--params", required=True, help="params checkpoint (bertjax export/import)")
  p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
  p.add_argument("--tokenizer", default="", help="tokenizer (default: the params' tokenizer/)")
  p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=32,
                 help="new tokens per prompt (32)")
  p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
  p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0)")
  p.add_argument("--top-k", dest="top_k", type=int, default=0,
                 help="sampling: keep the k most likely tokens; fill-mask: tokens shown (5)")
  p.add_argument("--top-p", dest="top_p", type=float, default=1.0,
                 help="nucleus sampling probability mass (1.0: off)")
  p.add_argument("--num-beams", dest="num_beams", type=int, default=1, help="beam search width")
  p.add_argument("--length-penalty", dest="length_penalty", type=float, default=1.0,
                 help="beam search length penalty exponent (1.0)")
  p.add_argument("--repetition-penalty", dest="repetition_penalty", type=float, default=1.0,
                 help="divide logits of tokens already present (1.0: off)")
  p.add_argument("--no-repeat-ngram-size", dest="no_repeat_ngram_size", type=int, default=0,
                 help="forbid repeating n-grams of this size (0: off)")
  p.add_argument("--stop", action="append", default=[], help="stop token (repeatable)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")

  p = add("train", "pre-train a model",
          "Runs the config's pre-training on every device of the config's mesh: one jitted, "
          "sharded train step, metrics to WORKDIR/metrics.jsonl, TensorBoard events to "
          "WORKDIR/tensorboard and a console line per log interval. Multi-host: run the same "
          "command on every host (see launch/).",
          "examples:\n  bertjax train --config configs/bert_tiny.py --workdir runs/bert_tiny\n"
          "  bertjax train --config configs/gpt_tiny.py --workdir runs/gpt --config.mesh.fsdp=2"
          "\n\n" + _EPILOG_OVERRIDES, cmd_train)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--workdir", required=True, help="directory for metrics and checkpoints")

  p = add("plot", "draw training runs' loss and accuracy curves into one PNG",
          "Reads each WORKDIR/metrics.jsonl (local or gs://) and draws the loss (train solid, "
          "eval dashed) and each accuracy logged (MLM and NSP for BERT, next-token for GPT) "
          "against the step: one colour per run, labelled by the workdir's name. `bertjax "
          "train` draws its own run into WORKDIR/metrics.png at each eval and at the end.",
          "examples:\n  bertjax plot runs/bert_tiny\n"
          "  bertjax plot runs/lr_1e-3 runs/lr_3e-4 --out lr.png", cmd_plot)
  from bertjax.training import plot as plot_lib  # cheap: matplotlib is imported when drawing
  plot_lib.add_arguments(p)

  p = add("init", "write a randomly initialised params checkpoint",
          "Initialises the config's model directly into its sharding on the config's mesh and "
          "writes a params-only checkpoint (model.json + Orbax params).",
          "example:\n  bertjax init --config configs/bert_tiny.py --out runs/tiny_init\n\n"
          + _EPILOG_OVERRIDES, cmd_init)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--out", required=True, help="new directory for the params checkpoint")

  p = add("import", "read a Hugging Face checkpoint into bertjax parameters",
          "Reads a `transformers` directory (config.json + model.safetensors, or a sharded "
          "safetensors index) of BertForPreTraining, BertForMaskedLM, BertModel, "
          "GPT2LMHeadModel or OpenAIGPTLMHeadModel and writes a bertjax params checkpoint. "
          "Heads absent from the checkpoint (e.g. NSP of a BertForMaskedLM) are freshly "
          "initialised and listed. Pickled .bin files are never loaded.",
          "example:\n  bertjax import ~/models/bert-base-uncased --out runs/bert_base_params",
          cmd_import)
  p.add_argument("hf_dir", help="directory with config.json and model.safetensors")
  p.add_argument("--out", required=True, help="new directory for the params checkpoint")
  p.add_argument("--no-scan", action="store_true",
                 help="keep layers unrolled (layers_0, layers_1, ...) instead of scanned")

  p = add("export", "export parameters for others to fine-tune",
          "Exports a params checkpoint, or the parameters of a training run's checkpoint "
          "(--workdir, optimizer state never read), as a Hugging Face directory (config.json + "
          "model.safetensors + tokenizer files) that `transformers` loads with "
          "BertForPreTraining / GPT2LMHeadModel / OpenAIGPTLMHeadModel.from_pretrained, or as "
          "another params-only checkpoint (e.g. cast to bf16). The tokenizer files (from the "
          "params' tokenizer/: tokenizer.json, tokenizer_config.json, special_tokens_map.json "
          "built from the run's SentencePiece model or vocab.txt, plus those files) load with "
          "AutoTokenizer and give bertjax's ids; a params checkpoint without tokenizer/ exports "
          "weights only. A fine-tuned OUT/best exports as its task's model "
          "(BertForSequenceClassification, ...ForTokenClassification, ...ForQuestionAnswering, "
          "the GPT LM head model; LoRA merged into the weights), or with --format peft as the "
          "unmerged LoRA adapter that peft.PeftModel loads over the base model's export.",
          "examples:\n  bertjax export --params runs/bert_params --format hf --out runs/bert_hf\n"
          "  bertjax export --workdir runs/bert --step 5000 --format params --out runs/b5k\n"
          "  bertjax export --params runs/bert_params --format params --dtype bf16 "
          "--out runs/bert_bf16\n  bertjax export --params runs/chat/best --format peft "
          "--out runs/chat_peft", cmd_export)
  p.add_argument("--params", help="params checkpoint directory")
  p.add_argument("--workdir", help="a training run's directory: export its checkpoint")
  p.add_argument("--step", type=int, default=None,
                 help="with --workdir: the checkpoint step (default: the latest)")
  p.add_argument("--format", choices=("hf", "params", "peft"), default="hf",
                 help="output format (peft: a LoRA fine-tune's unmerged adapter)")
  p.add_argument("--dtype", choices=("fp32", "bf16", "float32", "bfloat16"), default="fp32",
                 help="dtype of the exported weights")
  p.add_argument("--out", required=True, help="output directory")

  source_help = ("a corpus: kind:path[@weight][?key=value&...], kinds wikipedia, "
                 "wikiextractor, text, bert_lines, lines, jsonl, parquet, tfds; options "
                 "name, language, encoding, text_field, id_field, id_separator, keep_lists, "
                 "max_line_bytes, split, data_dir (docs/data.md); `embedded` is the packaged "
                 "Wikipedia sample (repeatable)")
  data = add("data", "build and benchmark training data",
             "Data commands: `build` turns raw corpora into a dataset of tokenized documents; "
             "`bench` measures the pipeline's throughput.",
             "examples:\n  bertjax data build --source embedded --tokenizer runs/spm "
             "--eval-fraction 0.05 "
             "--out runs/wiki\n  bertjax data bench --source embedded", None)
  data_sub = data.add_subparsers(dest="data_command", required=True, metavar="command")
  p = data_sub.add_parser(
      "build", help="raw corpora -> tokenized documents (ArrayRecord shards)",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Streams each source, cleans, splits sentences, tokenizes and writes one "
      "record per document (sentence boundaries kept) into NUM_SHARDS ArrayRecord shards per "
      "split, deterministically whatever the worker or process count. Multi-host: run with "
      "--process-index/--process-count on each host; each writes its own shards.",
      epilog="examples:\n  bertjax data build --source wikipedia:enwiki-latest-pages-articles"
      ".xml.bz2@0.75 --source text:books/@0.25 --tokenizer vocab.txt --out data/bert --workers 8"
      "\n  bertjax data build --source embedded --tokenizer runs/spm --eval-fraction 0.05 "
      "--out runs/wiki")
  p.set_defaults(fn=cmd_data_build)
  p.add_argument("--source", action="append", required=True, help=source_help)
  p.add_argument("--tokenizer", required=True,
                 help="vocab.txt (WordPiece) or a SentencePiece directory (spm.model)")
  p.add_argument("--out", required=True, help="dataset directory")
  p.add_argument("--num-shards", type=int, default=8, help="shards per split (default 8)")
  p.add_argument("--workers", type=int, default=0, help="worker processes (default 0)")
  p.add_argument("--eval-fraction", type=float, default=0.01,
                 help="documents held out for evaluation (default 0.01)")
  p.add_argument("--process-index", type=int, default=0, help="this build process (0)")
  p.add_argument("--process-count", type=int, default=1, help="build processes (1)")
  p.add_argument("--max-documents", type=int, default=0,
                 help="stop after this many documents per source (0: all)")
  p.add_argument("--language", default="en",
                 help="sentence segmentation language of sources without ?language= (en)")
  p.add_argument("--cased", action="store_true",
                 help="a vocab.txt of a cased model (no lower-casing)")
  p.add_argument("--keep-duplicates", action="store_true",
                 help="keep exact duplicate documents (dropped and counted by default)")

  p = data_sub.add_parser(
      "task", help="a labelled article-classification task from a corpus",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Which of K articles does a sentence come from? The K documents with the "
      "most sentences become the classes; balanced, seeded GLUE-style TSVs: dev.tsv and nested "
      "train_<n>.tsv (the fine-tuning transfer experiment of docs/finetuning.md).",
      epilog="example:\n  bertjax data task --source embedded --out runs/article_task")
  p.set_defaults(fn=cmd_data_task)
  p.add_argument("--source", default="embedded", help="a corpus spec (embedded)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--articles", type=int, default=4, help="number of classes (4)")
  p.add_argument("--train-sizes", dest="train_sizes", type=int, nargs="+",
                 default=[100, 1000], help="training set sizes (100 1000)")
  p.add_argument("--dev-per-article", dest="dev_per_article", type=int, default=100,
                 help="dev sentences per article (100)")
  p.add_argument("--seed", type=int, default=0, help="shuffle seed (0)")

  p = data_sub.add_parser(
      "qa-task", help="a SQuAD-format question-answering set from a corpus",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Cloze-style questions from a corpus's paragraphs (a sentence with a name, "
      "number or noun phrase replaced by what/when/who/how many; the paragraph is the "
      "context), split by article, seeded: train/dev SQuAD v1.1 JSON, and v2.0 files where a "
      "third of the questions are asked of a paragraph without the answer (the QA "
      "fine-tuning experiment of docs/finetuning.md).",
      epilog="example:\n  bertjax data qa-task --source embedded --out runs/qa")
  p.set_defaults(fn=cmd_data_qa_task)
  p.add_argument("--source", default="embedded", help="a corpus spec (embedded)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--train-questions", dest="train_questions", type=int, default=2000,
                 help="training questions (2000)")
  p.add_argument("--dev-questions", dest="dev_questions", type=int, default=300,
                 help="dev questions (300)")
  p.add_argument("--seed", type=int, default=0, help="seed (0)")

  p = data_sub.add_parser(
      "bench", help="measure tokens/s per core of the data pipeline",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Measures, on this machine, raw text -> instances (read, clean, split, "
      "tokenize, build, make instances) and built shards -> batches (the training loader), in "
      "tokens per second per core.",
      epilog="example:\n  bertjax data bench --source embedded --objective mlm_nsp")
  p.set_defaults(fn=cmd_data_bench)
  p.add_argument("--source", action="append", default=None, help=source_help)
  p.add_argument("--tokenizer", default="",
                 help="vocab.txt or SentencePiece dir (default: train one, not timed)")
  p.add_argument("--objective", default="mlm_nsp",
                 choices=("mlm_nsp", "mlm", "causal_lm"), help="instances to make")
  p.add_argument("--seq-length", type=int, default=128, help="sequence length (128)")
  p.add_argument("--batch-size", type=int, default=32, help="batch size (32)")
  p.add_argument("--workers", type=int, default=0, help="build/loader workers (0)")
  p.add_argument("--out", default="", help="keep the built dataset here (default: temp)")

  p = add("checkpoint-bench", "measure what asynchronous checkpointing costs",
          "Trains the config in alternating blocks of checkpoint.every steps, one starting with "
          "a save and one without, and prints the relative cost of saving (same process, so "
          "noise hits both).",
          "example:\n  bertjax checkpoint-bench --config configs/bert_tiny.py\n\n"
          + _EPILOG_OVERRIDES, cmd_checkpoint_bench)
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
          "--config.batch_size=8 --compare hf --best\n  bertjax bench --config configs/gpt2.py:size=small "
          "--config.batch_size=2 --config.seq_length=1024 --compare hf\n"
          "  bertjax bench --config configs/gpt2.py:size=small --decode 128,512,1024\n\n"
          + _EPILOG_OVERRIDES, cmd_bench)
  p.add_argument("--config", required=True, help="config file or name under configs/")
  p.add_argument("--compare", choices=["hf"], default="",
                 help="also run the Hugging Face transformers (PyTorch) reference")
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
  p.add_argument("--new-tokens", dest="new_tokens", type=int, default=32,
                 help="--decode: new tokens per timed generation (32)")

  tok = add("tokenizer", "train tokenizers",
            "Tokenizer commands: `train` fits a SentencePiece model on corpora.",
            "example:\n  bertjax tokenizer train --source embedded --vocab-size 8192 "
            "--out runs/spm", None)
  tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True, metavar="command")
  p = tok_sub.add_parser(
      "train", help="train a SentencePiece tokenizer",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Trains a SentencePiece unigram or BPE model on the sentences of the sources. "
      "BERT style: ids 0-4 are [PAD] [UNK] [CLS] [SEP] [MASK]; GPT style: an <|endoftext|> "
      "token and byte fallback. An existing WordPiece vocab.txt needs no training: pass it "
      "to `bertjax data build --tokenizer`.",
      epilog="examples:\n  bertjax tokenizer train --source embedded --vocab-size 8192 "
      "--out runs/spm\n  bertjax tokenizer train --source text:books/ --style gpt "
      "--model-type bpe --vocab-size 32000 --out runs/gpt_spm")
  p.set_defaults(fn=cmd_tokenizer_train)
  p.add_argument("--source", action="append", required=True, help=source_help)
  p.add_argument("--out", required=True, help="output directory (spm.model, spm.vocab)")
  p.add_argument("--vocab-size", type=int, default=30522, help="pieces (default 30522)")
  p.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram",
                 help="SentencePiece algorithm (unigram)")
  p.add_argument("--style", choices=("bert", "gpt"), default="bert", help="special tokens")
  p.add_argument("--lowercase", action="store_true", help="lower-case the text")
  p.add_argument("--max-sentences", type=int, default=2_000_000,
                 help="train on at most this many sentences (2M)")
  p.add_argument("--language", default="en",
                 help="sentence segmentation language of sources without ?language= (en)")
  p.add_argument("--character-coverage", type=float, default=0.9995,
                 help="share of characters the vocabulary must cover; rarer ones become "
                 "[UNK] (BERT style) or bytes (GPT style); 1.0 for small alphabets mixed "
                 "with a large one (0.9995)")
  return parser


# Exit statuses, the same for every command (docs/training.md has the table); 3, a peer
# process lost, is distributed.EXIT_PEER_LOST.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_COMPILER_CRASH = 0, 1, 2, 4


class _QuietLibraryNoise(logging.Filter):
  """Drops what Orbax and TensorStore print from their background threads when a checkpoint
  read or write fails: the failure reaches the command as an exception and is reported once,
  in one line; the same error logged (with its traceback) by each worker thread adds nothing."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
      return False
    return "exception was never retrieved" not in record.getMessage()


def _quiet_library_noise() -> None:
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_QuietLibraryNoise())
  default_hook = sys.unraisablehook

  def unraisable(info) -> None:
    # TensorStore callbacks that land after a failed Orbax operation closed its event loop.
    if isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(
        info.exc_value):
      return
    default_hook(info)

  sys.unraisablehook = unraisable


def main(argv: Sequence[str] | None = None) -> int:
  logging.basicConfig(level=logging.WARNING,
                      format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
  _quiet_library_noise()
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    rest, overrides = config_lib.split_overrides(argv)
  except ValueError as e:
    print(f"bertjax: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  args = _parser().parse_args(rest)
  try:
    return args.fn(args, overrides)
  except (KeyError, ValueError, OSError) as e:
    # A user's mistake or the machine's (a path, a config, a full disk): one line, no traceback.
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    print(f"bertjax {args.command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
