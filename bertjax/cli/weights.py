"""The commands that move weights in and out and use them: `import` (Hugging Face in), `export`
(Hugging Face, params-only or a peft adapter out) and `generate`."""

from __future__ import annotations

import argparse
import json

from bertjax.cli.common import Add

Overrides = list[tuple[str, str]]


def cmd_generate(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax.checkpoints.weights import load_weights
  from bertjax.data.seq2seq import specials
  from bertjax.data.tokenizers import load_tokenizer
  from bertjax.inference import generate
  # Any weights: params-only, a workdir, a fine-tuned OUT/best (LoRA on its base included).
  weights = load_weights(args.params)
  params, model = weights.params, weights.config
  tokenizer_path = args.tokenizer or weights.tokenizer
  if tokenizer_path is None:
    raise ValueError(f"{args.params} holds no tokenizer/; pass --tokenizer")
  tokenizer = load_tokenizer(tokenizer_path)
  if model.is_encoder:
    for text in args.prompt:
      found = generate.fill_mask(params, model, tokenizer, text, top_k=args.top_k or 5)
      print(text)
      for slot in (found if isinstance(found[0], list) else [found]):
        for token, prob in slot:
          print(f"  {prob:.4f}  {token}")
    return 0
  stops = [tokenizer.token_id(t) for t in args.stop]
  style = getattr(tokenizer, "style", None)
  if not args.stop and style in ("gpt", "t5", "bart"):
    stops = [tokenizer.token_id("<|endoftext|>" if style == "gpt" else "</s>")]
  settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  num_beams=args.num_beams, length_penalty=args.length_penalty,
                  repetition_penalty=args.repetition_penalty,
                  no_repeat_ngram_size=args.no_repeat_ngram_size, stop_tokens=stops)
  if model.is_encoder_decoder:
    # The prompt is the encoder's text (T5: "... <extra_id_0> ..." spans to fill), with the
    # end token the encoders trained with; the output is the decoder's.
    try:
      frame = specials(tokenizer)
    except ValueError as e:
      raise ValueError(f"{tokenizer_path}: a {model.family} model: {e}") from None
    # The encoders' sentinels and masks written in a prompt are those tokens.
    sources = [frame.wrap(generate.encode_marked(tokenizer, p, r"<extra_id_\d+>|<mask>"))[0]
               for p in args.prompt]
    outputs = generate.generate_seq2seq(params, model, sources, decoder_start=frame.start,
                                        seed=args.seed, **settings)
    for text, new in zip(args.prompt, outputs):
      print(f"{text}\n  -> {tokenizer.decode(new, skip_special_tokens=False)}")
    return 0
  prompts = [tokenizer.encode(p) for p in args.prompt]
  outputs = generate.generate(params, model, prompts, seed=args.seed, **settings)
  for text, prompt, new in zip(args.prompt, prompts, outputs):
    print(f"{text}{generate.continuation_text(tokenizer, prompt, new)}")
  return 0


def cmd_import(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax import hf
  from bertjax.checkpoints import params as checkpoint
  if overrides:
    raise ValueError("import takes no --config overrides (the HF config.json decides)")
  params, model_cfg, report = hf.import_hf(args.hf_dir, scan_layers=not args.no_scan)
  out = checkpoint.save_params(args.out, params, model_cfg, report.head)
  tokenizer = out / "tokenizer"
  tokenizer.mkdir(exist_ok=True)
  # Every tokenizer file, bertjax's own (spm.model, casing) included, so that an exported run
  # imports back with the same ids.
  copied = hf.copy_tokenizer_files(args.hf_dir, tokenizer)
  print(report.summary())
  print(f"wrote {out}" + (f" (tokenizer: {', '.join(copied)})" if copied else ""))
  return 0


def cmd_export(args: argparse.Namespace, overrides: Overrides) -> int:
  from bertjax import hf, paths
  from bertjax.checkpoints import exports
  from bertjax.checkpoints.params import load_head, load_params, tokenizer_dir
  from bertjax.checkpoints.weights import FINETUNE_FILE, run_params
  if overrides:
    raise ValueError("export takes no --config overrides")
  if bool(args.params) == bool(args.workdir):
    raise ValueError("give exactly one of --params DIR or --workdir DIR")
  if args.format == "peft" and args.workdir:
    raise ValueError("--format peft exports a fine-tuned OUT/best: give it with --params")
  dtype = exports.DTYPES[args.dtype]
  finetuned = bool(args.params) and (paths.path(args.params) / FINETUNE_FILE).is_file()
  if args.format == "peft" and not finetuned:
    raise ValueError(f"--format peft exports a fine-tuned OUT/best; {args.params} has no "
                     f"{FINETUNE_FILE}")
  if finetuned:  # its task's Hugging Face model (LoRA merged), or the peft adapter
    if args.format == "peft":
      print(f"wrote a peft LoRA adapter to {exports.export_finetuned_peft(args.params, args.out)}")
    elif args.format == "hf":
      out = exports.export_finetuned_hf(args.params, args.out, dtype)
      architecture = json.loads((out / "config.json").read_text())["architectures"][0]
      print(f"wrote a Hugging Face {architecture} directory to {out} ({dtype})")
    else:
      raise ValueError(f"{args.params} is a fine-tuned output: export it with --format hf or "
                       "peft")
    return 0
  if args.workdir:
    saved = paths.path(args.workdir) / "config.json"
    if saved.exists() and json.loads(saved.read_text()).get("finetune", {}).get("task"):
      raise ValueError(f"{args.workdir} is a fine-tune's output directory: export its best "
                       f"parameters, --params {paths.path(args.workdir) / 'best'}")
    params, model_cfg, tokenizer, step = run_params(args.workdir, args.step)
    head = "pretraining"
    print(f"exporting step {step} of {args.workdir}")
  else:
    params, model_cfg = load_params(args.params)
    head = load_head(args.params)
    tokenizer = tokenizer_dir(args.params)
  if args.format == "hf" and model_cfg.has_generator:
    out, generator = exports.export_rtd_hf(params, model_cfg, args.out, dtype, tokenizer)
    kinds = [json.loads((d / "config.json").read_text())["architectures"][0]
             for d in (out, generator)]
    print(f"wrote the discriminator ({kinds[0]}) to {out} and the generator ({kinds[1]}) to "
          f"{generator} ({dtype})")
  elif args.format == "hf":
    out = hf.export_hf(params, model_cfg, args.out, dtype, tokenizer, head=head)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote a Hugging Face {architecture} directory to {out} ({dtype})")
    if tokenizer is None:
      # Said here: AutoTokenizer on the export would fail much later, far from the cause.
      print(f"{args.params or args.workdir} has no tokenizer/: wrote weights only (a "
            "tokenizer/ holding spm.model or vocab.txt adds the files AutoTokenizer reads)")
  else:
    out = exports.export_params(params, model_cfg, tokenizer, args.out, dtype, head)
    print(f"wrote a params-only checkpoint to {out} ({dtype})")
  return 0


def register(add: Add) -> None:
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

  p = add("import", "read a Hugging Face checkpoint into bertjax parameters",
          "Reads a `transformers` directory (config.json + model.safetensors, or a sharded "
          "safetensors index) of any model_type bertjax maps (BERT, RoBERTa-style BERT, "
          "ALBERT, DistilBERT, ELECTRA, ModernBERT, DeBERTa-v2/v3, GPT-2, GPT-1, T5, BART: "
          "their head models and bare base models; docs/models.md) and writes a bertjax "
          "params checkpoint that records the head it imported as (an ElectraForPreTraining "
          "is a discriminator), so that `bertjax export` writes the same class. Heads absent "
          "from the checkpoint (e.g. NSP of a BertForMaskedLM) are freshly initialised and "
          "listed. Pickled .bin files are never loaded.",
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
