"""Measurement, ahead-of-time compilation and benchmark tooling, apart from the training core:
`bertjax compile` (aot, fit, hlo, topology), `bertjax bench` (bench, bench_hf, decode_bench),
`bertjax data bench` (data_bench), `bertjax checkpoint-bench` (checkpoint_bench), `bertjax info`
(param_report) and mlm_eval; one line each in docs/architecture.md, 'Measurement and AOT tooling'.

The direction is one way: these modules import the core and the core never imports them; the
CLI imports them only inside the command handlers that need them, so `import bertjax.cli` loads
none of them. tests/test_architecture.py holds both rules.
"""
