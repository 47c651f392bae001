"""What each model family's mapping (bert, albert, modernbert, gpt, ...) is built from: `Entry`,
one bertjax parameter and the checkpoint tensor(s) it is made of, with its constructors (a fused
QKV kernel from three projections among them); the activation names of `transformers` configs;
and the error a checkpoint that does not fit raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
          "gelu_fast": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}


class HFConversionError(ValueError):
  """A checkpoint that does not fit the model, naming the offending tensor."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """One bertjax parameter and the checkpoint tensor(s) it is made of."""

  ours: tuple[str, ...]
  theirs: tuple[str, ...]
  to_ours: Callable[..., np.ndarray]
  to_theirs: Callable[[np.ndarray], tuple[np.ndarray, ...]]
  # Heads may be absent from a checkpoint (a bare BertModel): then freshly initialised.
  optional: bool = False


def same(name: tuple[str, ...], hf: str, optional: bool = False) -> Entry:
  return Entry(name, (hf,), lambda x: x, lambda x: (x,), optional)


def transposed(name: tuple[str, ...], hf: str, optional: bool = False) -> Entry:
  return Entry(name, (hf,), lambda x: x.T, lambda x: (x.T,), optional)


def norm(name: tuple[str, ...], hf: str, optional: bool = False,
         bias: bool = True) -> list[Entry]:
  return [same(name + ("scale",), f"{hf}.weight", optional)] + (
      [same(name + ("bias",), f"{hf}.bias", optional)] if bias else [])


def fused_qkv(ours: tuple[str, ...], theirs: tuple[str, str, str], d: int, n: int,
              h: int) -> list[Entry]:
  """Our fused `qkv` kernel [D, 3, N, H] and bias [3, N, H] <-> three separate
  query/key/value Linear layers (`theirs`: their module names, `.weight` [D, D] / `.bias`)."""
  return [
      Entry(ours + ("kernel",), tuple(f"{t}.weight" for t in theirs),
            lambda q, k, v: np.stack([q.T, k.T, v.T], axis=1).reshape(d, 3, n, h),
            lambda x: tuple(x.reshape(d, 3, d)[:, t].T for t in range(3))),
      Entry(ours + ("bias",), tuple(f"{t}.bias" for t in theirs),
            lambda q, k, v: np.stack([q, k, v]).reshape(3, n, h),
            lambda x: tuple(x.reshape(3, d))),
  ]


# The classic layout: what BERT's and GPT-2's transformers classes hold (option, value).
CLASSIC = (("position_embedding", "learned"), ("mlp_gated", False), ("pooler", True),
           ("attention_bias", True), ("mlp_bias", True), ("norm_bias", True),
           ("head_bias", True), ("local_window", 0))


def check_classic(cfg: object, hf_class: str) -> None:
  """Raises, naming the options, where `cfg` leaves the classic layout `hf_class` holds."""
  modern = [name for name, classic in CLASSIC if getattr(cfg, name) != classic]
  if modern:
    raise HFConversionError(f"{', '.join(f'{n}={getattr(cfg, n)!r}' for n in modern)}: no "
                            f"{hf_class} equivalent in transformers (MosaicBERT is remote code; "
                            "a rotary BERT exports as ModernBERT)")
