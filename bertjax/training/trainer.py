"""The training core: a sharded train state and one jitted, pure train step.

`train_step(state, batch) -> (state, metrics)` is jitted once with explicit in/out shardings
and the state donated. Gradient accumulation runs inside the step as a scan over
micro-batches. Parameters and optimizer state are created directly in their shardings.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax import paths
from bertjax.checkpoints.params import load_params, saved_abstract_params
from bertjax.checkpoints.weights import FINETUNE_FILE, load_weights
from bertjax.config import model_config, ramp
from bertjax.data import schema
from bertjax.finetune.registry import TASKS
from bertjax.models import attention, build_model, init_compiler_options, init_params, precision
from bertjax.models.electra import discriminator_params
from bertjax.models.groups import encoder_path, is_added
from bertjax.models.params import shape_mismatches
from bertjax.parallel import sharding
from bertjax.resilience import faults
from bertjax.resilience import guard as spike_guard
from bertjax.training import defaults, distillation, objectives, optim

log = logging.getLogger(__name__)

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # Raw key data (uint32), so checkpoints hold a plain array.
  rng: jax.Array
  # A distillation run's frozen teacher (bertjax.training.distillation), None otherwise: passed
  # through the step unchanged, outside the gradient and the optimizer; not checkpointed (read
  # again from its source on restore) and not exported.
  teacher: Any = None
  # The spike guard's running statistics (bertjax.resilience.guard), None when it is off.
  guard: Any = None


def _trailing_names(path) -> tuple[str, ...]:
  names = []
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey):
      names.append(str(entry.key))
    else:
      break
  return tuple(reversed(names))


def optimizer_state_shardings(abstract_opt_state: Any, param_shardings: Any, params: Any,
                              mesh: Mesh) -> Any:
  """Optimizer slots mirror their parameter's sharding (ZeRO: moments sharded like weights);
  anything else (step counts, factored Adafactor rows) is replicated."""
  by_name = {}
  for path, sh in jax.tree_util.tree_leaves_with_path(param_shardings):
    by_name[_trailing_names(path)] = sh
  shapes = {_trailing_names(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(
      params)}
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    names = _trailing_names(path)
    if names in by_name and shapes[names] == leaf.shape:
      return by_name[names]
    return replicated
  return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def batch_shardings(example: dict[str, Any], mesh: Mesh, rules) -> dict[str, NamedSharding]:
  """Every batch field sharded over the mesh axes the rules give `batch`, on dimension 0."""
  axes = sharding.batch_axes(rules)
  rows = axes[0] if len(axes) == 1 else (axes or None)
  return {k: NamedSharding(mesh, PartitionSpec(rows, *([None] * (np.ndim(v) - 1))))
          for k, v in example.items()}


def _split_micro_batches(x: jax.Array, k: int) -> jax.Array:
  """[B, ...] -> [k, B/k, ...] with micro-batch j = rows j, j+k, ...: every micro-batch spans
  all data shards, so the split is local to each device."""
  b = x.shape[0]
  if b % k:
    raise ValueError(f"batch of {b} is not divisible into {k} micro-batches")
  x = x.reshape((b // k, k) + x.shape[1:])
  x = jnp.swapaxes(x, 0, 1)
  return nn.with_logical_constraint(x, (None, "batch") + (None,) * (x.ndim - 2))


def train_step(state: TrainState, batch: Batch, *, loss_fn: objectives.LossFn,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               accum_steps: int, rules, guard: spike_guard.GuardSettings | None = None
               ) -> tuple[TrainState, dict]:
  """One optimizer update on the global batch (pure; jitted by `Trainer`). A distillation
  teacher (`state.teacher`) is read by the loss, differentiated by nothing and returned as
  it came. With the spike guard (`guard`), an outlier step keeps the old parameters and
  optimizer state (bertjax.resilience.guard; the optimizer keeps its own, told by `skip`:
  bertjax.training.skipping)."""
  with nn.logical_axis_rules(rules):
    objective = (loss_fn if state.teacher is None
                 else functools.partial(loss_fn, teacher=state.teacher))
    # The fault lab's poisoned batches (bertjax.resilience.faults; no-op without them).
    objective, batch = faults.scaled(objective, batch)
    norm = loss_fn.normalizers(batch)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    if accum_steps == 1:
      (loss, metrics), grads = grad_fn(state.params, batch, norm, key)
    else:
      micro = jax.tree.map(functools.partial(_split_micro_batches, k=accum_steps), batch)

      def accumulate(carry, xs):
        micro_batch, i = xs
        (loss, m), g = grad_fn(state.params, micro_batch, norm, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, carry, (loss, m, g)), None

      shapes = jax.eval_shape(
          lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], micro), norm, key))
      (loss0, metrics0), grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      zeros = (loss0, metrics0, grads0)
      (loss, metrics, grads), _ = jax.lax.scan(accumulate, zeros,
                                               (micro, jnp.arange(accum_steps)))

    grad_norm = optax.global_norm(grads)
    checked = state.guard
    if guard is not None:
      checked, skip = spike_guard.judge(state.guard, state.step + 1, loss, grad_norm, guard)
    skips = guard is not None and guard.skip
    # On a skip the optimizer keeps its own state, before its step reads it: a select after
    # the update would copy the moments (bertjax.training.skipping).
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params,
                                          **({"skip": skip} if skips else {}))
    params = optax.apply_updates(state.params, updates)
    if skips:
      params = spike_guard.unless_skipped(skip, state.params, params)
  metrics = {**metrics, "loss": loss, "grad_norm": grad_norm,
             "learning_rate": schedule(state.step)}
  if "lm_loss" in metrics:
    metrics["perplexity"] = jnp.exp(metrics["lm_loss"])
  if guard is not None:
    metrics.update(spike_guard.metrics(checked, skip))
  return TrainState(state.step + 1, params, opt_state, state.rng, state.teacher,
                    checked), metrics


def eval_step(params: Any, batch: Batch, teacher: Any = None, *, loss_fn, rules) -> dict:
  with nn.logical_axis_rules(rules):
    extra = {} if teacher is None else {"teacher": teacher}
    loss, metrics = loss_fn(params, batch, loss_fn.normalizers(batch), None, **extra)
  return {**metrics, "loss": loss}


def predict_step(params: Any, batch: Batch, *, loss_fn, rules) -> jax.Array:
  """What a fine-tuning objective's dev metrics score (classes or regression outputs)."""
  with nn.logical_axis_rules(rules):
    return loss_fn.predict(params, batch)


def head_of(config: ml_collections.ConfigDict) -> str:
  """The model head a run trains: its fine-tuning task's, else the pre-training heads."""
  task = config.finetune.task
  return TASKS[task].head if task else "pretraining"


class Trainer:
  """Holds the model, objective, optimizer and the compiled, sharded step functions: the one
  trainer of pre-training and fine-tuning (objectives and configs of it)."""

  def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh) -> None:
    platform = mesh.devices.flat[0].platform
    # A config whose "auto" settings no run resolved (bench, doctor, a library user): here, for
    # the platform the step is compiled for (bertjax.training.loop resolves a run's first).
    config, choices = defaults.resolve(config, platform)
    for choice in choices:
      log.info("%s", choice.line())
    self.config = config
    self.mesh = mesh
    self.rules = sharding.resolve_rules(config.sharding_rules)
    # model.attention=auto becomes the fused kernel of the platform the step is compiled for,
    # model.matmul_output=auto its fast mixed-precision form.
    configured = model_config(config)
    if configured.attention == "auto":
      chosen, why = attention.choose(configured, platform)
      log.info("model.attention=%s (auto: %s)", chosen, why)
    self.model_config = precision.resolve(attention.resolve(configured, platform), platform)
    self.model = build_model(self.model_config, head_of(config))
    # A distillation run's teacher: its model config read from its files here, its weights
    # when the state is made or restored.
    self.teacher = (distillation.teacher_of(config, self.model_config, platform)
                    if distillation.enabled(config) else None)
    self.loss_fn = (
        objectives.build_objective(config.objective, self.model,
                                   float(config.get("discriminator_weight", 50.0)))
        if self.teacher is None else
        distillation.objective(config.objective, self.model, self.teacher, config.distillation))
    self.optimizer, self.schedule = optim.build_optimizer(
        config.optimizer, config.num_train_steps, config.get("phase2"),
        freeze_positions=bool(self.teacher
                              and config.distillation.freeze_position_embeddings),
        batch_ramp=ramp.from_config(config))
    self.accum_steps = int(config.grad_accum_steps)
    self.guard = spike_guard.GuardSettings.from_config(config)
    self.state_shardings = self._state_shardings()
    self._step = None
    self._eval = None
    self._predict = None
    # The teacher's parameters of the latest state this trainer made or stepped (evaluation
    # reads them; the step donates the state, so each step's output replaces them).
    self._teacher_params = None
    if self.teacher is not None:
      log.info("%s", distillation.describe(self.teacher))

  def _init_fn(self, rng: jax.Array) -> TrainState:
    """A new state without its teacher (a teacher is loaded, never initialised)."""
    param_rng, dropout_rng = jax.random.split(rng)
    params = nn.meta.unbox(init_params(self.model, param_rng))
    return TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params),
                      jax.random.key_data(dropout_rng),
                      guard=spike_guard.init(self.guard) if self.guard else None)

  def _abstract(self) -> TrainState:
    """The state's shapes and dtypes, the teacher's included."""
    abstract = jax.eval_shape(self._init_fn, jax.random.key(0))
    if self.teacher is None:
      return abstract
    return abstract.replace(teacher=self.teacher.abstract())

  def _state_shardings(self) -> TrainState:
    boxed = jax.eval_shape(lambda r: init_params(self.model, r), jax.random.key(0))
    param_sh = sharding.shardings_for(boxed, self.mesh, self.rules)
    abstract = jax.eval_shape(self._init_fn, jax.random.key(0))
    replicated = NamedSharding(self.mesh, PartitionSpec())
    opt_sh = optimizer_state_shardings(abstract.opt_state, param_sh, abstract.params,
                                       self.mesh)
    # The teacher is sharded by the same logical-axis rules as the student.
    teacher_sh = (None if self.teacher is None else
                  sharding.shardings_for(self.teacher.boxed_abstract(), self.mesh, self.rules))
    guard_sh = jax.tree.map(lambda _: replicated, abstract.guard)
    return TrainState(replicated, param_sh, opt_sh, replicated, teacher_sh, guard_sh)

  def abstract_state(self) -> TrainState:
    """Shapes, dtypes and shardings of the state, allocating nothing (restore targets)."""
    return sharding.abstract_with(self._abstract(), self.state_shardings)

  def init_state(self, seed: int) -> TrainState:
    """The initial state, created directly in its shardings; a distillation run's with its
    teacher's weights (and, with distillation.init_from_teacher, the student made from them)."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      state = jax.jit(self._init_fn, out_shardings=self.state_shardings.replace(teacher=None),
                      compiler_options=init_compiler_options())(jax.random.key(seed))
    if self.teacher is None:
      return state
    state = state.replace(teacher=self.teacher.load(self.abstract_state().teacher))
    settings = self.config.distillation
    if settings.init_from_teacher:
      with jax.set_mesh(self.mesh):
        params, kept = distillation.student_from_teacher(
            state.params, state.teacher, self.model_config, self.teacher.config,
            str(settings.teacher_layers), self.state_shardings.params)
      state = state.replace(params=params)
      log.info("initialised the student from the teacher's layers %s%s",
               settings.teacher_layers,
               f"; kept their initialisation: {', '.join(kept)}" if kept else "")
    self._teacher_params = state.teacher
    return state

  def data_sharding(self) -> NamedSharding:
    """How dimension 0 (rows) of every batch field is laid out over the mesh."""
    return batch_shardings({"rows": np.zeros(1)}, self.mesh, self.rules)["rows"]

  def compile_step(self, example_batch: dict[str, Any], accum_steps: int | None = None
                   ) -> Callable:
    """Jits the train and eval steps for batches like `example_batch` (a new phase with
    another batch shape or accumulation calls it again)."""
    if accum_steps:
      self.accum_steps = int(accum_steps)
    schema.check({k: v for k, v in example_batch.items() if k != faults.SCALE_FIELD},
                 self.config.objective, "a training batch")
    self.batch_shardings = batch_shardings(example_batch, self.mesh, self.rules)
    step = functools.partial(train_step, loss_fn=self.loss_fn, optimizer=self.optimizer,
                             schedule=self.schedule, accum_steps=self.accum_steps,
                             rules=self.rules, guard=self.guard)
    self._step = jax.jit(step, in_shardings=(self.state_shardings, self.batch_shardings),
                         out_shardings=(self.state_shardings, None), donate_argnums=(0,))
    # Evaluation batches never carry the fault lab's loss scale.
    eval_shardings = {k: v for k, v in self.batch_shardings.items() if k != faults.SCALE_FIELD}
    self._eval = jax.jit(functools.partial(eval_step, loss_fn=self.loss_fn, rules=self.rules),
                         in_shardings=(self.state_shardings.params, eval_shardings,
                                       self.state_shardings.teacher))
    if hasattr(self.loss_fn, "predict"):
      self._predict = jax.jit(
          functools.partial(predict_step, loss_fn=self.loss_fn, rules=self.rules),
          in_shardings=(self.state_shardings.params, eval_shardings))
    return self._step

  def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    with jax.set_mesh(self.mesh):
      state, metrics = self._step(state, batch)
    self._teacher_params = state.teacher
    return state, metrics

  def evaluate(self, params: Any, batch: Batch) -> dict:
    """The objective's metrics on `batch` (a distillation run's against the teacher of the
    latest state this trainer made or stepped)."""
    if self.teacher is not None and self._teacher_params is None:
      raise ValueError("evaluating a distillation run needs its teacher: make the state "
                       "(init_state) or run a step first")
    with jax.set_mesh(self.mesh):
      return self._eval(params, batch, self._teacher_params)

  def predict(self, params: Any, batch: Batch) -> jax.Array:
    with jax.set_mesh(self.mesh):
      return self._predict(params, batch)

  def with_weights(self, state: TrainState, weights: Any, source: str
                   ) -> tuple[TrainState, list[str], list[str]]:
    """`state` with the parameters `weights` (host arrays) placed in their shardings.

    Which weights are not loaded follows from the model (big_vision's transfer rule): the
    model's heads that `weights` lacks keep their fresh initialisation (an encoder fine-tuned
    or pre-trained on under a new head), and heads in `weights` the model does not have (an
    earlier task's classifier) are left out. Every encoder parameter must be there with its
    shape: a partial or different encoder is a wrong checkpoint, and a ValueError lists the
    parameters. Returns the state and the names of the fresh and the left-out parameters."""
    # The parameter-efficient additions (LoRA, adapters, prefixes) are new like a fresh head: a
    # base checkpoint lacks them, and they keep their initialisation.
    is_encoder = lambda name: (encoder_path(tuple(name.split("/"))) is not None  # noqa: E731
                               and not is_added(tuple(name.split("/"))))
    flat_state = flatten_dict(state.params, sep="/")
    flat_weights = flatten_dict(weights, sep="/")
    fresh = [k for k in flat_state if k not in flat_weights]
    dropped = [k for k in flat_weights if k not in flat_state and not is_encoder(k)]
    problems = shape_mismatches({k: v for k, v in flat_weights.items() if k not in dropped},
                                {k: v for k, v in flat_state.items()
                                 if k in flat_weights or is_encoder(k)}, "model")
    if problems:
      raise ValueError(f"{source} does not fit the model ({len(problems)} parameter(s)):\n  "
                       + "\n  ".join(problems[:20]))
    placed = {k: (jax.make_array_from_callback(
        v.shape, v.sharding, np.asarray(flat_weights[k], v.dtype).__getitem__)
                  if k in flat_weights else v) for k, v in flat_state.items()}
    return state.replace(params=unflatten_dict(placed, sep="/")), fresh, dropped

  def start_from(self, state: TrainState, source: str, step: int | None = None,
                 keep: tuple[str, ...] = ()) -> tuple[TrainState, Any]:
    """`state` with the weights of `source` (params-only, fine-tuned, a workdir's `step` or
    Hugging Face; local or an object store) in the trainer's shardings, and the weights'
    description (checkpoints.weights.Weights; None where restored straight into place).
    `keep`: only these top-level subtrees are loaded (a BERT encoder under a new task head);
    what is not loaded follows from the model (`with_weights`)."""
    path = paths.path(source)
    if (not keep and (path / "model.json").is_file()
        and not (path / FINETUNE_FILE).is_file()):
      saved = saved_abstract_params(path)
      if not shape_mismatches(flatten_dict(saved, sep="/"),
                              flatten_dict(state.params, sep="/"), "model"):
        # The same model: restored straight into its shardings, no host copy (pod scale).
        params, _ = load_params(path, self.state_shardings.params)
        log.info("initialised the parameters from %s", source)
        return state.replace(params=params), None
    weights = load_weights(source, step, scan_layers=self.model_config.scan_layers)
    params = weights.params
    if weights.config.has_generator and not self.model_config.has_generator:
      # Replaced-token detection's discriminator goes on alone (a DeBERTa-v3 residual added up).
      params = discriminator_params(params, weights.config)
    if keep:
      missing = [k for k in keep if k not in params]
      if missing:
        raise ValueError(f"{source}: no {', '.join(missing)} in these parameters (top-level "
                         f"keys: {', '.join(params)})")
      params = {k: params[k] for k in keep}
    state, fresh, dropped = self.with_weights(state, params, f"init_from={source}")
    log.info("initialised the parameters from %s%s%s", weights.source,
             f"; fresh: {', '.join(fresh)}" if fresh else "",
             f"; not loaded (the model has no such head): {', '.join(dropped)}" if dropped
             else "")
    return state, weights
