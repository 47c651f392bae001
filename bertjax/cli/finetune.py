"""The fine-tuning commands: `finetune` (the friendly front of a fine-tuning run of the one
training loop: `--recipe` presets and a flag per setting, bertjax.config.finetune), `eval`
(GLUE or SQuAD: a suite's tasks, several seeds each, one table: bertjax.finetune.suites) and
`fewshot`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bertjax.cli.common import EXIT_FAILED, Add
from bertjax.finetune.recipes import RECIPES, recipe_values

Overrides = list[tuple[str, str]]


def cmd_finetune(args: argparse.Namespace, overrides: Overrides) -> int:
  import json

  from bertjax.config.finetune import SETTINGS, finetune_run_config
  from bertjax.training.loop import train_and_evaluate
  from bertjax.training.metrics import TrainingDiverged
  logging.getLogger("bertjax").setLevel(logging.INFO)
  values = recipe_values(args.recipe) if args.recipe else {}
  values.update({name: getattr(args, name) for name in SETTINGS
                 if getattr(args, name) is not None})
  values.update(init_from=args.init_from, train=args.train, dev=args.dev)
  if args.mesh:
    values["mesh"] = _mesh(args.mesh)
  config = finetune_run_config(values, overrides)
  try:
    # Progress and the run's summary on stderr: stdout is the result, as JSON.
    result = train_and_evaluate(config, args.out, report=sys.stderr)
  except TrainingDiverged as e:
    print(f"bertjax finetune: {e}", file=sys.stderr)
    return EXIT_FAILED
  if "best_dir" not in result:  # preempted: saved, and the same command goes on
    print(json.dumps({"finished": False}))
    return 0
  print(json.dumps({k: v for k, v in result.items() if k not in ("history", "of")}, indent=2))
  return 0


def cmd_eval(args: argparse.Namespace, overrides: Overrides) -> int:
  import json

  from bertjax.config.finetune import SETTINGS, finetune_run_config
  from bertjax.finetune import suites
  from bertjax.training.loop import train_and_evaluate
  from bertjax.training.metrics import TrainingDiverged
  logging.getLogger("bertjax").setLevel(logging.INFO)
  name = f"eval {args.suite}"
  fixed = [key for key in suites.TASK_SETTINGS if getattr(args, key, None) is not None]
  if fixed:
    raise ValueError(f"{name}: --{fixed[0].replace('_', '-')} is set by each task")
  if args.rule not in suites.RULES:
    raise ValueError(f"--rule must be one of {', '.join(suites.RULES)}, got {args.rule!r}")
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    raise ValueError(f"--seeds: expected seeds like 0,1,2, got {args.seeds!r}") from None
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds: {args.seeds!r} repeats a seed")
  root = Path(args.data)
  tasks, missing = suites.present(suites.parse_tasks(args.suite, args.tasks), root)
  if not tasks:
    raise ValueError(f"{root}: no {args.suite} task's files found ({'; '.join(missing)})")
  for line in missing:
    print(f"bertjax {name}: skipped {line}", file=sys.stderr)
  user = {key: getattr(args, key) for key in SETTINGS if getattr(args, key, None) is not None}
  out = Path(args.out)
  results = []
  for task in tasks:
    per_seed = {}
    for seed in seeds:
      values = recipe_values(task.recipe)
      values.update(user)
      values.update(suites.settings(task, root, seed), init_from=args.init_from)
      if args.mesh:
        values["mesh"] = _mesh(args.mesh)
      print(f"bertjax {name}: {task.name}, seed {seed}", file=sys.stderr, flush=True)
      try:
        summary = train_and_evaluate(finetune_run_config(values, overrides),
                                     out / task.name / f"seed_{seed}", report=sys.stderr)
      except TrainingDiverged as e:
        print(f"bertjax {name}: {task.name}, seed {seed}: {e}", file=sys.stderr)
        return EXIT_FAILED
      if "best_dir" not in summary:  # preempted: saved; the same command goes on from here
        print(json.dumps({"finished": False}))
        return 0
      per_seed[seed] = suites.seed_scores(summary)
    results.append(suites.task_result(task, per_seed, args.rule))
  print("\n".join(suites.table(results)))
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{args.suite}_results.json"
  path.write_text(json.dumps(
      {"suite": args.suite, "data": str(root), "init_from": args.init_from, "rule": args.rule,
       "seeds": seeds, "skipped": missing, "tasks": results}, indent=2) + "\n")
  print(f"results: {path}")
  return 0


def _add_finetune_flags(p: argparse.ArgumentParser) -> None:
  """A flag per fine-tuning setting (bertjax.config.finetune.SETTINGS), typed like the config
  key it sets."""
  from bertjax.config.finetune import SETTINGS
  from bertjax.config.schema import finetune_config
  defaults = finetune_config()
  for name, (keys, help_text) in SETTINGS.items():
    node = defaults
    for part in keys[0].split("."):
      node = node[part]
    flag = "--" + name.replace("_", "-")
    shown = f" (default: {node})" if node not in ("", None) else ""
    # argparse formats help texts with %: a literal one (a setting's text) must be doubled.
    help_text = (help_text + shown).replace("%", "%%")
    if isinstance(node, bool) or name == "lowercase":  # lowercase: true | false | "" (unset)
      p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                     help=help_text)
    else:
      p.add_argument(flag, dest=name, type=type(node), default=None, help=help_text)


def cmd_fewshot(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.checkpoints.weights import load_weights
  from bertjax.data.tokenizers import load_tokenizer
  from bertjax.finetune import fewshot
  if overrides:
    raise ValueError("fewshot takes no --config overrides")
  weights = load_weights(args.params)
  if not weights.config.is_decoder:
    raise ValueError(f"{args.params}: few-shot evaluation needs a GPT, this is a "
                     f"{weights.config.family} model")
  tokenizer_path = args.tokenizer or weights.tokenizer
  if tokenizer_path is None:
    raise ValueError(f"{args.params} holds no tokenizer/; pass --tokenizer")
  verbal = None
  if args.verbalise:
    pairs = [part.split("=", 1) for part in args.verbalise.split(",")]
    bad = [p[0] for p in pairs if len(p) != 2 or not p[0] or not p[1]]
    if bad:
      raise ValueError(f"--verbalise: expected label=words[,label=words...], got {bad[0]!r}")
    verbal = dict(pairs)
  if not all(k.strip().isdigit() for k in args.k.split(",")):
    raise ValueError(f"--k: expected demonstration counts like 0,1,4,8, got {args.k!r}")
  ks = [int(k) for k in args.k.split(",")]
  if fewshot.is_multiple_choice(args.data):
    if verbal or args.sampling != "random":
      raise ValueError("--verbalise and --sampling balanced are for labelled sets; "
                       f"{args.data} is multiple choice")
    result = fewshot.evaluate_multiple_choice(
        weights.params, weights.config, load_tokenizer(tokenizer_path, require="gpt"),
        fewshot.read_multiple_choice(args.data),
        pool=fewshot.read_multiple_choice(args.pool) if args.pool else None, ks=ks,
        seed=args.seed)
    return _print_fewshot(result, f"chance {result['chance_baseline']:.4f}", args.json)
  result = fewshot.evaluate_fewshot(
      weights.params, weights.config, load_tokenizer(tokenizer_path, require="gpt"), args.data,
      pool=args.pool, ks=ks, verbalisations=verbal, sampling=args.sampling, seed=args.seed,
      text_column=args.text_column, label_column=args.label_column)
  return _print_fewshot(result, f"majority class {result['majority_baseline']:.4f}, chance "
                        f"{result['chance_baseline']:.4f}", args.json)


def _print_fewshot(result: dict, baselines: str, json_path: str | None) -> int:
  """The per-k table of a few-shot result, its baselines line, and the whole result as JSON at
  `json_path` when given."""
  import json
  print(f"{'k':>3}  {'accuracy':>8}  {'length-norm':>11}  {'demos used':>10}  n")
  for k, row in result["by_k"].items():
    print(f"{k:>3}  {row['accuracy']:>8.4f}  {row['accuracy_length_normalised']:>11.4f}  "
          f"{row['demonstrations']:>10.2f}  {row['n']}")
  print(baselines)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(result, f, indent=2, default=str)
  return 0


def _mesh(text: str) -> dict[str, str]:
  """--mesh "data=4,fsdp=2" as the fine-tuning settings' mesh axes."""
  return dict(part.split("=") for part in text.split(","))


def register(add: Add) -> None:
  p = add("finetune", "fine-tune BERT, GPT, T5 or BART on a task",
          "Fine-tunes pre-trained weights (a params checkpoint, a training run's directory or a "
          "Hugging Face directory): BERT on sentence or sentence-pair classification (GLUE), "
          "regression (STS-B) or token classification (NER), read from GLUE TSV, CSV or JSONL "
          "with named columns, or on extractive question answering (SQuAD v1.1/v2.0 JSON, "
          "--task question_answering: exact match and F1); GPT on prompt/completion or chat "
          "JSONL (--task completion: loss on the completions, dev perplexity, generations of "
          "the first dev prompts in OUT/generations.jsonl); T5 or BART on any of these as text "
          "to text (--task text_to_text: SQuAD as \"question: ... context: ...\" -> the answer, "
          "label words, prompt -> completion; scored on the greedy generation of every dev "
          "input). Devlin et al.'s recipe by default "
          "(AdamW lr 2e-5, batch 32, 3 epochs, 10% warmup then linear decay, weight decay "
          "0.01); --recipe picks a named preset (" + ", ".join(RECIPES) + "; join with +, "
          "e.g. completion+lora), flags override it, and any --config.KEY=VALUE too (the flags "
          "are keys of the run config: a fine-tune is a run of the training loop). Freezing, a "
          "separate head learning rate, LoRA / adapters / prefix tuning (--freeze base: only "
          "they and the head train and are saved) and early stopping on the dev metric. The dev "
          "set is scored and a checkpoint saved after every epoch: the same command resumes a "
          "killed run to the same result. Writes OUT/metrics.jsonl, TensorBoard events, "
          "OUT/checkpoints, the best parameters in OUT/best and, with --export-hf, a Hugging "
          "Face model in OUT/hf (LoRA merged) and the unmerged LoRA adapter for peft in "
          "OUT/peft; prints the summary as JSON (OUT/finetune_summary.json). OUT may be gs://.",
          "examples:\n  bertjax finetune --init-from runs/bert_tiny/params --train sst2/train.tsv "
          "--dev sst2/dev.tsv --out runs/sst2\n  bertjax finetune --init-from runs/bert_hf "
          "--train mrpc/train.tsv --dev mrpc/dev.tsv --text-a '#1 String' --text-b "
          "'#2 String' --label Quality --metric f1 --out runs/mrpc --export-hf\n"
          "  bertjax finetune --init-from runs/bert_tiny --task token_classification "
          "--train ner/train.jsonl --dev ner/dev.jsonl --freeze bottom:1 --out runs/ner\n"
          "  bertjax finetune --recipe squad --init-from runs/bert_hf --train "
          "squad/train-v1.1.json --dev squad/dev-v1.1.json --out runs/squad\n"
          "  bertjax finetune --recipe completion+lora --init-from runs/gpt_tiny/params "
          "--train chat/train.jsonl --dev chat/dev.jsonl --seq-length 128 --out runs/chat",
          cmd_finetune)
  p.add_argument("--recipe", default=None,
                 help="named preset(s) of the settings below, joined with +: "
                 + "; ".join(f"{k}: {v.purpose}" for k, v in RECIPES.items()).replace("%", "%%"))
  p.add_argument("--init-from", dest="init_from", required=True,
                 help="params checkpoint, training workdir or Hugging Face directory")
  p.add_argument("--train", required=True, help="training examples (.tsv, .csv, .jsonl)")
  p.add_argument("--dev", required=True, help="validation examples (same format)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--mesh", default="", help="mesh axis sizes, e.g. data=4,fsdp=2 (data=-1)")
  _add_finetune_flags(p)

  p = add("eval", "GLUE or SQuAD: fine-tune every task with several seeds, one table",
          "Runs the tasks of a suite found under --data, each fine-tuned from --init-from once "
          "per seed (bertjax.finetune.suites): glue, in GLUE's directory layout (CoLA/train.tsv, "
          "MNLI/dev_matched.tsv and dev_mismatched.tsv, ...; Devlin et al.'s recipe, regression "
          "for STS-B); squad, train-v1.1.json / dev-v1.1.json and train-v2.0.json / "
          "dev-v2.0.json (the squad recipe). Every fine-tuning flag applies to all tasks, except "
          "the columns, metric and task kind each task sets. A seed's score is its best epoch's "
          "on dev; a task's is the --rule over its seeds: median (RoBERTa, ELECTRA), best (BERT, "
          "ALBERT) or mean. Prints the table (every metric: MCC, F1 and accuracy, Pearson and "
          "Spearman, MNLI matched and mismatched; SQuAD F1 and exact match) and writes "
          "OUT/SUITE_results.json; each fine-tune's products are in OUT/TASK/seed_N, and the "
          "same command resumes a stopped suite.",
          "examples:\n  bertjax data glue --out runs/glue && bertjax eval glue --init-from "
          "runs/modernbert_tiny/params --data runs/glue --seeds 0,1,2 --rule median "
          "--out runs/glue_eval\n  bertjax data qa-task --out runs/qa && bertjax eval squad "
          "--init-from runs/modernbert_tiny/params --data runs/qa --out runs/squad_eval",
          cmd_eval)
  p.add_argument("suite", choices=("glue", "squad"), help="the evaluation suite")
  p.add_argument("--init-from", dest="init_from", required=True,
                 help="params checkpoint, training workdir or Hugging Face directory")
  p.add_argument("--data", required=True,
                 help="GLUE_DIR (one directory per task) or the SQuAD files' directory")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--tasks", default="all", help="comma-separated tasks of the suite (all; "
                 "glue: cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte,wnli; squad: squad1.1,squad2.0)")
  p.add_argument("--seeds", default="0,1,2,3,4", help="fine-tuning seeds (0,1,2,3,4)")
  p.add_argument("--rule", default="median", help="median | best | mean over the seeds")
  p.add_argument("--mesh", default="", help="mesh axis sizes, e.g. data=4,fsdp=2 (data=-1)")
  _add_finetune_flags(p)

  p = add("fewshot", "few-shot accuracy of a GPT on a labelled set, per k",
          "GPT-3-style in-context evaluation, no training: for each query of --data, k "
          "demonstrations drawn (seeded) from --pool (default: --data without the query) are "
          "written as '{text}\\nAnswer: {label}\\n\\n' before the query's '{text}\\nAnswer:', and "
          "the predicted label is the one whose verbalisation (--verbalise, default the label "
          "strings) has the highest log-likelihood. Multiple-choice JSONL ({\"query\", "
          "\"choices\": [...], \"gold\": index} per line, e.g. PIQA or HellaSwag converted) is "
          "scored the same way with each question's own choices, the right one in the "
          "demonstrations. Prints accuracy (and length-normalised accuracy) per k with the "
          "baselines; demonstrations that do not fit the model's positions are dropped and "
          "counted.",
          "example:\n  bertjax data task --out runs/task && bertjax fewshot --params "
          "runs/gpt_tiny/params --data runs/task/dev.tsv --pool runs/task/train_100.tsv "
          "--k 0,1,4", cmd_fewshot)
  p.add_argument("--params", required=True,
                 help="GPT weights: params checkpoint, workdir, fine-tuned OUT/best or HF dir")
  p.add_argument("--data", required=True,
                 help="labelled queries (.tsv, .csv, .jsonl) or multiple-choice .jsonl")
  p.add_argument("--pool", default=None, help="where demonstrations come from (default: --data)")
  p.add_argument("--k", default="0,1,4,8", help="demonstration counts (0,1,4,8)")
  p.add_argument("--text-column", dest="text_column", default="sentence",
                 help="text column (sentence)")
  p.add_argument("--label-column", dest="label_column", default="label",
                 help="label column (label)")
  p.add_argument("--verbalise", default="",
                 help="label=words pairs, comma-separated (default: the label strings)")
  p.add_argument("--sampling", choices=("random", "balanced"), default="random",
                 help="demonstration draw: uniform (GPT-3) or classes in turn")
  p.add_argument("--seed", type=int, default=0, help="demonstration draw seed (0)")
  p.add_argument("--tokenizer", default=None, help="tokenizer (default: the weights' own)")
  p.add_argument("--json", default=None, help="also write the full result here")
