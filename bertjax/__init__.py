"""bertjax: pre-train BERT and GPT language models with JAX, from a laptop CPU to TPU pods."""

__version__ = "0.1.0"
