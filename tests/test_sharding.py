"""Parameter sharding: every parameter gets the sharding its logical axes and the rules imply,
on a real 8-device mesh, and the mesh axes of a reviewed golden dump; no large matrix is
silently replicated; sharded == single-device."""

import functools
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # `--write`: the test session's setup (8 host CPU devices) first
  import conftest  # noqa: F401

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bertjax.parallel import sharding
from bertjax.models import ModelConfig, abstract_params, build_model, init_params, jit_init

SHAPE = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, mlp_dim=128,
             max_positions=32)
CONFIGS = {
    "bert": ModelConfig(family="bert", **SHAPE),
    "bert-unrolled": ModelConfig(family="bert", scan_layers=False, **SHAPE),
    "gpt": ModelConfig(family="gpt", norm_position="pre", type_vocab_size=0, **SHAPE),
}

# Expected mesh placement of each logical axis under the default fsdp_tensor rules.
EXPECTED_AXIS = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                 "kv": None, "qkv": None, "layers": None, None: None}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_parameter_gets_its_intended_sharding(devices, name):
  cfg = CONFIGS[name]
  model = build_model(cfg)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  rules = sharding.resolve_rules("fsdp_tensor")
  params, _ = sharding.sharded_init(functools.partial(init_params, model), jax.random.key(0),
                                    mesh, rules)
  logical = sharding.logical_specs(abstract_params(model))
  flat_params = jax.tree_util.tree_leaves_with_path(params)
  flat_logical = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P))
  assert len(flat_params) == len(flat_logical)
  for (path, array), names in zip(flat_params, flat_logical):
    where = jax.tree_util.keystr(path)
    assert len(names) == array.ndim, f"{where}: logical axes {names} for shape {array.shape}"
    expected = P(*(EXPECTED_AXIS[n] for n in names))
    assert array.sharding.spec == expected, f"{where}: {array.sharding.spec} != {expected}"
    # No silently replicated matrices: every weight with 2+ dims of size >= 64 is split.
    if array.ndim >= 2 and sum(d >= 64 for d in array.shape) >= 2:
      assert sharding.sharded_fraction(array) <= 0.5, f"{where} is replicated"


def test_logical_axes_are_complete(devices):
  """Every parameter dimension has a name from the known vocabulary of logical axes."""
  known = {"embed", "heads", "kv", "qkv", "mlp", "vocab", "layers", None}
  for cfg in CONFIGS.values():
    logical = sharding.logical_specs(abstract_params(build_model(cfg)))
    for spec in jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, P)):
      assert isinstance(spec, P) and set(spec) <= known, spec


@pytest.mark.parametrize("preset,check", [
    ("data_parallel", lambda a: sharding.sharded_fraction(a) == 1.0),
    ("fsdp", lambda a: sharding.sharded_fraction(a) <= 1 / 8 + 1e-9),
])
def test_presets(devices, preset, check):
  cfg = CONFIGS["gpt"]
  mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1} if preset == "fsdp"
                            else {"data": 8})
  params, _ = sharding.sharded_init(functools.partial(init_params, build_model(cfg)),
                                    jax.random.key(0), mesh, sharding.resolve_rules(preset))
  big = [x for x in jax.tree.leaves(params) if x.ndim >= 2 and x.size >= 64 * 64]
  assert big and all(check(x) for x in big)


@pytest.mark.parametrize("axes", [{"data": 8}, {"data": 2, "fsdp": 2, "tensor": 2},
                                  {"data": 1, "fsdp": 1, "tensor": 8}, {"fsdp": 4, "data": 2}])
@pytest.mark.parametrize("name", ["bert", "gpt"])
def test_sharded_forward_equals_single_device(devices, axes, name):
  cfg = CONFIGS[name]
  model = build_model(cfg)
  reference_params = jit_init(model)(jax.random.key(0))
  ids = jnp.asarray(np.random.RandomState(0).randint(0, 256, (8, 16)))

  def forward(p, x):
    out = model.apply({"params": p}, x)
    return out.mlm_logits if name == "bert" else out

  expected = jax.jit(forward)(reference_params, ids)
  mesh = sharding.make_mesh(axes)
  rules = sharding.resolve_rules("fsdp_tensor")
  params, shardings = sharding.sharded_init(functools.partial(init_params, model),
                                            jax.random.key(0), mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    got = jax.jit(forward)(params, ids)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_mesh_validation_messages(devices):
  assert sharding.mesh_shape({"data": -1, "tensor": 2}, 8) == (4, 1, 2)
  with pytest.raises(ValueError, match="needs 12 devices but 8"):
    sharding.mesh_shape({"data": 3, "tensor": 4}, 8)
  with pytest.raises(ValueError, match="not divisible"):
    sharding.mesh_shape({"data": -1, "tensor": 3}, 8)
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    sharding.mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="unknown mesh axis model"):
    sharding.mesh_shape({"model": 2}, 8)
  with pytest.raises(ValueError, match="unknown sharding rules preset"):
    sharding.resolve_rules("zero3")


def test_indivisible_dimension_is_reported_not_silent(devices, caplog):
  cfg = CONFIGS["gpt"].replace(vocab_size=250)  # 250 is not divisible by tensor=4
  mesh = sharding.make_mesh({"data": 2, "tensor": 4})
  with caplog.at_level("WARNING"):
    params, _ = sharding.sharded_init(functools.partial(init_params, build_model(cfg)),
                                      jax.random.key(0), mesh,
                                      sharding.resolve_rules("fsdp_tensor"))
  assert "['wte']['embedding']: dimension 250 is not divisible by mesh axis 'tensor'" in caplog.text
  assert params["wte"]["embedding"].sharding.spec == P(None, "fsdp")  # vocab left whole


# --- golden per-parameter shardings ---------------------------------------------------------
# The tests above take each expected spec from the model's own logical names, so a layer that
# names an axis wrongly ("mlp" for "heads", "embed" for "vocab") passes them. This one compares
# the mesh axes every parameter of the small configs gets with a reviewed, checked-in dump.

GOLDEN = Path(__file__).parent / "golden" / "param_shardings.json"
GOLDEN_MESH = {"data": 2, "fsdp": 2, "tensor": 2}
GOLDEN_RULES = ("fsdp_tensor", "data_parallel")
# (config, head): every head the small configs build; num_labels 3 for the classifiers.
GOLDEN_MODELS = (("bert_tiny", "pretraining"), ("bert_tiny", "sequence_classification"),
                 ("bert_tiny", "token_classification"), ("bert_tiny_unrolled", "pretraining"),
                 ("gpt_tiny", "lm"))


def _golden_model(config_name: str, head: str) -> nn.Module:
  from bertjax.config import load_config, model_config
  from bertjax.models.bert import BertForTokenClassification
  unrolled = config_name.endswith("_unrolled")
  cfg = model_config(load_config(config_name.removesuffix("_unrolled")))
  if unrolled:
    cfg = cfg.replace(scan_layers=False)
  if head == "sequence_classification":
    return build_model(cfg.replace(num_labels=3), head="sequence_classification")
  if head == "token_classification":
    return BertForTokenClassification(cfg.replace(num_labels=3))
  return build_model(cfg)


def param_shardings() -> dict[str, dict[str, dict[str, list]]]:
  """{"<config>/<head>/<rules>": {parameter path: {"spec": mesh axes per dimension,
  "shape": ..., "logical": the model's axis names}}}, from the shardings a run creates its
  parameters in (sharding.shardings_for). The logical names are kept too: a misnamed axis that
  lands on the same mesh axis under these presets ("mlp" for "heads") differs under others."""
  mesh = sharding.make_mesh(GOLDEN_MESH)
  dump = {}
  for config_name, head in GOLDEN_MODELS:
    abstract = abstract_params(_golden_model(config_name, head))
    shapes = jax.tree.leaves(nn.meta.unbox(abstract))
    names = jax.tree.leaves(sharding.logical_specs(abstract), is_leaf=lambda x: isinstance(x, P))
    for rules in GOLDEN_RULES:
      shardings = sharding.shardings_for(abstract, mesh, sharding.resolve_rules(rules))
      entry = {}
      for (path, s), shape, logical in zip(jax.tree_util.tree_leaves_with_path(shardings),
                                           shapes, names, strict=True):
        spec = tuple(s.spec) + (None,) * (len(shape.shape) - len(s.spec))
        entry[jax.tree_util.keystr(path)] = {
            "spec": [list(a) if isinstance(a, tuple) else a for a in spec],
            "shape": list(shape.shape), "logical": list(logical)}
      dump[f"{config_name}/{head}/{rules}"] = entry
  return dump


def test_parameter_shardings_match_the_golden_dump(devices):
  """Every parameter of bert_tiny (pre-training, both classifiers, unrolled) and gpt_tiny
  gets the mesh axes of tests/golden/param_shardings.json on a 2x2x2 mesh, under the default
  and the data_parallel rules. Regenerate only for an intended change, after reviewing the
  new specs: `python tests/test_sharding.py --write`."""
  want = json.loads(GOLDEN.read_text())
  have = param_shardings()
  assert sorted(have) == sorted(want), (
      f"models/rules in the dump {sorted(want)}, computed {sorted(have)}")
  differing = []
  for key in sorted(want):
    for path in sorted(set(want[key]) | set(have[key])):
      old, new = want[key].get(path, "<absent>"), have[key].get(path, "<absent>")
      if old != new:
        differing.append(f"{key} {path}: golden {json.dumps(old, sort_keys=True)}, "
                         f"now {json.dumps(new, sort_keys=True)}")
  assert not differing, "parameter shardings changed:\n" + "\n".join(differing)


if __name__ == "__main__" and "--write" in sys.argv:
  GOLDEN.parent.mkdir(exist_ok=True)
  # One line per parameter, so that a reviewer reads the specs in a column.
  GOLDEN.write_text("{\n" + ",\n".join(
      f" {json.dumps(key)}: {{\n" + ",\n".join(
          f"  {json.dumps(path)}: {json.dumps(entry, sort_keys=True)}"
          for path, entry in sorted(params.items())) + "\n }"
      for key, params in sorted(param_shardings().items())) + "\n}\n")
  print(f"wrote {GOLDEN}")
