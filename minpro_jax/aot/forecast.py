"""A forecast of a compiled program's time, beside its roofline: efficiencies, per-op floors and collective latencies.

The roofline (`minpro_jax.aot.hlo_cost`) takes every computation at max(FLOPs / peak, HBM bytes / bandwidth), with
communication overlapped. The forecast walks the same loop tree and costs each top-level instruction of each
computation on its own, as a TPU (or GPU) runs them, one after the other:

- a fusion, copy or kernel takes max(floor, FLOPs / (peak x MXU efficiency), HBM bytes / (bandwidth x HBM
  efficiency)): the matmul HBM efficiency for ops with FLOPs (a decode step's small-batch matmuls), the plain one
  for the rest, and at least the per-op floor (launch, pipeline fill, DMA latency); a loop or branch instruction
  takes its child's forecast times its trips;
- a collective takes the alpha + beta time of its group on the slice's links (`minpro_jax.aot.links`), and is
  exposed where the HLO serialises it. Its dependencies bound what it can hide behind: only the instructions of its
  computation that are neither its ancestors nor its descendants (a decode step's all-reduce, between two matmuls
  of one chain, hides behind little; a weight all-gather can hide behind the layer before). The "low" level takes
  that bound (every collective hides behind the independent work, shared among them: what a latency-hiding schedule
  could reach); "central" and "high" follow the compiled schedule: a synchronous collective (most of XLA:TPU's, in
  the programs here) blocks the core, an async one (a `-start` / `-done` pair, or an `AsyncCollectiveStart` /
  `AsyncCollectiveDone` custom-call pair around it) hides behind the independent instructions scheduled between.

Activations a remat policy offloads to host memory move over PCIe (`Chip.host_bytes_per_s` at the link
efficiency), async like a collective and exposed by the same rule ("host_transfers"). The caller adds what the HLO
cannot show (`forecast_extra`): the paged attention's KV reads at the paged kernel's efficiency, and the FLOPs of
Pallas attention kernels at the attention efficiency. Every constant is a `Band` (`minpro_jax.aot.efficiency`), so
each figure comes at three levels, low / central / high. It is a forecast from compiled programs, never a
measurement (docs/aot.md, "The forecast").
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from minpro_jax.aot.efficiency import LEVELS, Constants
from minpro_jax.aot.hlo_cost import NO_MEMORY, HloCost, Node, collective_of, host_transfer_bytes
from minpro_jax.aot.hlo_text import Computation, Instr, called, shape_bytes
from minpro_jax.aot.links import Links, collective_seconds
from minpro_jax.aot.topologies import Chip

TERMS = ("matmuls", "other_ops", "op_floor", "collectives", "collectives_hidden", "host_transfers",
         "host_transfers_hidden")  # fmt: skip
_KERNELS = ("fusion", "custom-call", "copy")  # every one is a kernel launch, whatever its size


class Forecaster:
  """The forecast of one compiled program (`HloCost`) on a chip and its links with one platform's constants.

  `node(n)` -> {"seconds": [3], "terms": {term: [3]}, "ops": count, "collectives": count} for one run of loop-tree
  node n (one iteration of a loop), its children included; arrays hold the levels of `efficiency.LEVELS`.
  """

  def __init__(self, cost: HloCost, chip: Chip, links: Links, k: Constants):
    self.cost, self.links, self.k = cost, links, k
    self.host = chip.host_bytes_per_s * k.link_efficiency.values()  # offloaded activations over PCIe
    self.mxu = k.mxu.values() * chip.peak_bf16_flops
    self.hbm = k.hbm.values() * chip.hbm_bytes_per_s
    self.matmul_hbm = k.matmul_hbm.values() * chip.hbm_bytes_per_s
    self.floor = k.op_floor.values()
    self._coll = dict(
        hop_latency=k.hop_latency.values(),
        overhead=k.collective_overhead.values(),
        efficiency=k.link_efficiency.values(),
    )

  def node(self, node: Node) -> dict[str, Any]:
    """The forecast of one run of `node` (class docstring)."""
    kids: dict[str, list[Node]] = {}
    for ch in node.children:
      kids.setdefault(ch.instr, []).append(ch)
    out = _empty()
    for name in node.comps:
      comp = self.cost.comps[name]
      child = {}
      for ins in comp.instrs:
        for ch in kids.get(ins.name, ()):
          f = self.node(ch)
          prev = child.get(ins.name)
          scaled = _scale(f, ch.trips)
          child[ins.name] = scaled if prev is None else _add(prev, scaled)
      _add_into(out, self._computation(comp, child), seconds=True)
    return out

  def program(self) -> dict[str, Any]:
    """The forecast of one run of the whole program."""
    return self.node(self.cost.root)

  # ------------------------------------------------------------------------------------------ one computation
  def _computation(self, comp: Computation, child: dict[str, dict]) -> dict[str, Any]:
    n = len(comp.instrs)
    times = np.zeros((n, 3))
    out = _empty()
    colls: dict[int, tuple[np.ndarray, str]] = {}  # collectives and host transfers: (seconds, term)
    for i, ins in enumerate(comp.instrs):
      if ins.name in child:
        f = child[ins.name]
        times[i] = f["seconds"]
        _add_into(out, f)
        continue
      col = self._collective(ins, comp)
      if col is not None:
        colls[i] = (col, "collectives")
        out["collectives"] += 1
        continue
      moved = host_transfer_bytes(ins, comp)
      if moved and self.host.all():
        colls[i] = (moved / self.host, "host_transfers")
        continue
      if ins.opcode in NO_MEMORY or ins.opcode.endswith("-done"):
        continue
      c = self.cost.instr_cost(ins, comp)
      compute = c.flops / self.mxu
      memory = c.hbm_bytes / (self.matmul_hbm if c.flops else self.hbm)
      roof = np.maximum(compute, memory)
      floored = ins.opcode in _KERNELS or shape_bytes(ins.shape) > 64
      t = np.maximum(roof, self.floor) if floored else roof
      times[i] = t
      out["ops"] += 1
      out["terms"]["matmuls" if c.flops else "other_ops"] += roof
      out["terms"]["op_floor"] += t - roof
    out["seconds"] = out["seconds"] + times.sum(axis=0)
    if colls:
      exposed = self._exposed(comp, times, colls)
      for term in set(k for _, k in colls.values()):
        total = sum(t for t, k in colls.values() if k == term)
        out["terms"][term] += exposed[term]
        out["terms"][term + "_hidden"] += total - exposed[term]
        out["seconds"] = out["seconds"] + exposed[term]
    return out

  def _collective(self, ins: Instr, comp: Computation) -> np.ndarray | None:
    """Seconds of `ins` if it is a collective (or an async-start wrapping one), else None."""
    col = collective_of(ins, comp, self.cost.num_partitions, self.cost.mesh_shape)
    if col is None and ins.opcode == "async-start":
      for callee in called(ins.attrs, "calls"):
        inner = self.cost.comps.get(callee)
        for j in inner.instrs if inner else ():
          col = col or collective_of(j, inner, self.cost.num_partitions, self.cost.mesh_shape)
    if col is None:
      return None
    return collective_seconds(col.kind, col.result_bytes, col.ici_bytes, col.group or range(col.group_size),
                              self.links, pair=col.pair, **self._coll)  # fmt: skip

  def _exposed(self, comp: Computation, times: np.ndarray, colls: dict[int, tuple]) -> dict[str, np.ndarray]:
    """The collectives' (and host transfers') exposed seconds at each level, summed by term (module docstring):
    at "low", each hides behind the
    instructions that are neither its ancestors nor its descendants, sharing them with the others (what a
    latency-hiding schedule could reach); at "central" and "high", as the compiled schedule runs them: a synchronous
    collective blocks, an async one hides behind the independent instructions scheduled between its start and its
    done. An unscheduled module (no schedule to follow) takes the "low" rule at every level."""
    index = {ins.name: i for i, ins in enumerate(comp.instrs)}
    users: list[list[int]] = [[] for _ in comp.instrs]
    preds: list[list[int]] = [[] for _ in comp.instrs]
    for i, ins in enumerate(comp.instrs):
      for o in ins.operands:
        j = index.get(o)
        if j is not None and j != i:
          users[j].append(i)
          preds[i].append(j)
    free = times.copy()  # what independent work is left to hide behind, per instruction
    exposed = {k: np.zeros(3) for _, k in colls.values()}
    for c in sorted(colls):
      t, term = colls[c]
      after = _reach(c, users)
      dependent = after | _reach(c, preds)
      independent = np.asarray([i for i in range(len(comp.instrs)) if i not in dependent and i != c], np.int64)
      capacity = free[independent].sum(axis=0) if independent.size else np.zeros(3)
      hidden = np.minimum(t, capacity)
      if independent.size:
        free[independent] *= np.where(capacity > 0, 1.0 - hidden / np.maximum(capacity, 1e-30), 1.0)
      level = t - hidden  # the dependency rule
      if self.cost.scheduled:
        done = _done_of(comp, c, users)
        window = [i for i in range(c + 1, done) if i not in after] if done is not None else []
        level[1:] = np.maximum(t[1:] - times[window, 1:].sum(axis=0), 0.0) if window else t[1:]
      exposed[term] += level
    return exposed


def _done_of(comp: Computation, start: int, users: list[list[int]]) -> int | None:
  """The index of the instruction that ends an async collective starting at `start`: its `-done` (through
  async-update), or, for a collective XLA:TPU wraps in an `AsyncCollectiveStart` custom call, the
  `AsyncCollectiveDone` that follows; None for a synchronous collective."""

  def target(i):
    ins = comp.instrs[i]
    return ins.opcode == "custom-call" and re.search(r'custom_call_target="(\w+)"', ins.attrs)

  op = comp.instrs[start].opcode
  wrapped = [u for u in users[start] if (m := target(u)) and m.group(1) == "AsyncCollectiveStart"]
  if not op.endswith("-start") and not wrapped:
    return None
  frontier = [start, *wrapped]
  while frontier:
    i = frontier.pop()
    for u in users[i]:
      m = target(u)
      if comp.instrs[u].opcode.endswith("-done") or (m and m.group(1) == "AsyncCollectiveDone"):
        return u
      if comp.instrs[u].opcode.endswith("-update"):
        frontier.append(u)
  return None


def _reach(start: int, edges: list[list[int]]) -> set[int]:
  seen, stack = set(), [start]
  while stack:
    for j in edges[stack.pop()]:
      if j not in seen:
        seen.add(j)
        stack.append(j)
  seen.discard(start)
  return seen


def _empty() -> dict[str, Any]:
  return {"seconds": np.zeros(3), "terms": {t: np.zeros(3) for t in TERMS}, "ops": 0.0, "collectives": 0.0}


def _scale(f: dict, k: float) -> dict:
  return {"seconds": f["seconds"] * k, "terms": {t: v * k for t, v in f["terms"].items()}, "ops": f["ops"] * k,
          "collectives": f["collectives"] * k}  # fmt: skip


def _add(a: dict, b: dict) -> dict:
  out = _scale(a, 1.0)
  _add_into(out, b, seconds=True)
  return out


def _add_into(out: dict, f: dict, seconds: bool = False) -> None:
  """Adds f's terms and counts to `out` (and its seconds when `seconds`: a computation's own seconds are summed by
  the caller, which also counts a child's seconds as one instruction's time)."""
  if seconds:
    out["seconds"] = out["seconds"] + f["seconds"]
  for t in TERMS:
    out["terms"][t] = out["terms"][t] + f["terms"][t]
  out["ops"] += f["ops"]
  out["collectives"] += f["collectives"]


def forecast_extra(seconds: np.ndarray, terms: dict, name: str, extra: np.ndarray) -> np.ndarray:
  """`seconds` + `extra` (an analytic term the HLO cannot show), recorded in `terms[name]`."""
  terms[name] = terms.get(name, np.zeros(3)) + extra
  return seconds + extra


def as_levels(values: np.ndarray | None) -> dict[str, float] | None:
  """{"low": s, "central": s, "high": s} of a [3] array (None stays None)."""
  return None if values is None else {lvl: float(v) for lvl, v in zip(LEVELS, values)}


def record(seconds: np.ndarray, terms: dict, ops: float, collectives: float, per_iteration: float | None) -> dict:
  """The JSON record of a forecast: seconds and each term at the three levels, ops and collectives counted."""
  out = {
      "seconds": as_levels(seconds),
      "terms": {t: as_levels(v) for t, v in terms.items()},
      "ops": ops,
      "collectives": collectives,
  }
  if per_iteration:
    out["seconds_per_iteration"] = as_levels(seconds / per_iteration)
  return out
