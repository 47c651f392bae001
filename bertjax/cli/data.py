"""The data commands: `data build` / `task` / `qa-task` / `bench` and `tokenizer train`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from bertjax.cli.common import SOURCE_HELP, Add
from bertjax.data.options import BuildOptions

Overrides = list[tuple[str, str]]


def cmd_data_build(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.data.build import build_dataset
  from bertjax.data.sources import parse_sources
  logging.getLogger("bertjax").setLevel(logging.INFO)
  options = BuildOptions(num_shards=args.num_shards, num_workers=args.workers,
                         eval_fraction=args.eval_fraction, process_index=args.process_index,
                         process_count=args.process_count, max_documents=args.max_documents,
                         language=args.language, lowercase=not args.cased,
                         dedup=not args.keep_duplicates,
                         decontaminate=tuple(args.decontaminate or ()),
                         decontamination_ngram=args.decontamination_ngram)
  if args.runner:
    from bertjax.data import beam_build
    runner = beam_build.known_runner(args.runner)
    summary = beam_build.build_with_beam(
        parse_sources(args.source), args.tokenizer, args.out, options,
        beam_build.runner_args(runner, list(args.beam_option or ()), args.workers))
    print(f"built {args.out} (Apache Beam, {runner})")
  else:
    summary = build_dataset(parse_sources(args.source), args.tokenizer, args.out, options)
    print(f"built {args.out} (process {args.process_index} of {args.process_count})")
  for line in summary.lines():
    print("  " + line)
  return 0


def cmd_data_task(args: argparse.Namespace, overrides: Overrides) -> int:
  import json

  from bertjax.finetune.article_task import make_article_task
  summary = make_article_task(args.source, args.out, num_articles=args.articles,
                              train_sizes=args.train_sizes, dev_per_article=args.dev_per_article,
                              seed=args.seed)
  print(json.dumps(summary, indent=2))
  return 0


def cmd_data_glue(args: argparse.Namespace, overrides: Overrides) -> int:
  import json

  from bertjax.finetune.glue_task import make_glue_tasks
  summary = make_glue_tasks(args.source, args.out, train_size=args.train_size,
                            dev_size=args.dev_size, seed=args.seed)
  print(json.dumps(summary, indent=2))
  return 0


def cmd_data_qa_task(args: argparse.Namespace, overrides: Overrides) -> int:
  import json

  from bertjax.finetune.qa_task import make_qa_task
  summary = make_qa_task(args.source, args.out, num_train=args.train_questions,
                         num_dev=args.dev_questions, seed=args.seed)
  print(json.dumps(summary, indent=2))
  return 0


def cmd_data_bench(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.tools.data_bench import run_bench
  logging.getLogger("bertjax").setLevel(logging.INFO)
  for line in run_bench(args.source or ["embedded"], tokenizer=args.tokenizer,
                        objective=args.objective, seq_length=args.seq_length,
                        batch_size=args.batch_size, workers=args.workers,
                        out=args.out):
    print(line)
  return 0


def cmd_tokenizer_train(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax import paths
  from bertjax.data.prepare import corpus_sentences
  from bertjax.data.sentencepiece_training import train_sentencepiece
  from bertjax.data.sources import parse_sources
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


def _task_set(data_sub: Any, name: str, help_: str, description: str, epilog: str,
              fn: Callable[[argparse.Namespace, Overrides], int]) -> argparse.ArgumentParser:
  """A `bertjax data` command that makes task files from a corpus: its --source, --out and
  --seed (each command adds its sizes)."""
  p = data_sub.add_parser(name, help=help_, formatter_class=argparse.RawDescriptionHelpFormatter,
                          description=description, epilog=epilog)
  p.set_defaults(fn=fn)
  p.add_argument("--source", default="embedded", help="a corpus spec (embedded)")
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--seed", type=int, default=0, help="seed of the draws and splits (0)")
  return p


def register(add: Add) -> None:
  data = add("data", "build and benchmark training data",
             "Data commands: `build` turns raw corpora into a dataset of tokenized documents; "
             "`bench` measures the pipeline's throughput.",
             "examples:\n  bertjax data build --source embedded --tokenizer runs/spm "
             "--out runs/wiki\n  bertjax data bench --source embedded", None)
  data_sub = data.add_subparsers(dest="data_command", required=True, metavar="command")
  p = data_sub.add_parser(
      "build", help="raw corpora -> tokenized documents (record shards)",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Streams each source, cleans, splits sentences, tokenizes and writes one "
      "record per document (sentence boundaries kept) into NUM_SHARDS record shards per "
      "split, deterministically whatever the worker or process count. Multi-host: run with "
      "--process-index/--process-count on each host; each writes its own shards; or run it "
      "as an Apache Beam pipeline (--runner), the same bytes.",
      epilog="examples:\n  bertjax data build --source wikipedia:enwiki-latest-pages-articles"
      ".xml.bz2@0.75 --source text:books/@0.25 --tokenizer vocab.txt --out data/bert --workers 8"
      "\n  bertjax data build --source embedded --tokenizer runs/spm --out runs/wiki"
      "\n  bertjax data build --source wikipedia:gs://b/enwiki-latest-pages-articles-multistream"
      ".xml.bz2 --tokenizer gs://b/spm --out gs://b/wiki --runner DataflowRunner --beam-option="
      "--project=P --beam-option=--region=us-central1 --beam-option=--temp_location=gs://b/tmp")
  p.set_defaults(fn=cmd_data_build)
  p.add_argument("--source", action="append", required=True, help=SOURCE_HELP)
  p.add_argument("--tokenizer", required=True,
                 help="vocab.txt (WordPiece), a SentencePiece directory (spm.model), or a "
                      "published checkpoint's directory holding tokenizer.json")
  p.add_argument("--out", required=True, help="dataset directory")
  build = BuildOptions()  # the defaults: the same as a run's build on first use
  p.add_argument("--num-shards", type=int, default=build.num_shards,
                 help=f"shards per split ({build.num_shards})")
  p.add_argument("--workers", type=int, default=build.num_workers,
                 help=f"worker processes ({build.num_workers})")
  p.add_argument("--eval-fraction", type=float, default=build.eval_fraction,
                 help=f"documents held out for evaluation ({build.eval_fraction})")
  p.add_argument("--process-index", type=int, default=build.process_index,
                 help=f"this build process ({build.process_index})")
  p.add_argument("--process-count", type=int, default=build.process_count,
                 help=f"build processes ({build.process_count})")
  p.add_argument("--max-documents", type=int, default=build.max_documents,
                 help="stop after this many documents per source (0: all)")
  p.add_argument("--language", default=build.language,
                 help=f"sentence segmentation language of sources without ?language= "
                 f"({build.language})")
  p.add_argument("--cased", action="store_true",
                 help="a vocab.txt of a cased model (no lower-casing)")
  p.add_argument("--keep-duplicates", action="store_true",
                 help="keep exact duplicate documents (dropped and counted by default)")
  p.add_argument("--decontaminate", action="append", metavar="EVAL_SET",
                 help="drop (and count) documents sharing a word n-gram with this evaluation "
                 "set: a SQuAD .json, a GLUE .tsv/.csv or task folder, a .jsonl, plain text; "
                 "repeatable")
  p.add_argument("--decontamination-ngram", type=int, default=build.decontamination_ngram,
                 help=f"the n of --decontaminate's n-grams, in words "
                 f"({build.decontamination_ngram}, as GPT-3)")
  p.add_argument("--runner", default="",
                 help="build as an Apache Beam pipeline on this runner (DirectRunner: this "
                 "machine, --workers processes; DataflowRunner, FlinkRunner, SparkRunner); "
                 "empty: the local build (pip install 'bertjax[beam]')")
  p.add_argument("--beam-option", action="append", metavar="--NAME=VALUE",
                 help="a Beam pipeline option for --runner (e.g. --beam-option=--project=P); "
                 "repeatable")

  p = _task_set(
      data_sub, "task", "a labelled article-classification task from a corpus",
      "Which of K articles does a sentence come from? The K documents with the "
      "most sentences become the classes; balanced, seeded GLUE-style TSVs: dev.tsv and nested "
      "train_<n>.tsv (the fine-tuning transfer experiment of docs/finetuning.md).",
      "example:\n  bertjax data task --source embedded --out runs/article_task", cmd_data_task)
  p.add_argument("--articles", type=int, default=4, help="number of classes (4)")
  p.add_argument("--train-sizes", dest="train_sizes", type=int, nargs="+",
                 default=[100, 1000], help="training set sizes (100 1000)")
  p.add_argument("--dev-per-article", dest="dev_per_article", type=int, default=100,
                 help="dev sentences per article (100)")

  p = _task_set(
      data_sub, "glue", "GLUE's nine tasks in GLUE's files, made from a corpus",
      "Writes OUT/CoLA/train.tsv, OUT/MNLI/dev_matched.tsv, ... in each GLUE "
      "task's own format (columns, header, labels), with tasks built from a corpus's sentences "
      "(shuffled words, consecutive sentences, same article, ...: bertjax.finetune.glue_task), "
      "split by article, seeded: what `bertjax eval glue` runs on without GLUE's download. "
      "Scores on them compare runs, not papers.",
      "example:\n  bertjax data glue --out runs/glue && bertjax eval glue --init-from "
      "runs/modernbert_tiny/params --data runs/glue --out runs/glue_eval", cmd_data_glue)
  p.add_argument("--train-size", dest="train_size", type=int, default=400,
                 help="training examples per task (400)")
  p.add_argument("--dev-size", dest="dev_size", type=int, default=200,
                 help="dev examples per task and dev file (200)")

  p = _task_set(
      data_sub, "qa-task", "a SQuAD-format question-answering set from a corpus",
      "Cloze-style questions from a corpus's paragraphs (a sentence with a name, "
      "number or noun phrase replaced by what/when/who/how many; the paragraph is the "
      "context), split by article, seeded: train/dev SQuAD v1.1 JSON, and v2.0 files where a "
      "third of the questions are asked of a paragraph without the answer (the QA "
      "fine-tuning experiment of docs/finetuning.md).",
      "example:\n  bertjax data qa-task --source embedded --out runs/qa", cmd_data_qa_task)
  p.add_argument("--train-questions", dest="train_questions", type=int, default=2000,
                 help="training questions (2000)")
  p.add_argument("--dev-questions", dest="dev_questions", type=int, default=300,
                 help="dev questions (300)")

  p = data_sub.add_parser(
      "bench", help="measure tokens/s per core of the data pipeline",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Measures, on this machine, raw text -> instances (read, clean, split, "
      "tokenize, build, make instances) and built shards -> batches (the training loader), in "
      "tokens per second per core.",
      epilog="example:\n  bertjax data bench --source embedded --objective mlm_nsp")
  p.set_defaults(fn=cmd_data_bench)
  p.add_argument("--source", action="append", default=None, help=SOURCE_HELP)
  p.add_argument("--tokenizer", default="",
                 help="vocab.txt or SentencePiece dir (default: train one, not timed)")
  p.add_argument("--objective", default="mlm_nsp",
                 choices=("mlm_nsp", "mlm", "causal_lm"), help="instances to make")
  p.add_argument("--seq-length", type=int, default=128, help="sequence length (128)")
  p.add_argument("--batch-size", type=int, default=32, help="batch size (32)")
  p.add_argument("--workers", type=int, default=0, help="build/loader workers (0)")
  p.add_argument("--out", default="", help="keep the built dataset here (default: temp)")

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
  p.add_argument("--source", action="append", required=True, help=SOURCE_HELP)
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
