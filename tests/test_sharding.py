"""Acceptance 4: every parameter gets the sharding its logical axes and the rules imply, on a
real 8-device mesh; no large matrix is silently replicated; sharded == single-device."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bertjax import sharding
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
