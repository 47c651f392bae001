"""Reading a compiled XLA program's text: matmul FLOPs and collectives per step.

XLA's `cost_analysis()` counts a while loop's body once, so a scanned 24-layer stack (and the
sharded matmul loops the TPU compiler emits) look like one iteration. `analyze_hlo` walks the
optimized HLO instead: every dot and convolution with XLA's own FLOP formula, and every
collective with the bytes of its result, each multiplied by the trip counts of the loops that
contain it (read from the loop's condition and induction variable). The text is one device's
SPMD program; callers multiply FLOPs by the device count.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all", "collective-broadcast")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*(?:\(.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  args: str    # the text between the opcode's parentheses (a constant's literal)
  attrs: str
  root: bool = False


def _split_shape(rest: str) -> tuple[str, str]:
  """'(f32[2], s32[]) all-reduce(...)' -> ('(f32[2], s32[])', 'all-reduce(...)')."""
  if rest.startswith("("):
    depth = 0
    for i, c in enumerate(rest):
      depth += c == "("
      depth -= c == ")"
      if depth == 0:
        return rest[:i + 1], rest[i + 1:].lstrip()
  head, _, tail = rest.partition(" ")
  return head, tail


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  shape, rest = _split_shape(m.group(2))
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  depth, end = 0, len(rest)
  for i in range(op.end() - 1, len(rest)):
    depth += rest[i] == "("
    depth -= rest[i] == ")"
    if depth == 0:
      end = i
      break
  # Operands are "%a, %b" (optimized HLO), "a, b" (before optimization) or "f32[2,3] %a, ...".
  operands, depth, piece = [], 0, ""
  for c in rest[op.end():end] + ",":
    if c == "," and depth == 0:
      if piece.strip():
        operands.append(piece.split()[-1].lstrip("%"))
      piece = ""
      continue
    depth += c in "([{"
    depth -= c in ")]}"
    piece += c
  return _Instr(m.group(1), shape, op.group(1), operands, rest[op.end():end], rest[end + 1:],
                line.lstrip().startswith("ROOT "))


def _dtype_bytes(dtype: str) -> float:
  """pred -> 1, bf16 -> 2, f8e4m3fn -> 1, c64 -> 8, s4 -> 0.5: the bits in the name / 8."""
  if dtype == "pred":
    return 1
  bits = re.search(r"\d+", dtype)
  return int(bits.group()) / 8 if bits else 0


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def _bytes(shape: str) -> float:
  return sum(_dtype_bytes(t) * math.prod(dims) for t, dims in _arrays(shape))


def _dims(shape: str) -> tuple[int, ...]:
  found = _arrays(shape)
  return found[0][1] if found else ()


def _dot_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  lhs = _dims(shapes.get(ins.operands[0], ""))
  contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
  k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
  return 2.0 * math.prod(_dims(ins.shape)) * k


# XLA:GPU rewrites dots into cuBLAS calls: custom-call(lhs, rhs[, bias]),
# custom_call_target="__cublas$gemm" (or "__cublas$lt$matmul..."), the dot's dimension numbers
# in the backend config as JSON lists of strings, and a tuple (result, workspace) as its shape.
_GEMM_TARGET = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_GEMM_LHS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _gemm_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  """A cuBLAS gemm custom call's FLOPs: 2 x the result's elements x the contracted size."""
  lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
  contracting = _GEMM_LHS_CONTRACTING.search(ins.attrs)
  if not lhs or not contracting:
    return 0.0
  k = math.prod(lhs[int(d.strip().strip('"'))] for d in contracting.group(1).split(",")
                if d.strip().strip('"'))
  return 2.0 * math.prod(_dims(ins.shape)) * k


def _conv_flops(ins: _Instr, shapes: dict[str, str]) -> float:
  """XLA's HloCostAnalysis::GetConvolutionFlops: 2 x FMAs over valid window positions."""
  lhs, rhs, out = (_dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], "")),
                   _dims(ins.shape))
  labels = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)", ins.attrs)
  if not (labels and lhs and rhs and out):
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = sorted(int(c) for c in lhs_l if c.isdigit())
  window = {}
  w = re.search(r"window=\{([^}]*)\}", ins.attrs)
  for field in (w.group(1).split() if w else []):
    key, _, value = field.partition("=")
    window[key] = value.split("x")
  fgc = re.search(r"feature_group_count=(\d+)", ins.attrs)
  bgc = re.search(r"batch_group_count=(\d+)", ins.attrs)
  counts = []
  for s in spatial:
    in_size, k_size, o_size = lhs[lhs_l.index(str(s))], rhs[rhs_l.index(str(s))], \
        out[out_l.index(str(s))]
    stride = int(window.get("stride", ["1"] * len(spatial))[s])
    pad_lo = int(window.get("pad", ["0_0"] * len(spatial))[s].split("_")[0])
    base = int(window.get("lhs_dilate", ["1"] * len(spatial))[s])
    wdil = int(window.get("rhs_dilate", ["1"] * len(spatial))[s])
    valid = 0
    for kidx in range(k_size):
      for oidx in range(o_size):
        undilated = oidx * stride - pad_lo + kidx * wdil
        if undilated % base:
          continue
        if 0 <= undilated // base < in_size:
          valid += 1
    counts.append(valid)
  fma = (lhs[lhs_l.index("f")] // (int(fgc.group(1)) if fgc else 1)) * out[out_l.index("f")] \
      * (lhs[lhs_l.index("b")] // (int(bgc.group(1)) if bgc else 1)) * math.prod(counts)
  return 2.0 * fma


@dataclasses.dataclass
class HloStats:
  """Per-device counts of one step's program (loops unrolled by their trip counts)."""
  matmul_flops: float = 0.0
  # kind -> [executions, bytes of their results]
  collectives: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  unknown_trip_counts: int = 0
  # Bytes each device sends over the interconnect for those collectives with ring algorithms
  # (`_wire_bytes`): what a communication time is estimated from.
  wire_bytes: float = 0.0

  def add(self, other: HloStats, times: float) -> None:
    self.matmul_flops += other.matmul_flops * times
    self.wire_bytes += other.wire_bytes * times
    for kind, (count, size) in other.collectives.items():
      entry = self.collectives.setdefault(kind, [0.0, 0.0])
      entry[0] += count * times
      entry[1] += size * times
    self.unknown_trip_counts += other.unknown_trip_counts


def _group_size(attrs: str) -> int | None:
  """Devices per replica group: `replica_groups={{0,1,2,3},{4,5,6,7}}` (4) or the iota form
  `replica_groups=[2,4]<=[8]` (4); None when not stated (all devices)."""
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if iota:
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([\d,]+)\}", attrs)
  return len(listed.group(1).split(",")) if listed else None


def _wire_bytes(kind: str, size: float, group: int | None, full: float | None = None) -> float:
  """Bytes one device sends for a collective of result `size` over `group` devices, with ring
  algorithms: an all-gather sends (n-1)/n of its result, a reduce-scatter (n-1)/n of its input
  (`full`), an all-reduce both phases, 2 (n-1)/n of its size; a permute its whole result."""
  share = 1.0 if not group or group < 2 else (group - 1) / group
  if kind == "all-reduce":
    return 2 * size * share
  if kind == "reduce-scatter":
    return (full if full is not None else size * (group or 1)) * share
  if kind in ("all-gather", "all-to-all"):
    return size * share
  return size


def _through(name: str, table: dict[str, _Instr]) -> _Instr | None:
  """The instruction defining `name`, looking through copies, converts and bitcasts."""
  ins = table.get(name)
  while ins is not None and ins.opcode in ("copy", "convert", "bitcast") and ins.operands:
    ins = table.get(ins.operands[0])
  return ins


def _int_constant(ins: _Instr | None) -> int | None:
  if ins is not None and ins.opcode == "constant" and re.fullmatch(r"-?\d+", ins.args.strip()):
    return int(ins.args)
  return None


def _tuple_index(ins: _Instr | None) -> int | None:
  if ins is not None and ins.opcode == "get-tuple-element":
    index = re.search(r"index=(\d+)", ins.attrs)
    return int(index.group(1)) if index else None
  return None


def _trip_count(while_ins: _Instr, caller: dict[str, _Instr],
                computations: dict[str, list[_Instr]]) -> int | None:
  """Iterations of a counted loop `for (i = start; i < limit; i += step)`: XLA's own annotation
  when present, else read off the condition (i < limit), the body's update of i (jax's scans
  step by 1; the SPMD partitioner's windowed einsums by 2) and the initial tuple (start)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', while_ins.attrs)
  if known:
    return int(known.group(1))
  names = {key: re.search(key + r"=%?([^\s,]+)", while_ins.attrs)
           for key in ("condition", "body")}
  if not all(names.values()):
    return None
  cond = {i.name: i for i in computations.get(names["condition"].group(1), [])}
  body = computations.get(names["body"].group(1), [])
  index = limit = None
  for ins in cond.values():
    if ins.opcode != "compare" or len(ins.operands) != 2:
      continue
    a, b = (_through(o, cond) for o in ins.operands)
    if "direction=LT" in ins.attrs and _int_constant(b) is not None:
      index, limit = _tuple_index(a), _int_constant(b)
    elif "direction=GT" in ins.attrs and _int_constant(a) is not None:
      index, limit = _tuple_index(b), _int_constant(a)
  if index is None or limit is None or not body:
    return None
  table = {i.name: i for i in body}
  root = next((i for i in body if i.root), body[-1])
  step = None
  if root.opcode == "tuple" and index < len(root.operands):
    update = _through(root.operands[index], table)
    if update is not None and update.opcode == "add" and len(update.operands) == 2:
      x, y = (_through(o, table) for o in update.operands)
      if _tuple_index(x) == index and _int_constant(y):
        step = _int_constant(y)
      elif _tuple_index(y) == index and _int_constant(x):
        step = _int_constant(x)
  if not step or step < 0:
    return None
  start = 0
  init = _through(while_ins.operands[0], caller) if while_ins.operands else None
  if init is not None and init.opcode == "tuple" and index < len(init.operands):
    value = _int_constant(_through(init.operands[index], caller))
    start = value if value is not None else 0
  return max(0, -(-(limit - start) // step))


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
  """The module's computations by name, and the ENTRY computation's name."""
  computations: dict[str, list[_Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None or line.strip() == "}":
      continue
    ins = _parse_instr(line)
    if ins:
      computations[current].append(ins)
  return computations, entry


def _channel(ins: _Instr) -> str | None:
  """The channel id of a collective the TPU compiler split into pieces, or None.

  libtpu decomposes an asynchronous collective into an AsyncCollectiveStart fusion, continuation
  fusions interleaved with compute and an AsyncCollectiveDone fusion. Every piece holds a copy
  of the same collective (same channel_id, full result shape, `async_collective_fusion_config`
  naming the steps it runs), yet together they move the data once."""
  if "async_collective_fusion_config" not in ins.attrs:
    return None
  channel = re.search(r"channel_id=(\d+)", ins.attrs)
  return channel.group(1) if channel else None


# The backend config of libtpu's reduce-scatter fusions ("AllReduceScatterFusion",
# "SingleInputAllReduceScatterFusion").
_REDUCE_SCATTER_FUSION = re.compile(r'"emitter":"\w*AllReduceScatterFusion"')


def analyze_hlo(text: str) -> HloStats:
  """Matmul FLOPs and collectives of an optimized HLO module (one device's program).

  A collective split into asynchronous pieces (see `_channel`) counts once per execution of
  the computation that runs its fusions."""
  computations, entry = _computations(text)
  memo: dict[str, HloStats] = {}

  def visit(name: str) -> HloStats:
    """A computation run as a unit (the entry, a loop body, a branch): its own scope."""
    if name in memo:
      return memo[name]
    stats = HloStats()
    memo[name] = stats  # guards against cycles
    walk(name, stats, set(), {name})
    return stats

  def walk(name: str, stats: HloStats, seen: set, stack: set[str],
           collectives: bool = True) -> None:
    """Adds `name`'s instructions to `stats`; fusions and calls join the caller's scope
    (`seen`: channels already counted there). `collectives=False`: a fused reduce-scatter's
    body, counted by its fusion."""
    body = computations.get(name, [])
    table = {i.name: i for i in body}
    shapes = {i.name: i.shape for i in body}
    for ins in body:
      op = ins.opcode
      if op == "dot":
        stats.matmul_flops += _dot_flops(ins, shapes)
      elif op == "convolution":
        stats.matmul_flops += _conv_flops(ins, shapes)
      elif op == "custom-call" and _GEMM_TARGET.search(ins.attrs):
        stats.matmul_flops += _gemm_flops(ins, shapes)
      kind = op.removesuffix("-done")
      if op == "fusion" and _REDUCE_SCATTER_FUSION.search(ins.attrs):
        # libtpu's fused reduce-scatter: an all-reduce whose result is sliced to this device's
        # shard inside one fusion. It is a reduce-scatter; its result is the shard.
        entry_ = stats.collectives.setdefault("reduce-scatter", [0.0, 0.0])
        entry_[0] += 1
        entry_[1] += _bytes(ins.shape)
        inner = [i for called in re.findall(r"calls=%?([^\s,]+)", ins.attrs)
                 for i in computations.get(called, []) if i.opcode.startswith("all-reduce")]
        stats.wire_bytes += (_wire_bytes("reduce-scatter", _bytes(ins.shape),
                                         _group_size(inner[0].attrs), _bytes(inner[0].shape))
                             if inner else _bytes(ins.shape))
        collectives_inside = False
      else:
        collectives_inside = collectives
      if collectives and kind in COLLECTIVES and not op.endswith("-start"):
        channel = _channel(ins)
        if channel is None or (kind, channel) not in seen:
          seen.add((kind, channel))
          entry_ = stats.collectives.setdefault(kind, [0.0, 0.0])
          entry_[0] += 1
          entry_[1] += _bytes(ins.shape)
          stats.wire_bytes += _wire_bytes(kind, _bytes(ins.shape), _group_size(ins.attrs))
      if op == "while":
        trips = _trip_count(ins, table, computations)
        if trips is None:
          stats.unknown_trip_counts += 1
          trips = 1
        for key in ("body", "condition"):
          called = re.search(key + r"=%?([^\s,]+)", ins.attrs)
          if called:
            stats.add(visit(called.group(1)), trips)
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        names = re.findall(r"%?([^\s,]+)", branches.group(1)) if branches else []
        if names:  # the most expensive branch
          stats.add(max((visit(n) for n in names), key=lambda s: s.matmul_flops), 1)
      elif op in ("fusion", "call", "async-start") or op.endswith("-start"):
        for called in re.findall(r"(?:calls|to_apply)=%?([^\s,]+)", ins.attrs):
          if called not in stack:
            walk(called, stats, seen, stack | {called}, collectives_inside)

  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return visit(entry)


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# What each executed instruction is for (reading a profile against the program)

# cuDNN's fused attention as XLA:GPU calls it (forward and backward; "__cudnn$fmhaSoftmax",
# "...Backward"), and the Pallas/Mosaic kernels (splash attention on a TPU).
_FUSED_ATTENTION_TARGET = re.compile(r'custom_call_target="(?:__cudnn\$fmha|tpu_custom_call)')
# Control flow: their time is the time of the instructions they run, which are timed themselves.
_CONTAINERS = ("while", "call", "conditional", "async-start", "async-done")
# First match wins, on the instruction's metadata op_name (the JAX source path it came from).
_PURPOSES = (
    ("dropout: random bits and masks", ("dropout", "_bernoulli", "random_bits", "threefry")),
    ("layer norm", ("norm/",)),
    ("attention: mask, softmax", ("/attention/",)),
    ("MLP activation", ("/mlp/",)),
    ("embeddings, heads, loss", ("embed", "/mlm", "/nsp", "/pooler", "/lm_head", "log_softmax",
                                 "jvp()", "/head")),
)


def instruction_purposes(text: str) -> dict[str, str]:
  """Optimized-HLO instruction name -> what it does: "matmul" (a dot or convolution, or a
  fusion around one), "buffer fills (broadcasts)", a `_PURPOSES` label from the JAX source
  path in its metadata, "scan: per-layer slices and stacking" (dynamic slices the layer loop
  adds), "optimizer update" (outside the model's forward and backward), or "other".
  Control-flow instructions are left out: a profile times what they run. Names are unique in a
  module, and are what CPU profiles call each executed op."""
  computations, _ = _computations(text)
  has_dot: dict[str, bool] = {}

  def computes_matmul(name: str) -> bool:
    if name not in has_dot:
      has_dot[name] = False  # guards against cycles
      has_dot[name] = any(
          i.opcode in ("dot", "convolution")
          or (i.opcode == "fusion"
              and any(computes_matmul(c) for c in re.findall(r"calls=%?([^\s,]+)", i.attrs)))
          for i in computations.get(name, []))
    return has_dot[name]

  purposes: dict[str, str] = {}
  for body in computations.values():
    for ins in body:
      if ins.opcode in _CONTAINERS or ins.opcode in ("parameter", "constant", "tuple",
                                                      "get-tuple-element", "bitcast"):
        continue
      called = re.findall(r"calls=%?([^\s,]+)", ins.attrs)
      op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
      source = op_name.group(1).lower() if op_name else ""
      if (ins.opcode in ("dot", "convolution") or any(computes_matmul(c) for c in called)
          or ins.opcode == "custom-call" and _GEMM_TARGET.search(ins.attrs)):
        purposes[ins.name] = "matmul"
      elif ins.opcode == "custom-call" and _FUSED_ATTENTION_TARGET.search(ins.attrs):
        purposes[ins.name] = "attention: fused kernel"
      elif ins.opcode == "broadcast" or ins.name.startswith("wrapped_broadcast"):
        # Filling a buffer: under scan, mostly the zeroed [layers, ...] stacks of gradients
        # and of activations saved for the backward pass.
        purposes[ins.name] = "buffer fills (broadcasts)"
      elif label := next((label for label, keys in _PURPOSES
                          if any(k in source for k in keys)), None):
        purposes[ins.name] = label
      elif "dynamic-slice" in ins.name or "dynamic-update-slice" in ins.name:
        purposes[ins.name] = "scan: per-layer slices and stacking"
      elif source and "jvp(" not in source and "transpose(" not in source:
        purposes[ins.name] = "optimizer update"
      else:
        purposes[ins.name] = "other"
  return purposes
