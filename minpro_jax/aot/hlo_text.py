"""Reading XLA's optimized HLO text (`compiled.as_text()`): computations, instructions, attributes, trip counts.

Only what `minpro_jax.aot.hlo_cost` needs: each computation's instructions with their result type, opcode,
operands and attributes, and the trip count of a `while` where XLA annotated it or where the loop is a counted one.
"""

from __future__ import annotations

import dataclasses
import json
import re

from minpro_jax.aot.analysis import array_bytes

_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


@dataclasses.dataclass
class Instr:
  """One HLO instruction: its name, result type text, opcode, operand names, the text after its operands, and
  whether it is its computation's ROOT."""

  name: str
  shape: str  # the result type text, e.g. "f32[16,64]{1,0}" or "(s32[], f32[4])"
  opcode: str
  operands: list[str]
  attrs: str
  root: bool = False
  args: str = ""  # the text between the opcode's parentheses (a parameter's index)


@dataclasses.dataclass
class Computation:
  """One HLO computation: its instructions in order, by name (`by_name`), and whether it is the module's entry."""

  name: str
  instrs: list[Instr]
  entry: bool = False

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instrs}

  @property
  def root(self) -> Instr:
    """The ROOT instruction (the last one when none is marked)."""
    return next((i for i in self.instrs if i.root), self.instrs[-1])


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start] ('(' or '{')."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    ch = text[i]
    if ch in pairs:
      stack.append(pairs[ch])
    elif stack and ch == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  return len(text)


def _parse_instr(line: str) -> Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = m.group("rest")
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  op_match = re.match(r"([\w\-]+)\(", rest)
  if not op_match:
    return None
  opcode = op_match.group(1)
  end = _balanced(rest, op_match.end() - 1)
  args = rest[op_match.end() : end - 1]
  operands = re.findall(r"%([\w.\-]+)", args)
  return Instr(m.group("name"), shape, opcode, operands, rest[end:], root=bool(m.group(1)), args=args)


def parse_hlo(text: str) -> dict[str, Computation]:
  """{name: Computation} of an HLO module's text (`compiled.as_text()`); the entry is flagged `entry`."""
  comps: dict[str, Computation] = {}
  cur, instrs, entry = None, [], False
  for line in text.splitlines():
    if cur is None:
      m = _HEADER.match(line.strip())
      if m:
        cur, instrs, entry = m.group("name"), [], bool(m.group(1))
      continue
    if line.strip() == "}":
      if instrs:
        comps[cur] = Computation(cur, instrs, entry)
      cur = None
      continue
    ins = _parse_instr(line)
    if ins is not None:
      instrs.append(ins)
  return comps


def shape_bytes(shape: str) -> float:
  """Bytes of every array in an HLO type text (a tuple's elements summed)."""
  return float(sum(array_bytes(d, s) for d, s in ARRAY.findall(shape)))


def dims(shape: str) -> list[int]:
  """The dimensions of the first array in an HLO type text (e.g. "f32[16,64]{1,0}" -> [16, 64]); [] for none."""
  m = ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def attr(attrs: str, key: str) -> str | None:
  """The raw value of attribute `key` in an instruction's attribute text (a bracketed group whole, an iota or
  mesh replica-group spelling whole), or None when absent."""
  m = re.search(rf"\b{re.escape(key)}=", attrs)
  if not m:
    return None
  i = m.end()
  if attrs.startswith("mesh[", i):  # replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
    j = _balanced(attrs, i + 4)
    k = attrs.find("{", j)
    return attrs[i : _balanced(attrs, k)] if k >= 0 and not attrs[j:k].strip(" ") else attrs[i:j]
  if i < len(attrs) and attrs[i] in "{(":
    return attrs[i : _balanced(attrs, i)]
  j = i
  while j < len(attrs) and attrs[j] == "[":  # iota groups: [2,4]<=[8] or [2,2]<=[2,2]T(1,0)
    j = _balanced(attrs, j)
    j += 2 if attrs.startswith("<=", j) else 0
  while j < len(attrs) and attrs[j] not in ", ":
    j += 1
  return attrs[i:j]


def called(attrs: str, key: str) -> list[str]:
  """The computation names an attribute lists (`calls=`, `body=`, `branch_computations={...}`); [] when absent."""
  v = attr(attrs, key)
  return re.findall(r"%?([\w.\-]+)", v) if v else []


def known_trip_count(ins: Instr) -> int | None:
  """The `known_trip_count` XLA annotated on a `while` (its backend_config), or None."""
  cfg = attr(ins.attrs, "backend_config")
  if not cfg:
    return None
  try:
    n = json.loads(cfg).get("known_trip_count", {}).get("n")
  except (ValueError, AttributeError):
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', cfg)
    n = m.group(1) if m else None
  return int(n) if n is not None else None


def through(comp: Computation, name: str, ops=("copy", "bitcast")) -> Instr | None:
  """The instruction `name` in `comp`, looking through the ops in `ops` (copies, bitcasts) to their operand."""
  ins = comp.by_name.get(name)
  while ins is not None and ins.opcode in ops and ins.operands:
    ins = comp.by_name.get(ins.operands[0])
  return ins


def constant(ins: Instr | None) -> int | None:
  """The integer value of a scalar `constant` instruction, else None."""
  if ins is None or ins.opcode != "constant":
    return None
  m = re.fullmatch(r"\s*(-?\d+)\s*", ins.args)
  return int(m.group(1)) if m else None


def inferred_trip_count(ins: Instr, caller: Computation, comps: dict[str, Computation]) -> int | None:
  """The trip count of a counted `while` that XLA did not annotate (XLA:TPU keeps no `known_trip_count`): its
  condition is `i < N` on tuple element k, the body adds a constant step S to element k, and the caller starts
  it at a constant C: ceil((N - C) / S). None for any other shape of loop (data-dependent loops)."""
  cond = comps.get((called(ins.attrs, "condition") or [""])[0])
  body = comps.get((called(ins.attrs, "body") or [""])[0])
  if cond is None or body is None or not ins.operands:
    return None
  root = cond.root
  if root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
    return None
  gte, bound = through(cond, root.operands[0]), constant(through(cond, root.operands[1]))
  if gte is None or gte.opcode != "get-tuple-element" or bound is None:
    return None
  k = int(re.search(r"index=(\d+)", gte.attrs).group(1))
  init_tuple = caller.by_name.get(ins.operands[0])
  if init_tuple is None or init_tuple.opcode != "tuple" or k >= len(init_tuple.operands):
    return None
  start = constant(through(caller, init_tuple.operands[k]))
  out = body.root
  if start is None or out.opcode != "tuple" or k >= len(out.operands):
    return None
  step = _addconstant(body, out.operands[k], comps)
  if not step or step < 0:
    return None
  return max(0, -(-(bound - start) // step))


def _addconstant(body: Computation, name: str, comps: dict[str, Computation]) -> int | None:
  """S when `name` is add(x, constant S) in `body`, directly or as a fusion wrapping the add."""
  ins = through(body, name)
  if ins is None:
    return None
  consts = [constant(through(body, o)) for o in ins.operands]
  if ins.opcode == "fusion":
    fused = comps.get((called(ins.attrs, "calls") or [""])[0])
    if fused is None or fused.root.opcode != "add":
      return None
    consts += [constant(fused.by_name.get(o)) for o in fused.root.operands]
  elif ins.opcode != "add":
    return None
  return next((c for c in consts if c), None)
