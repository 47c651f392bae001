"""SpanBERT (Joshi et al. 2020, "SpanBERT: Improving Pre-training by Representing and Predicting
Spans", TACL 8), one size per variant: `--config configs/spanbert.py:size=base` (base, large).

Span masking and the span-boundary objective (SBO) on BERT's shapes. Sources: the paper (§3
the method, §4's implementation notes and the appendix the setup) and facebookresearch/
SpanBERT's pretraining/README.md, whose launch command "corresponds to the SpanBERT
configuration mentioned in the paper" (`--arch cased_bert_pair_large --geometric-p 0.2
--span-upper 10 --replacement-method span --no-nsp --pair-loss-weight 1.0 --lr 0.0001
--warmup-updates 10000 --lr-scheduler polynomial_decay --total-num-update 2400000
--weight-decay 0.01 --adam-eps 1e-8 --clip-norm 1.0 --tokens-per-sample 512
--short-seq-prob 0.0`, 4096 tokens per GPU on 32 GPUs: 256 sequences of 512 tokens per step).

  size   layers  width  FFN   heads  vocab (cased WordPiece)  params
  base   12      768    3072  12     28,996                   110M
  large  24      1024   4096  16     28,996                   340M

Both: BooksCorpus + English Wikipedia (BERT's corpus), cased; batch 256 × 512 tokens, 2.4M
steps; Adam with decoupled weight decay 0.01 (the reference's fairseq Adam: p -= wd·lr·p),
lr 1e-4, β (0.9, 0.999), ε 1e-8, 10,000 warmup steps then linear decay to 0 (polynomial_decay,
power 1), clipping at global norm 1.0; dropout 0.1, GeLU. Masking: 15% of the tokens in
spans of whole words, lengths Geometric(0.2) clipped at 10 (mean 3.8 words), 80/10/10 per span,
a new mask every epoch; loss = MLM + SBO (the SBO head's relative positions: 10 rows, hidden
wide). Inputs: single contiguous segments of up to 512 tokens that end at a document boundary
(no NSP, no short sequences, no 128-token phase) = `data.bert_instances="doc_sentences"`.
`full_sentences` (RoBERTa's FULL-SENTENCES) would instead pack across documents. The paper
states one recipe; the released base model is taken to follow it. Parameter counts are the
README's (BERT's figures: with the cased vocabulary BertForPreTraining has 108.9M and 334.7M,
the latter 1.6% under the "340M" BERT-large states for its uncased 30,522 words; the SBO head
adds 2.4M and 4.2M).

Where bertjax differs from the reference (docs/data.md, 'Masking schemes'): masks are capped at
`max_predictions` (77 = 15% of 512); spans never touch (SpanBERT merges touching ones); span
starts are uniform over word starts (SpanBERT picks a token and backs up to its word's start);
a sentence longer than 510 tokens is cut, not dropped; SBO targets go to the first 10 tokens of
a span (SpanBERT: 15, `--max-pair-targets 15`) and decode with the MLM's bias; weight decay
spares biases and LayerNorms (BERT's convention; fairseq decays every parameter).

  bertjax compile --config configs/spanbert.py:size=base --topology v4-16   # 22.4 GiB, fp32
  bertjax compile --config configs/spanbert.py:size=large --topology v4-64  # 19.3 GiB, fp32
  bertjax train --config configs/spanbert.py:size=base --workdir /gcs/BUCKET/spanbert_base \
      --config.data.sources="wikipedia:/data/enwiki.xml.bz2,text:/data/books/" \
      --config.data.tokenizer=/data/bert-base-cased/vocab.txt
"""

from bertjax.config import base_config, bert_model, choose, parse_arg
from bertjax.reproduction import Contract, Target, golden_contracts

# size: (layers, width, FFN, heads, the released model's parameter count).
SIZES = {
    "base": (12, 768, 3072, 12, 110_000_000),
    "large": (24, 1024, 4096, 16, 340_000_000),
}
# Every config this file makes (the tests load each).
VARIANTS = tuple(f"size={size}" for size in SIZES)


def get_config(arg=None):
  arg = parse_arg(arg, size="")
  layers, width, ffn, heads, params = choose(SIZES, "size", arg.size)
  # BERT's shape with the cased WordPiece vocabulary (bert-*-cased's vocab.txt, 28,996 ids).
  config = base_config(bert_model(vocab_size=28_996, hidden_size=width, num_layers=layers,
                                   num_heads=heads, mlp_dim=ffn))
  # MLM + span-boundary objective, no NSP; the SBO head's relative positions: spans up to 10.
  config.objective = "mlm_sbo"
  config.model.span_boundary_positions = 10
  # Single segments of whole sentences within one document, up to seq_length.
  config.data.bert_instances = "doc_sentences"
  # Span masking: Geometric(0.2) lengths clipped at 10 words, 80/10/10 per span.
  config.data.masking = "span"
  config.data.span_geometric_p = 0.2
  config.data.span_max_length = 10
  # 15% of the tokens masked.
  config.data.mask_prob = 0.15
  # A new mask every time a sequence is read (the paper's "different masks at each epoch").
  config.data.dupe_factor = 0
  # Cased text: a bert-*-cased vocab.txt read as it is.
  config.data.lowercase = "false"
  # 256 sequences of 512 tokens, 2.4M steps.
  config.batch_size = 256
  config.seq_length = 512
  # 15% of 512 tokens.
  config.max_predictions = 77
  config.num_train_steps = 2_400_000
  # Adam with decoupled weight decay 0.01, lr 1e-4 after 10k warmup steps, linear decay to 0,
  # clipping at 1.0 (the reference's --adam-eps 1e-8 --clip-norm 1.0).
  config.optimizer.update(dict(name="adamw", learning_rate=1e-4, warmup_steps=10_000,
                               schedule="linear", b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
                               clip_norm=1.0))
  # The reference saves every 50,000 updates; every 10,000 bounds the work a preemption loses.
  config.checkpoint.every = 10_000
  config.log_every = 100
  # The released model's parameter count (its README), for `bertjax info`.
  config.reference_params = params
  return config


# What the paper reports and what each family's laptop-scale run should reach (docs/
# reproducing.md): variant -> bertjax.reproduction.Contract.
CONTRACTS = {
    **{f"size={size}": Contract(
        paper="Joshi et al. 2020",
        targets=(
            Target(f"SQuAD 1.1 {split} F1", squad1, "facebookresearch/SpanBERT README.md: "
                   f"'SpanBERT ({size}) | {squad1}{star} | {squad2}{star} | {coref} | "
                   f"{tacred}'"),
            Target(f"SQuAD 2.0 {split} F1", squad2, "the same row"),
            Target("coreference (OntoNotes) average F1", coref, "the same row"),
            Target("TACRED F1", tacred, "the same row"),
        )) for size, split, star, squad1, squad2, coref, tacred in (
            ("base", "dev", "*", 92.4, 83.6, 77.4, 68.2),
            ("large", "test", "", 94.6, 88.7, 79.6, 70.8))},
    # The golden curve of the runlocal run (configs/golden/, recorded with 3 seeds).
    **golden_contracts(__file__, "spanbert:size=base,runlocal"),
}
