"""The sampler's own layout (`runtime/inference_mesh.py`, `config.sampling.mesh`): the learner's fsdp=8 parameters
resharded to data=4 x tensor=2 sample what one device samples, the compiled decode gathers no weight, and the
config field's errors name it."""

import jax
import numpy as np
import pytest
from flax import nnx

from minpro_jax.aot.hlo_text import called, parse_hlo
from minpro_jax.config_lib import defaults
from minpro_jax.errors import ConfigError
from minpro_jax.models import get_preset, init_model
from minpro_jax.run import run_config, sampler_setup
from minpro_jax.runtime.inference_mesh import INFERENCE_RULES, auto_shape, parse_sampling_mesh, sampler_layout
from minpro_jax.runtime.sharding import make_mesh
from minpro_jax.sampling import Sampler, SamplingParams

CFG = get_preset("tiny")  # 4 heads, 2 KV heads
PROMPTS = [[5, 17, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], [400]]
TOPK = SamplingParams(temperature=0.7, top_k=40, max_new_tokens=9)


@pytest.fixture(scope="module")
def learner_mesh():
  return make_mesh({"fsdp": 8})


@pytest.fixture(scope="module")
def learner_state(learner_mesh):
  return nnx.split(init_model(CFG, seed=3, mesh=learner_mesh))[1]


@pytest.fixture(scope="module")
def sampler(learner_mesh):
  mesh, rules = sampler_layout("data=4,tensor=2", learner_mesh, CFG)
  return Sampler(CFG, prompt_buckets=(8, 16), mesh=mesh, rules=rules)


def test_layout_of_the_resharded_parameters(sampler, learner_state, learner_mesh):
  """Every weight of the prepared copy is on the sampler's mesh, split over tensor by heads / FFN width / vocabulary
  and replicated over data (no fsdp split), while the learner's stay fsdp-split."""
  assert dict(sampler.mesh.shape) == {"data": 4, "tensor": 2}
  assert list(sampler.mesh.devices.flat) == list(learner_mesh.devices.flat)
  prepared = sampler.prepare_params(learner_state).state
  specs = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(prepared)}
  layer = "['layers'][0]"
  assert specs["['embed'].value"] == jax.sharding.PartitionSpec("tensor")
  assert specs[f"{layer}['attn']['qkv_proj'].value"] == jax.sharding.PartitionSpec(None, "tensor")
  assert specs[f"{layer}['attn']['o_proj'].value"] == jax.sharding.PartitionSpec("tensor")
  assert specs[f"{layer}['mlp']['gate_proj'].value"] == jax.sharding.PartitionSpec(None, "tensor")
  assert specs[f"{layer}['mlp']['down_proj'].value"] == jax.sharding.PartitionSpec("tensor")
  for x in jax.tree.leaves(prepared):
    assert x.sharding.mesh is sampler.mesh
  gate = learner_state["layers"]["mlp"]["gate_proj"][...]
  assert "fsdp" in str(gate.sharding.spec)  # the learner's copy is untouched
  # one weight's shards: 2 distinct column halves, each on 4 devices (replicated over data)
  w = prepared["layers"][0]["mlp"]["gate_proj"][...]
  assert {s.data.shape for s in w.addressable_shards} == {(CFG.hidden_size, CFG.intermediate_size // 2)}
  assert len({str(s.index) for s in w.addressable_shards}) == 2
  # a copy prepared on the learner's layout is refused, not run on the wrong one
  on_learner = Sampler(CFG, prompt_buckets=(8, 16), mesh=learner_mesh).prepare_params(learner_state)
  msg = r"another layout \('data=1,fsdp=8,tensor=1,expert=1 \(learner rules\)', this Sampler: 'data=4,tensor=2 \(sam"
  with pytest.raises(ValueError, match=msg):
    sampler.prepare_params(on_learner)


def test_resharded_sampler_equals_one_device(sampler, learner_state):
  """fsdp=8 learner -> data=4 x tensor=2 sampler on cpu:8: the tokens of the one-device sampler exactly, behavior
  log-probs to fp32 rounding (the continuous sampler the trainer runs; the one-device run is test_sampler.py's)."""
  one = nnx.split(init_model(CFG, seed=3))[1]
  want = Sampler(CFG, prompt_buckets=(8, 16)).generate(one, PROMPTS, TOPK, seed=4, group_size=2)
  got = sampler.generate(learner_state, PROMPTS, TOPK, seed=4, group_size=2)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_array_equal(got.response_mask, want.response_mask)
  np.testing.assert_allclose(got.behavior_logp, want.behavior_logp, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- weight all-gathers in the HLO
_MOVES = (
    "bitcast",
    "copy",
    "reshape",
    "transpose",
    "get-tuple-element",
    "fusion",
    "convert",
    "copy-start",
    "copy-done",
)


def _weight_gathers(hlo: str, num_weights: int) -> list[tuple[str, str]]:
  """(computation, all-gather) of every all-gather in a compiled module whose operand is a weight.

  A weight is one of the entry computation's first `num_weights` parameters (the flattened `PreparedParams`, the
  jitted function's first argument). An operand is traced back through value-moving ops (bitcast, copy, reshape,
  transpose, convert, a fusion of one operand, get-tuple-element) and across computation boundaries: a while
  body's / condition's parameter element k is the while's operand element k in its caller, a conditional branch's
  parameter is the conditional's operand, so a weight that a loop carries is still recognised inside the loop.
  """
  comps = parse_hlo(hlo)
  callers: dict[str, list] = {}  # computation -> [(caller computation, instruction, operand offset)]
  for comp in comps.values():
    for ins in comp.instrs:
      if ins.opcode == "while":
        for name in called(ins.attrs, "body") + called(ins.attrs, "condition"):
          callers.setdefault(name, []).append((comp, ins, 0))
      elif ins.opcode == "conditional":
        for j, name in enumerate(called(ins.attrs, "branch_computations")):
          callers.setdefault(name, []).append((comp, ins, j + 1))
      elif ins.opcode == "call":
        for name in called(ins.attrs, "to_apply"):
          callers.setdefault(name, []).append((comp, ins, None))

  def is_weight(comp, name, index=(), seen=frozenset()) -> bool:
    key = (comp.name, name, index)
    if key in seen:
      return False
    seen = seen | {key}
    ins = comp.by_name.get(name)
    if ins is None:
      return False
    if ins.opcode == "tuple" and index:
      return is_weight(comp, ins.operands[index[0]], index[1:], seen)
    if ins.opcode == "get-tuple-element":
      k = int(ins.attrs.split("index=")[1].split(",")[0].split()[0])
      return is_weight(comp, ins.operands[0], (k, *index), seen)
    if ins.opcode == "parameter":
      p = int(ins.args)
      if comp.entry:
        return not index and p < num_weights
      for caller, call, offset in callers.get(comp.name, []):
        operand = call.operands[p if offset is None else offset]
        if is_weight(caller, operand, index, seen):
          return True
      return False
    if ins.opcode in _MOVES and len(ins.operands) == 1:
      return is_weight(comp, ins.operands[0], index, seen)
    return False

  return [
      (comp.name, ins.name)
      for comp in comps.values()
      for ins in comp.instrs
      if ins.opcode in ("all-gather", "all-gather-start") and is_weight(comp, ins.operands[0])
  ]


def _compiled_c_all(s: Sampler, state) -> tuple[str, int]:
  """(optimized HLO of the continuous sampler's whole call on 6 requests of bucket 16, number of weights)."""
  prepared = s.prepare_params(state).state
  n, p = 6, 16
  requests = (np.ones((n, p), np.int32), np.ones((n, p), np.int32), np.zeros(n, np.int32), np.zeros((n, 2), np.uint32))
  rows, refill = s.engine.rows_and_refill(n)
  sp = SamplingParams(temperature=0.7, top_k=40, max_new_tokens=4)
  with s.mesh_context():
    lowered = s.engine.program.lower(prepared, requests, sampling=sp, p_len=p, rows=rows, refill=refill)
  return lowered.compile().as_text(), len(jax.tree.leaves(prepared))


def test_decode_gathers_no_weight_on_the_sampler_layout(sampler, learner_state, learner_mesh):
  """The compiled continuous sampler (prefill, decode loop, refills: the continuous engine's `program`, what the trainer runs) has
  no all-gather of a weight anywhere, in or out of its while loops (its all-gathers are of activations: the rows'
  tokens and states over data, logits over vocab); on the learner's fsdp=8 layout the same program gathers every
  weight matrix (11 of them for tiny, in a loop body), so the check can fail."""
  hlo, k = _compiled_c_all(sampler, learner_state)
  assert "while(" in hlo and "all-gather" in hlo  # activations (the rows' tokens, logits over vocab) are gathered
  assert _weight_gathers(hlo, k) == []
  fsdp_hlo, k = _compiled_c_all(Sampler(CFG, prompt_buckets=(16,), mesh=learner_mesh), learner_state)
  assert len(_weight_gathers(fsdp_hlo, k)) >= 5 * CFG.num_layers  # q/k/v (fused), o, gate, up, down per layer


# ------------------------------------------------------------------------------------------- the config field
def test_parse_sampling_mesh_and_auto():
  assert parse_sampling_mesh("", 8, 4, 2) is None
  assert parse_sampling_mesh("tensor=2,data=4", 8, 4, 2) == {"data": 4, "tensor": 2}
  assert parse_sampling_mesh("tensor=2", 2, 4, 2) == {"data": 1, "tensor": 2}
  assert parse_sampling_mesh("data=-1,tensor=2", 8, 4, 2) == {"data": 4, "tensor": 2}
  assert parse_sampling_mesh("auto", 8, 4, 2, local_devices=8) == {"data": 4, "tensor": 2}
  assert auto_shape(64, 8, local_devices=4) == {"data": 16, "tensor": 4}  # Qwen3-8B on a v5p-64: TP within a host
  assert auto_shape(8, 8, local_devices=8) == {"data": 1, "tensor": 8}
  assert auto_shape(1, 2, local_devices=8) == {"data": 1, "tensor": 1}
  mesh, rules = sampler_layout("", None, CFG)
  assert mesh is None and rules is None  # "" keeps the learner's layout: today's sampler
  mesh, rules = sampler_layout("auto", make_mesh({"fsdp": 8}), CFG)
  assert dict(mesh.shape) == {"data": 4, "tensor": 2} and rules == INFERENCE_RULES


@pytest.mark.parametrize(
    "spec, devices, match",
    [
        ("fsdp=8", 8, "unknown axis 'fsdp'"),
        ("data=4,tensor=4", 8, r"spans 16 devices, but the sampler's mesh spans 8"),
        ("data=2", 8, r"spans 2 devices.*e.g. 'data=8,tensor=1'"),
        ("tensor=4,data=2", 8, r"tensor=4 does not divide.*2 KV heads; choose tensor in \[1, 2\]"),
        ("tensor", 8, "cannot parse 'tensor'"),
        ("tensor=--1", 8, "cannot parse 'tensor=--1'"),  # int() raised ValueError once
        ("tensor=\u00b2", 8, "cannot parse"),  # a superscript 2 passes str.isdigit
        ("tensor=0,data=-1", 8, "sizes must be >= 1"),
        ("data=8,tensor=1,data=2", 8, "gives axis 'data' twice"),  # once a silent data=2
        ("data=-1,tensor=8", 4, r"fixed sizes \(8\) do not divide the sampler's 4 devices.*or 'auto'"),  # v5p-8
    ],
)
def test_parse_sampling_mesh_errors(spec, devices, match):
  with pytest.raises(ConfigError, match=r"^config\.sampling\.mesh: .*" + match):
    parse_sampling_mesh(spec, devices, CFG.num_heads, CFG.num_kv_heads)


def _config(**sampling):
  c = defaults.get_config()
  c.mesh.shape = "fsdp=8"
  for k, v in sampling.items():
    c.sampling[k] = v
  return c


def test_validate_config_names_the_sampling_fields(tmp_path):
  c = _config(mesh="data=4,tensor=2", decode_rows=16)
  c.workdir = str(tmp_path / "run")
  run_config.validate_config(c, num_devices=8)  # valid
  assert sampler_setup.sampler_decode_rows(c) == 16
  c.sampling.mesh = "tensor=4,data=2"  # tiny has 2 KV heads
  with pytest.raises(ConfigError, match=r"^config\.sampling\.mesh: tensor=4 does not divide"):
    run_config.validate_config(c, num_devices=8)
  c.sampling.mesh = "data=4,tensor=2"
  c.mesh.shape = ""  # one learner device: the sampler's mesh must span one
  with pytest.raises(ConfigError, match=r"^config\.sampling\.mesh: .*the sampler's mesh spans 1 \(the learner mesh's"):
    run_config.validate_config(c, num_devices=8)
  c.mesh.shape = "fsdp=8"
  c.sampling.decode_rows = 0
  with pytest.raises(ConfigError, match=r"^config\.sampling\.decode_rows: must be an int >= 1"):
    run_config.validate_shapes_config(c)
  assert sampler_setup.sampler_decode_rows(defaults.get_config()) == 64  # today's Sampler default
  assert defaults.get_config().sampling.mesh == ""


def test_the_step_budget_compiles_the_sampler_on_its_own_layout():
  """`python -m minpro_jax.aot --budget` with sampling.mesh: the sampling program it compiles for cpu:8 (learner
  fsdp=8) runs on data=4 x tensor=2 and its decode step gathers no weight (on fsdp=8 it gathers all of them at
  every step, tests/test_budget.py)."""
  from minpro_jax.aot.budget import Budget, param_bytes
  from minpro_jax.aot.topologies import parse_slice
  from minpro_jax.config_lib import set_fields

  c = defaults.get_config()
  c.prompts_per_step, c.group_size, c.num_updates_per_step, c.micro_batch_size = 8, 2, 1, 16
  c.sampling.max_new_tokens, c.data.max_prompt_tokens = 8, 16
  c = set_fields(c, {"sampling.mesh": "data=4,tensor=2", "sampling.decode_rows": 8})
  b = Budget(c, parse_slice("cpu:8"), "fsdp=8", lengths="gamma:mean=5", prompt_len=6, parts=("sampling",))
  rows = {r["part"]: r for r in b.run()}
  s = b.progs.trainer_sampler
  assert dict(s.mesh.shape) == {"data": 4, "tensor": 2} and s.engine.rows_and_refill(16)[0] == 8
  weights = param_bytes(b.progs.prepared_params())
  gathers = rows["sampling: decode step"]["per_iteration"]["collectives"].get("all-gather", {"bytes": 0})
  assert gathers["bytes"] < 0.05 * weights  # activations only
