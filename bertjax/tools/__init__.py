"""Measurement, ahead-of-time compilation and benchmark tooling, apart from the training core.

What lives here answers questions about the core rather than training with it:

- `aot`: `bertjax compile`, the real train step compiled for a named TPU slice on any machine
  (libtpu's compile-only client): memory per device, compiled FLOPs, collectives, a projected
  step time;
- `fit`: `bertjax compile --fit`, the fastest projected setting that fits a slice;
- `hlo`: reading a compiled XLA program's text (matmul FLOPs and collectives through loop trips,
  what each instruction is for);
- `bench`: `bertjax bench`, one train step's throughput, model vs. compiled FLOPs, MFU, memory,
  and a profile split by purpose;
- `bench_hf`: the same step in Hugging Face `transformers` (PyTorch), for `bench --compare hf`;
- `decode_bench`: `bertjax bench --decode`, milliseconds per new token with the KV cache
  against recomputing;
- `data_bench`: `bertjax data bench`, tokens per second per core of the data pipeline;
- `checkpoint_bench`: `bertjax checkpoint-bench`, what asynchronous checkpointing costs;
- `param_report`: parameter counts by group and the check against the papers' figures
  (`bertjax info`).

The direction is one way: these modules import the core (`bertjax.training.trainer`,
`bertjax.models`, `bertjax.training.flops`, ...), and the core never imports them. The CLI's
command modules (bertjax/cli/) import them only inside the command handlers that need them, so
`import bertjax.cli` loads none of them; tests/test_architecture.py holds both rules.
"""
