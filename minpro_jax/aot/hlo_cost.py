"""Per-loop-iteration cost of a compiled program, read from its optimized HLO text.

XLA's `cost_analysis()` counts a while loop's body once whatever its trip count, and the collectives it lists are
static counts. This module walks the HLO's call graph instead: every `while` is a loop node whose body cost is
multiplied by its trip count (XLA's `known_trip_count` annotation, the count read off a counted loop's condition
and step, or a count the caller supplies for data-dependent loops such as the sampler's decode loop), every `conditional` a node whose branches are weighted (by the caller, or
the most expensive branch), so nested loops (decode steps x layers, micro-batches x layers x log-prob chunks) scale
by the product of their trip counts.

Per computation (its own instructions, fused computations included, nested loops excluded):
- FLOPs: 2 x |result| x |contracted dims| of every `dot`, and of the `convolution`s XLA:TPU rewrites dots into
  (custom calls such as Pallas kernels are opaque: 0; the caller may add an analytic count);
- HBM bytes: for every top-level instruction that touches memory, its operands read plus its result written, where
  a fusion operand used only through (dynamic-)slices or gathers counts the sliced bytes and an in-place
  dynamic-update-slice or scatter counts its update, not the whole buffer (as XLA's own fusion cost analysis does);
  a paged attention kernel (`DMA_KERNELS`) counts its result only: it copies the pages it reads from HBM itself,
  which the HLO cannot show, so the caller adds them analytically (`aot.paged_schedule.analytic_kv`);
  async copies and slices into VMEM (`copy-start`, `slice-start`) and `ConcatBitcast` count nothing: the op that
  reads their result counts those bytes (once);
  an async slice of, or update into, a host-memory buffer (a remat policy's offloaded activations) counts the
  slice or update once: its HBM side (`host_transfer_bytes`; the forecast adds its PCIe time);
- collectives: kind, result bytes, group size, the mesh axes the group spans, and the bytes one chip receives over
  ICI (all-gather R(n-1)/n, reduce-scatter R(n-1), all-reduce 2R(n-1)/n, all-to-all R(n-1)/n, permute R; R the
  result, n the group size: ring algorithms).

Time (`Chip` figures): an instruction group takes max(FLOPs / peak, HBM bytes / bandwidth) + ICI bytes / ICI
bandwidth when communication does not overlap compute ("serial"), max of the three when it fully does
("overlapped"); both are estimates from compiled programs, not measurements.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Sequence

import numpy as np

from minpro_jax.aot.analysis import COLLECTIVES, array_bytes
from minpro_jax.aot.hlo_text import (
    ARRAY,
    Computation,
    Instr,
    attr,
    called,
    dims,
    inferred_trip_count,
    known_trip_count,
    parse_hlo,
    shape_bytes,
)

# Pallas kernels (custom calls, by instruction name) that take their big operands in HBM and DMA only the parts
# they read: jax's paged attention kernels, given the whole page pool and reading each row's own pages
DMA_KERNELS = ("paged_attention", "ragged_paged_attention")
# XLA:TPU custom calls that move no bytes: ConcatBitcast joins buffers that lie side by side (a weight's async slices)
NO_BYTES_TARGETS = ('custom_call_target="ConcatBitcast"',)

NO_MEMORY = {  # ops that move no HBM bytes of their own (and launch no kernel)
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "async-start",
    "async-update",
    "async-done",
    "copy-start",  # an async copy (HBM to VMEM, host offload): its consumer counts the bytes it reads
    "copy-done",
    "slice-start",  # XLA:TPU's async slice of a weight into VMEM: likewise
    "slice-done",
    "send",
    "send-done",
    "recv",
    "recv-done",
}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # ops that update operand 0 in place: index of the update
HOST_SPACE = "S(5)"  # XLA:TPU's memory space of pinned host memory (a remat policy's offloaded activations)


def host_transfer_bytes(ins: Instr, comp: Computation) -> float:
  """Bytes an async slice or update moves between HBM and host memory (`dynamic-slice-start` of a host buffer,
  `dynamic-update-slice-start` into one, a `copy-start` to or from one), else 0."""
  big = comp.by_name.get(ins.operands[0]) if ins.operands else None
  if ins.opcode == "dynamic-update-slice-start" and big is not None and HOST_SPACE in big.shape:
    upd = comp.by_name.get(ins.operands[1]) if len(ins.operands) > 1 else None
    return shape_bytes(upd.shape) if upd else 0.0
  if ins.opcode == "dynamic-slice-start" and big is not None and HOST_SPACE in big.shape:
    return _slice_bytes(ins, big)
  if ins.opcode == "copy-start" and HOST_SPACE in ins.shape:
    return shape_bytes(big.shape) if big else 0.0
  return 0.0


def _slice_bytes(ins: Instr, operand: Instr) -> float:
  """The bytes of a (dynamic-)slice-start's slice: its `dynamic_slice_sizes` at its operand's element size."""
  sizes = [int(x) for x in re.findall(r"\d+", attr(ins.attrs, "dynamic_slice_sizes") or "")]
  arrays = ARRAY.findall(operand.shape)
  if not sizes or not arrays:
    return 0.0
  full = array_bytes(*arrays[0])
  return full * math.prod(sizes) / max(math.prod(dims(operand.shape) or [1]), 1)


# ------------------------------------------------------------------------------------------- collectives
@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction as one chip sees it (fields below; `ici_bytes` by the ring formulas of the module
  docstring)."""

  kind: str  # one of analysis.COLLECTIVES
  result_bytes: float
  group_size: int
  axes: tuple[str, ...]  # mesh axes the group spans ("?" when the groups could not be read)
  ici_bytes: float  # received by one chip over ICI
  group: tuple[int, ...] = ()  # the partition ids of its first group (() when unreadable)
  pair: tuple[int, int] | None = None  # a collective-permute's first (source, target)


def replica_group_ids(text: str | None, num_partitions: int) -> np.ndarray | None:
  """[groups, size] device (partition) ids of a `replica_groups=` value in any of XLA's three spellings: explicit
  `{{0,1},{2,3}}`, iota `[2,2]<=[4]` / `[2,2]<=[2,2]T(1,0)`, or mesh `mesh['axis_0'=2,'axis_1'=2] {'axis_1'}`.
  Empty (`{}`): every partition in one group. None when unreadable."""
  if text is None:
    return None
  text = text.strip()
  if text.startswith("mesh"):
    sizes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", text.split("]", 1)[0])]
    sub = re.findall(r"'([^']+)'", text.split("]", 1)[1]) if "]" in text else []
    names = [a for a, _ in sizes]
    ids = np.arange(math.prod(n for _, n in sizes)).reshape([n for _, n in sizes] or [1])
    inner = [names.index(a) for a in sub if a in names]
    outer = [i for i in range(len(names)) if i not in inner]
    size = math.prod(sizes[i][1] for i in inner) if inner else 1
    return ids.transpose(outer + inner).reshape(-1, size)
  m = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  if m:
    groups = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1, groups[-1]) if len(groups) > 1 else ids.reshape(1, -1)
  inner = re.findall(r"\{([\d,\s]*)\}", text[1:-1] if text.startswith("{") else text)
  rows = [[int(x) for x in g.split(",") if x.strip()] for g in inner]
  rows = [r for r in rows if r]
  if not rows:
    return np.arange(num_partitions).reshape(1, -1)
  if len({len(r) for r in rows}) != 1:
    return None
  return np.asarray(rows)


def _axes(ids: np.ndarray | None, mesh_shape: dict[str, int] | None) -> tuple[str, ...]:
  if ids is None or not mesh_shape:
    return ("?",)
  sizes = list(mesh_shape.values())
  if ids.max() >= math.prod(sizes):
    return ("?",)
  coords = np.stack(np.unravel_index(ids[0], sizes))  # [axes, group]
  return tuple(a for a, c in zip(mesh_shape, coords) if len(set(c.tolist())) > 1)


def collective_of(ins: Instr, comp: Computation, num_partitions: int, mesh_shape) -> Collective | None:
  """The `Collective` instruction `ins` is (a `-start` counts, its `-done` not), or None for any other op."""
  op = ins.opcode.removesuffix("-start")
  op = op.removeprefix("ragged-")
  if op not in COLLECTIVES or ins.opcode.endswith("-done"):
    return None
  arrays = [array_bytes(d, s) for d, s in ARRAY.findall(ins.shape)]
  result = (max(arrays) if ins.opcode.endswith("-start") else sum(arrays)) if arrays else 0.0
  if op == "collective-permute":
    pairs = _pairs(ins)
    pair = (int(pairs[0, 0]), int(pairs[0, 1])) if pairs is not None else None
    return Collective(op, result, 2, _axes(pairs, mesh_shape), result, pair=pair)
  ids = replica_group_ids(attr(ins.attrs, "replica_groups"), num_partitions)
  n = int(ids.shape[1]) if ids is not None else num_partitions
  if op == "reduce-scatter" and ins.opcode.endswith("-start"):
    result /= max(n, 1)  # the -start tuple's largest array is the operand
  frac = (n - 1) / n if n > 1 else 0.0
  ici = {"all-gather": result * frac, "all-reduce": 2 * result * frac, "all-to-all": result * frac}.get(op)
  if op == "reduce-scatter":
    ici = result * (n - 1)
  group = tuple(int(i) for i in ids[0]) if ids is not None else ()
  return Collective(op, result, n, _axes(ids, mesh_shape), float(ici), group)


def _pairs(ins: Instr) -> np.ndarray | None:
  v = attr(ins.attrs, "source_target_pairs")
  pairs = re.findall(r"\{(\d+),(\d+)\}", v or "")
  return np.asarray([[int(a), int(b)] for a, b in pairs[:1]]) if pairs else None


# ------------------------------------------------------------------------------------------------ costs
@dataclasses.dataclass
class Cost:
  """FLOPs, HBM bytes and ICI bytes per chip, and the collectives by kind ({kind: {count, bytes, ici_bytes,
  axes}}); `+` adds, `*` scales by a trip count."""

  flops: float = 0.0
  hbm_bytes: float = 0.0
  ici_bytes: float = 0.0
  collectives: dict = dataclasses.field(default_factory=dict)

  def __add__(self, o: "Cost") -> "Cost":
    col = {k: dict(v, axes=list(v["axes"])) for k, v in self.collectives.items()}
    for k, v in o.collectives.items():
      c = col.setdefault(k, {"count": 0.0, "bytes": 0.0, "ici_bytes": 0.0, "axes": []})
      c["count"] += v["count"]
      c["bytes"] += v["bytes"]
      c["ici_bytes"] += v["ici_bytes"]
      c["axes"] = sorted(set(c["axes"]) | set(v["axes"]))
    return Cost(self.flops + o.flops, self.hbm_bytes + o.hbm_bytes, self.ici_bytes + o.ici_bytes, col)

  def __mul__(self, k: float) -> "Cost":
    col = {
        n: {"count": v["count"] * k, "bytes": v["bytes"] * k, "ici_bytes": v["ici_bytes"] * k, "axes": list(v["axes"])}
        for n, v in self.collectives.items()
    }
    return Cost(self.flops * k, self.hbm_bytes * k, self.ici_bytes * k, col)

  def as_dict(self) -> dict:
    """The cost as plain JSON-ready values."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Rates:
  """A chip's peaks: FLOP/s, HBM bytes/s and ICI bytes/s received per chip (0: unknown, no time)."""

  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float

  def times(self, c: Cost) -> dict[str, float]:
    """{compute, memory, ici, serial, overlapped, limiter} seconds of cost `c` (module docstring)."""
    t = {
        "compute": c.flops / self.peak_flops if self.peak_flops else 0.0,
        "memory": c.hbm_bytes / self.hbm_bandwidth if self.hbm_bandwidth else 0.0,
        "ici": c.ici_bytes / self.ici_bandwidth if self.ici_bandwidth else 0.0,
    }
    t["serial"] = max(t["compute"], t["memory"]) + t["ici"]
    t["overlapped"] = max(t["compute"], t["memory"], t["ici"])
    t["limiter"] = max(("compute", "memory", "ici"), key=lambda k: t[k])
    return t


@dataclasses.dataclass
class Node:
  """A computation as it runs at one call site: its own cost, the loops / conditionals it contains, and how often
  it runs per run of its parent (`trips`: a loop's trip count, a branch's weight, 1 otherwise).

  kind: "entry", "while", "branch" or "call"; `trip_source`: "known" (XLA's annotation), "inferred" (read off a
  counted loop's condition, start and step), "given" (the caller's resolver), "unknown" (counted once), "weight" or "max" (a conditional branch: the caller's weight, or the
  costliest branch when no weight was given). `comps`: the computations whose own instructions make `own` (a
  loop's body and condition); `instr`: the instruction of the parent's computation that runs it.
  """

  name: str
  kind: str
  trips: float
  trip_source: str
  own: Cost
  own_serial: float = 0.0  # seconds of `own` (rates applied)
  own_overlapped: float = 0.0
  children: list["Node"] = dataclasses.field(default_factory=list)
  op_name: str = ""
  comps: tuple[str, ...] = ()
  instr: str = ""

  def per_run(self) -> Cost:
    """The cost of one run (one iteration, for a loop): own + every child's trips x its per-run cost."""
    total = self.own
    for ch in self.children:
      total = total + ch.per_run() * ch.trips
    return total

  def seconds_per_run(self, overlapped: bool) -> float:
    """Seconds of one run: own time plus every child's trips x its time (`overlapped` picks the column)."""
    own = self.own_overlapped if overlapped else self.own_serial
    return own + sum(ch.trips * ch.seconds_per_run(overlapped) for ch in self.children)

  def walk(self, depth: int = 0):
    """(depth, node) of this node and every descendant, depth first."""
    yield depth, self
    for ch in self.children:
      yield from ch.walk(depth + 1)


WhileResolver = Callable[[Instr, Sequence[str]], "int | None"]
BranchResolver = Callable[[Instr, int, Sequence[str]], "Sequence[float] | None"]


class HloCost:
  """The loop tree of one optimized HLO module with per-iteration costs.

  Args:
    text: `compiled.as_text()`.
    num_partitions: devices the program runs on (for `replica_groups={}`).
    mesh_shape: {axis: size} of the mesh, in the device order the program was compiled with (names the axes a
      collective's group spans); None: axes "?".
    rates: a chip's `Rates` (None: no times).
    while_trips: f(while instruction, enclosing loop names) -> trip count for loops XLA has no count for (None:
      counted once and flagged "unknown").
    branch_weights: f(conditional instruction, number of branches, enclosing loop names) -> a weight per branch
      (how often each runs per run of the conditional); None: the costliest branch, flagged "max".
  """

  def __init__(
      self,
      text: str,
      num_partitions: int,
      mesh_shape: dict[str, int] | None = None,
      rates: Rates | None = None,
      while_trips: WhileResolver | None = None,
      branch_weights: BranchResolver | None = None,
  ):
    self.comps = parse_hlo(text)
    self.scheduled = "is_scheduled=true" in text[: text.find("\n") if "\n" in text else len(text)]
    self.num_partitions, self.mesh_shape = num_partitions, mesh_shape
    self.rates = rates or Rates(0.0, 0.0, 0.0)
    self.while_trips, self.branch_weights = while_trips, branch_weights
    self._own: dict[str, Cost] = {}
    entry = next(c for c in self.comps.values() if c.entry)
    self.root = self._node(entry.name, "entry", 1.0, "known", ())

  # ---- own costs
  def own_cost(self, name: str) -> Cost:
    """The cost of computation `name`'s own instructions (fusions and async wrappers included, loops not)."""
    if name not in self._own:
      comp = self.comps[name]
      cost = Cost()
      for ins in comp.instrs:
        cost = cost + self.instr_cost(ins, comp)
      self._own[name] = cost
    return self._own[name]

  def instr_cost(self, ins: Instr, comp: Computation) -> Cost:
    """The cost of one instruction of `comp` (a fusion's fused computation included; a loop's body not)."""
    c = Cost()
    col = collective_of(ins, comp, self.num_partitions, self.mesh_shape)
    if col is not None:
      entry = {"count": 1.0, "bytes": col.result_bytes, "ici_bytes": col.ici_bytes, "axes": list(col.axes)}
      return Cost(ici_bytes=col.ici_bytes, collectives={col.kind: entry})
    c.flops += _matmul_flops(ins, comp)
    if ins.opcode == "fusion":
      for callee in called(ins.attrs, "calls"):
        if callee in self.comps:
          c.flops += sum(_matmul_flops(i, self.comps[callee]) for i in self.comps[callee].instrs)
      c.hbm_bytes += self._fusion_bytes(ins, comp)
    elif ins.opcode == "custom-call" and ins.name.startswith(DMA_KERNELS):
      c.hbm_bytes += shape_bytes(ins.shape)
    elif ins.opcode == "custom-call" and any(t in ins.attrs for t in NO_BYTES_TARGETS):
      pass
    elif ins.opcode in ("async-start",):
      for callee in called(ins.attrs, "calls"):
        if callee in self.comps:
          c = c + self.own_cost(callee)
    elif ins.opcode not in NO_MEMORY and not ins.opcode.endswith("-done"):
      c.hbm_bytes += self._plain_bytes(ins, comp)
    return c

  def _plain_bytes(self, ins: Instr, comp: Computation) -> float:
    out = shape_bytes(ins.shape)
    if ins.opcode in _SLICING:
      return 2 * out
    if ins.opcode in ("dynamic-update-slice-start", "dynamic-slice-start"):
      # async: to or from host memory, one side of the transfer is HBM; else read and written in HBM
      host = host_transfer_bytes(ins, comp)
      if host:
        return host
      if ins.opcode == "dynamic-slice-start":
        return 2 * _slice_bytes(ins, comp.by_name[ins.operands[0]]) if ins.operands[0] in comp.by_name else 0.0
      upd = comp.by_name.get(ins.operands[1]) if len(ins.operands) > 1 else None
      return 2 * (shape_bytes(upd.shape) if upd else 0.0)
    update_at = _IN_PLACE.get(ins.opcode)
    if update_at is not None and len(ins.operands) > update_at:
      upd = comp.by_name.get(ins.operands[update_at])
      return 2 * (shape_bytes(upd.shape) if upd else 0.0)
    reads = sum(shape_bytes(comp.by_name[o].shape) for o in ins.operands if o in comp.by_name)
    return reads + out

  def _fusion_bytes(self, ins: Instr, comp: Computation) -> float:
    callee = next((c for c in called(ins.attrs, "calls") if c in self.comps), None)
    operands = [comp.by_name.get(o) for o in ins.operands]
    if callee is None:
      return sum(shape_bytes(o.shape) for o in operands if o) + shape_bytes(ins.shape)
    fused = self.comps[callee]
    params = {int(i.args): i for i in fused.instrs if i.opcode == "parameter" and i.args.strip().isdigit()}
    users: dict[str, list[Instr]] = {}
    for i in fused.instrs:
      for o in i.operands:
        users.setdefault(o, []).append(i)

    def through_bitcasts(name: str) -> list[Instr]:
      out = []
      for u in users.get(name, []):
        out.extend(through_bitcasts(u.name) if u.opcode == "bitcast" else [u])
      return out

    roots = [fused.root]
    if fused.root.opcode == "tuple":
      roots = [fused.by_name[o] for o in fused.root.operands if o in fused.by_name]
    in_place, written = set(), 0.0
    for r in roots:
      update_at = _IN_PLACE.get(r.opcode)
      if update_at is not None and len(r.operands) > update_at:
        buf = r.operands[0]
        while buf in fused.by_name and fused.by_name[buf].opcode == "bitcast":
          buf = fused.by_name[buf].operands[0]
        in_place.add(buf)
        upd = fused.by_name.get(r.operands[update_at])
        written += shape_bytes(upd.shape) if upd else 0.0
      else:
        written += shape_bytes(r.shape)
    read = 0.0
    for index, op in enumerate(operands):
      p = params.get(index)
      if p is None:
        read += shape_bytes(op.shape) if op else 0.0
        continue
      full = shape_bytes(op.shape) if op else shape_bytes(p.shape)
      if p.name in in_place:
        continue  # read and written in place: the update is counted as written
      us = through_bitcasts(p.name)
      if us and all(u.opcode in _SLICING and u.operands and u.operands[0] in _alias_chain(p.name, fused) for u in us):
        read += min(full, sum(shape_bytes(u.shape) for u in us))
      else:
        read += full
    return read + written

  # ---- the tree
  def _node(self, name: str, kind: str, trips: float, source: str, path: tuple[str, ...], op_name: str = "",
            instr: str = "") -> Node:  # fmt: skip
    own = self.own_cost(name)
    t = self.rates.times(own)
    node = Node(name, kind, trips, source, own, t["serial"], t["overlapped"], op_name=op_name, comps=(name,),
                instr=instr)  # fmt: skip
    for ins in self.comps[name].instrs:
      if ins.opcode == "while":
        body = called(ins.attrs, "body")[0]
        cond = called(ins.attrs, "condition")[0]
        n, src = known_trip_count(ins), "known"
        if n is None:
          n, src = inferred_trip_count(ins, self.comps[name], self.comps), "inferred"
        if n is None and self.while_trips is not None:
          n, src = self.while_trips(ins, path), "given"
        if n is None:
          n, src = 1, "unknown"
        child = self._node(body, "while", float(n), src, path + (ins.name,), _op_name(ins), ins.name)
        cond_node = self._node(cond, "call", 1.0, "known", path + (ins.name,))
        child.own, child.own_serial = child.own + cond_node.own, child.own_serial + cond_node.own_serial
        child.own_overlapped += cond_node.own_overlapped
        child.name, child.comps = ins.name, (body, cond)
        node.children.append(child)
      elif ins.opcode == "conditional":
        branches = called(ins.attrs, "branch_computations") or (
            called(ins.attrs, "true_computation") + called(ins.attrs, "false_computation")
        )
        if attr(ins.attrs, "branch_computations") is None and len(branches) == 2:
          branches = branches[::-1]  # pred conditional: index 0 is false
        kids = [
            self._node(b, "branch", 1.0, "max", path + ("?" + ins.name,), _op_name(ins), ins.name) for b in branches
        ]
        weights = self.branch_weights(ins, len(kids), path) if self.branch_weights else None
        if weights is not None:
          for k, w in zip(kids, weights):
            k.trips, k.trip_source = float(w), "weight"
          node.children.extend(k for k in kids if k.trips > 0)
        elif kids:
          best = max(kids, key=lambda k: (k.seconds_per_run(False), k.per_run().hbm_bytes, k.per_run().flops))
          node.children.append(best)
      elif ins.opcode == "call":
        for callee in called(ins.attrs, "to_apply"):
          if callee in self.comps:
            node.children.append(self._node(callee, "call", 1.0, "known", path, _op_name(ins), ins.name))
    return node

  def loops(self) -> list[dict]:
    """Every while loop as a record: name, op_name, depth, trips, trip_source, total trips (product of the
    enclosing loops'), per-iteration cost and seconds (serial / overlapped)."""
    out = []

    def visit(node: Node, depth: int, outer: float):
      for ch in node.children:
        mult = outer * ch.trips
        if ch.kind == "while":
          per = ch.per_run()
          rec = {
              "name": ch.name,
              "op_name": ch.op_name,
              "depth": depth,
              "trips": ch.trips,
              "trip_source": ch.trip_source,
              "total_trips": mult,
              "per_iteration": per.as_dict(),
              "seconds_per_iteration": {
                  "serial": ch.seconds_per_run(False),
                  "overlapped": ch.seconds_per_run(True),
                  **{k: v for k, v in self.rates.times(per).items() if k in ("compute", "memory", "ici", "limiter")},
              },
          }
          out.append(rec)
          visit(ch, depth + 1, mult)
        else:
          visit(ch, depth, mult)

    visit(self.root, 0, 1.0)
    return out

  def total(self) -> Cost:
    """The whole program's cost per chip: the entry's own cost plus every loop and branch times its trips."""
    return self.root.per_run()

  def seconds(self, overlapped: bool) -> float:
    """The whole program's estimated seconds, communication overlapped (True) or serial (False)."""
    return self.root.seconds_per_run(overlapped)


def _matmul_flops(ins: Instr, comp: Computation) -> float:
  """FLOPs of a `dot` (2 x |result| x |contracted|) or of a `convolution` (XLA:TPU writes dots as convolutions:
  2 x |result| x input features x the window taps that land on input elements, i.e. min(ceil(size / lhs
  dilation), input size) per spatial dimension; padding taps are not counted). Other ops: 0."""
  if ins.opcode not in ("dot", "convolution") or not ins.operands:
    return 0.0
  lhs = comp.by_name.get(ins.operands[0])
  lhs_dims = dims(lhs.shape) if lhs else []
  out = math.prod(dims(ins.shape) or [1])
  if ins.opcode == "dot":
    contracting = attr(ins.attrs, "lhs_contracting_dims") or "{}"
    k = math.prod(lhs_dims[int(i)] for i in re.findall(r"\d+", contracting) if int(i) < len(lhs_dims))
    return 2.0 * out * k
  labels = attr(ins.attrs, "dim_labels") or ""
  m = re.fullmatch(r"(\w+)_(\w+)->(\w+)", labels)
  rhs = comp.by_name.get(ins.operands[1]) if len(ins.operands) > 1 else None
  if not m or rhs is None:
    return 0.0
  lhs_l, rhs_l = m.group(1), m.group(2)
  rhs_dims = dims(rhs.shape)
  in_features = rhs_dims[rhs_l.index("i")] if "i" in rhs_l and len(rhs_dims) == len(rhs_l) else 1
  window = attr(ins.attrs, "window") or ""
  sizes = [int(x) for x in re.findall(r"size=([\dx]+)", window)[0].split("x")] if "size=" in window else []
  dil = re.findall(r"lhs_dilate=([\dx]+)", window)
  dilate = [int(x) for x in dil[0].split("x")] if dil else [1] * len(sizes)
  taps = 1
  for k, w in enumerate(sizes):
    pos = lhs_l.find(str(k))
    extent = lhs_dims[pos] if 0 <= pos < len(lhs_dims) else w
    taps *= min(-(-w // max(dilate[k], 1)), extent)
  return 2.0 * out * in_features * taps


def _alias_chain(name: str, fused: Computation) -> set[str]:
  """`name` and every bitcast of it inside `fused`."""
  out, frontier = {name}, [name]
  while frontier:
    n = frontier.pop()
    for i in fused.instrs:
      if i.opcode == "bitcast" and i.operands and i.operands[0] == n and i.name not in out:
        out.add(i.name)
        frontier.append(i.name)
  return out


def _op_name(ins: Instr) -> str:
  m = re.search(r'op_name="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""
