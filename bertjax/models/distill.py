"""A student initialised from its teacher's parameters (Sanh et al. 2019, DistilBERT §3: "we
initialize the student from the teacher by taking one layer out of two"): which teacher layers
(`teacher_layers`) and the parameter tree the student starts from (`student_from_teacher`).

Parameter trees only, apart from any module or training code: the layer stack is read in
either layout (scanned `layers` with a leading layer axis, or `layers_{i}`), the teacher's and
the student's independently, and the functions are traceable (the trainer runs them under
`jax.jit` with the student's shardings).
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp
from flax import traverse_util

from bertjax.models.config import ModelConfig
from bertjax.models.params import layer_prefix

Names = tuple[str, ...]

# `teacher_layers` spellings besides an explicit list: one layer out of two from the bottom
# (the paper's rule; the released extraction scripts took 0, 2, 4, 7, 9, 11 of 12).
EVERY_OTHER = "every_other"


def teacher_layers(spec: str, teacher: int, student: int,
                   key: str = "distillation.teacher_layers") -> tuple[int, ...]:
  """The teacher layer each student layer starts from, in the student's order: "every_other"
  (0, 2, 4, ...) or a comma-separated list of teacher layer indices, one per student layer.
  A ValueError naming `key` when the list does not fit the two depths."""
  spec = spec.strip()
  if spec == EVERY_OTHER:
    layers = tuple(range(0, 2 * student, 2))
  elif re.fullmatch(r"\d+(\s*,\s*\d+)*", spec):
    layers = tuple(int(part) for part in spec.split(","))
  else:
    raise ValueError(f"{key}={spec!r}: must be {EVERY_OTHER} or a comma-separated list of "
                     "teacher layer indices (e.g. 0,2,4,7,9,11)")
  if len(layers) != student:
    raise ValueError(f"{key}={spec!r}: names {len(layers)} teacher layers for a student of "
                     f"{student} layers (model.num_layers)")
  beyond = [i for i in layers if i >= teacher]
  if beyond:
    raise ValueError(f"{key}={spec!r}: the teacher has {teacher} layers (0..{teacher - 1}); "
                     f"no layer {beyond[0]}")
  return layers


def _layer_entry(names: Names, prefix: Names) -> tuple[int | None, Names] | None:
  """(layer index or None for a scanned stack, the path inside the layer) of a parameter of the
  layer stack at `prefix`; None outside it."""
  if names[:len(prefix)] != prefix or len(names) <= len(prefix):
    return None
  head = names[len(prefix)]
  if head == "layers":
    return None, names[len(prefix) + 1:]
  match = re.fullmatch(r"layers_(\d+)", head)
  if match:
    return int(match.group(1)), names[len(prefix) + 1:]
  return None


def _stack_layout(flat: dict[Names, Any], cfg: ModelConfig, who: str) -> None:
  """Refuses a layer stack the mapping cannot read layer by layer (a stack whose layers share
  parameters keeps them under a name of its own, outside `layers`)."""
  prefix = layer_prefix(cfg)
  for names in flat:
    if (names[:len(prefix)] == prefix and len(names) > len(prefix)
        and _layer_entry(names, prefix) is None and names[len(prefix)] not in (
            "rel_embeddings", "rel_embeddings_norm")):
      raise ValueError(f"distillation.init_from_teacher: the {who}'s layer stack keeps "
                       f"{'/'.join(names)} outside its per-layer parameters (layers shared "
                       "across the stack?); only per-layer stacks map layer by layer")


def student_from_teacher(student: Any, teacher: Any, student_cfg: ModelConfig,
                         teacher_cfg: ModelConfig, layers: tuple[int, ...]
                         ) -> tuple[Any, list[str], list[str]]:
  """The student's parameters with student layer j taken from teacher layer `layers[j]` and
  every other student parameter that the teacher has at the same path with the same shape
  (embeddings, their LayerNorm, a pre-LN final norm, the MLM head and its bias) copied; the rest
  (a parameter the teacher lacks or holds in another shape, e.g. a DistilBERT student's
  missing token-type table is simply absent) keeps its initialisation.

  Returns (params, the names copied, the names kept). Traceable: under `jax.jit` the copies are
  slices of the teacher's arrays. A ValueError naming distillation.init_from_teacher lists the
  layer parameters whose shapes differ (a student of another width or MLP size)."""
  s_flat = traverse_util.flatten_dict(student)
  t_flat = traverse_util.flatten_dict(teacher)
  _stack_layout(s_flat, student_cfg, "student")
  _stack_layout(t_flat, teacher_cfg, "teacher")
  prefix = layer_prefix(student_cfg)
  if layer_prefix(teacher_cfg) != prefix:
    raise ValueError(f"distillation.init_from_teacher: a {teacher_cfg.family} teacher cannot "
                     f"initialise a {student_cfg.family} student")

  def teacher_layer(index: int, inner: Names) -> Any | None:
    scanned = t_flat.get(prefix + ("layers",) + inner)
    if scanned is not None:
      return scanned[index]
    return t_flat.get(prefix + (f"layers_{index}",) + inner)

  out: dict[Names, Any] = {}
  copied, kept, problems = [], [], []
  for names, value in s_flat.items():
    name = "/".join(names)
    entry = _layer_entry(names, prefix)
    if entry is None:
      source = t_flat.get(names)
      if source is not None and source.shape == value.shape:
        out[names] = source.astype(value.dtype)
        copied.append(name)
      else:
        out[names] = value
        kept.append(name)
      continue
    index, inner = entry
    picks = layers if index is None else (layers[index],)
    found = [teacher_layer(i, inner) for i in picks]
    want = value.shape if index is None else (1,) + value.shape
    if any(f is None for f in found):
      problems.append(f"{name}: the teacher has no such layer parameter")
      out[names] = value
      continue
    stacked = jnp.stack(found)
    if stacked.shape != want:
      problems.append(f"{name}: {tuple(want[1:])} per layer vs teacher "
                      f"{tuple(found[0].shape)}")
      out[names] = value
      continue
    out[names] = (stacked if index is None else stacked[0]).astype(value.dtype)
    copied.append(name)
  if problems:
    raise ValueError("distillation.init_from_teacher: the student's layers do not fit the "
                     f"teacher's ({len(problems)} parameter(s)): " + "; ".join(problems[:8]))
  return traverse_util.unflatten_dict(out), copied, kept

