"""The Qwen3-MoE sparse block, with router replay: a forward may be told which experts each token uses.

Router replay (as in verl, slime and Megatron-LM's RL paths): the sampler records the top-k experts every token
was routed to, and the learner's forward uses those experts instead of choosing its own, so the learner's
log-probs are those of the computation that produced the tokens even where its router logits, at another
precision, rank the experts differently. The gate weights of the replayed experts are recomputed from the
learner's own router probabilities (gathered at the recorded ids and renormalised as the router normalises), so
the router still gets gradients, also for an expert that the learner's own top-k would not have chosen.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from minpro_jax.models.config import ModelConfig
from minpro_jax.models.quant import maybe_quant_act
from minpro_jax.runtime.sharding import constrain, mesh_axes

NO_ROUTE = -1  # in a routes array: this token is not replayed (prompt, padding, a token never fed forward)
ROUTE_DTYPE = jnp.int16  # compact: expert ids < 32,768


def route_mismatch(own_routes, recorded_routes) -> tuple[float, int]:
  """(fraction, count) of the recorded (token, layer) routes whose expert set differs from the router's own.

  Args:
    own_routes, recorded_routes: [..., k] int expert ids (numpy or JAX); entries of recorded_routes with any
      NO_ROUTE id are not counted.

  Returns:
    The fraction in [0, 1] (0.0 when nothing is recorded) and the number of recorded routes.
  """
  own = jnp.sort(jnp.asarray(own_routes), axis=-1)
  rec = jnp.asarray(recorded_routes)
  recorded = jnp.all(rec >= 0, axis=-1)
  differ = jnp.any(own != jnp.sort(rec, axis=-1), axis=-1) & recorded
  count = int(jnp.sum(recorded))
  return (float(jnp.sum(differ)) / count if count else 0.0), count


def init_param(stddev: float, axes: tuple[str | None, ...]):
  """A normal(stddev) initializer with logical sharding axes (the model's parameter convention)."""
  return nnx.with_partitioning(nnx.initializers.normal(stddev), axes)


class MoE(nnx.Module):
  """Qwen3-MoE sparse block: softmax router, top-k experts, optional renormalisation of the top-k weights.

  The load-balancing loss is Switch/Qwen3-MoE's `E * sum_e f_e * P_e` over valid tokens, where f_e is the
  fraction of top-k assignments that go to expert e (per k slot, summed as in HF) and P_e the mean router
  probability.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, config.jnp_param_dtype
    self.config = c
    e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
    self.router = nnx.Param(init_param(0.02, ("embed", None))(rngs.params(), (d, e), pd))
    self.gate_proj = nnx.Param(init_param(0.02, ("expert", "embed", "mlp"))(rngs.params(), (e, d, f), pd))
    self.up_proj = nnx.Param(init_param(0.02, ("expert", "embed", "mlp"))(rngs.params(), (e, d, f), pd))
    self.down_proj = nnx.Param(init_param(0.02, ("expert", "mlp", "embed"))(rngs.params(), (e, f, d), pd))

  def __call__(self, x_btd, valid_bt, routes_btk=None):
    """Args:
      x_btd: [B, T, D] normed input (compute dtype).
      valid_bt: [B, T] bool, the tokens the load-balancing loss counts.
      routes_btk: optional [B, T, k] int expert ids to use (router replay); a token whose ids are NO_ROUTE
        (any of them) is routed by its own top-k.

    Returns:
      (y [B, T, D], the aux loss scalar, the [B, T, k] ROUTE_DTYPE experts of the router's own top-k: what it
      chose, also where routes_btk replaced them).
    """
    c = self.config
    dt = c.jnp_dtype
    b, t, d = x_btd.shape
    x_btd = maybe_quant_act(x_btd, c.act_quant)
    router_logits = jnp.einsum("btd,de->bte", x_btd, self.router[...].astype(dt), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(router_logits, axis=-1)
    _, top_i = jax.lax.top_k(probs, c.num_experts_per_tok)  # [B, T, k]
    own_i = top_i
    if routes_btk is not None:
      replay = jnp.all(routes_btk >= 0, axis=-1, keepdims=True)
      top_i = jnp.where(replay, routes_btk.astype(top_i.dtype), top_i)
    top_p = jnp.take_along_axis(probs, top_i, axis=-1)  # differentiable in the router logits
    if c.norm_topk_prob:
      top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p.astype(dt)
    if c.moe_impl == "ragged":
      y = self._ragged(x_btd.reshape(b * t, d), top_i.reshape(b * t, -1), top_p.reshape(b * t, -1)).reshape(b, t, d)
    else:
      combine = jnp.sum(jax.nn.one_hot(top_i, c.num_experts, dtype=dt) * top_p[..., None], axis=2)  # [B, T, E]
      g = jnp.einsum("btd,edf->btef", x_btd, self.gate_proj[...].astype(dt))
      u = jnp.einsum("btd,edf->btef", x_btd, self.up_proj[...].astype(dt))
      h = maybe_quant_act(constrain(jax.nn.silu(g) * u, ("batch", "act_seq", "expert", "mlp")), c.act_quant)
      y = jnp.einsum("btef,efd,bte->btd", h, self.down_proj[...].astype(dt), combine)
    w = valid_bt.astype(jnp.float32)[..., None]
    n = jnp.maximum(jnp.sum(w), 1.0)
    assigned = jnp.sum(jax.nn.one_hot(top_i, c.num_experts, dtype=jnp.float32), axis=2)  # [B, T, E]
    frac_tokens = jnp.sum(assigned * w, axis=(0, 1)) / n
    mean_prob = jnp.sum(probs * w, axis=(0, 1)) / n
    aux = c.num_experts * jnp.sum(frac_tokens * mean_prob)
    return y, aux, own_i.astype(ROUTE_DTYPE)

  def _ragged(self, x_nd, top_i, top_p):
    """Sorted-by-expert grouped matmuls (`jax.lax.ragged_dot`): compute ~ N * k expert FFNs, not N * E.

    Under a mesh the routing runs per device (`jax.shard_map`): each device sorts its own tokens, so no
    device ever holds the whole batch's N * k sorted token copies (a global sort would gather them onto every
    chip). Weights arrive gathered over fsdp (as FSDP gathers a dense layer's), split over the mesh's expert
    axis (each device runs its own experts on the tokens of its expert group, gathered over that axis, and the
    outputs are reduce-scattered back) and over tensor on their FFN width (the partial sums are added up).
    """
    dt = self.config.jnp_dtype
    weights = (self.gate_proj[...].astype(dt), self.up_proj[...].astype(dt), self.down_proj[...].astype(dt))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or AxisType.Manual in mesh.axis_types:
      return _route(x_nd, top_i, top_p, *weights, self.config)
    return _route_sharded(mesh, x_nd, top_i, top_p, weights, self.config)


def _route(x_nd, top_i, top_p, gate_edf, up_edf, down_efd, c: ModelConfig, expert_offset=0):
  """Tokens [N, D] through the experts [E_local, ...] numbered from `expert_offset` (the others give 0)."""
  k = top_i.shape[1]
  num_local = gate_edf.shape[0]
  local_e = top_i.reshape(-1) - expert_offset
  here = (local_e >= 0) & (local_e < num_local)
  flat_e = jnp.where(here, local_e, num_local)  # another device's experts sort last, into no group
  order = jnp.argsort(flat_e, stable=True)
  token_of = order // k
  xs = x_nd[token_of]
  group_sizes = jnp.bincount(flat_e, length=num_local + 1)[:num_local].astype(jnp.int32)
  g = jax.lax.ragged_dot(xs, gate_edf, group_sizes)
  u = jax.lax.ragged_dot(xs, up_edf, group_sizes)
  ys = jax.lax.ragged_dot(maybe_quant_act(jax.nn.silu(g) * u, c.act_quant), down_efd, group_sizes)
  weight = jnp.where(here, top_p.reshape(-1), jnp.zeros((), top_p.dtype))[order]
  ys = ys * weight[:, None]
  return jnp.zeros_like(x_nd).at[token_of].add(ys)


def _route_sharded(mesh, x_nd, top_i, top_p, weights, c: ModelConfig):
  """`_route` per device of `mesh`: tokens [N, D] (N split over the "batch" axes), top_i / top_p [N, k], weights
  (gate [E, D, F], up [E, D, F], down [E, F, D]) split over "expert" on E and over "mlp" on F. Returns [N, D]
  split like the tokens, equal to the single-device `_route` (tests/test_model.py checks values and gradients)."""
  gate_edf = weights[0]
  e, _, f = gate_edf.shape
  expert = mesh_axes(mesh, "expert", e)
  tensor = mesh_axes(mesh, "mlp", f, exclude=expert)
  batch = mesh_axes(mesh, "batch", x_nd.shape[0], exclude=tensor)
  gathered = tuple(a for a in expert if a in batch)  # token-split axes that also split the experts
  num_local = e // math.prod(mesh.shape[a] for a in expert) if expert else e

  def per_device(x, ti, tp, gate, up, down):
    if gathered:
      x, ti, tp = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x, ti, tp))
    offset = jax.lax.axis_index(expert) * num_local if expert else 0
    y = _route(x, ti, tp, gate, up, down, c, expert_offset=offset)
    if gathered:
      y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
    reduced = tuple(a for a in (*expert, *tensor) if a not in gathered)
    return jax.lax.psum(y, reduced) if reduced else y

  tokens = P(batch or None, None)
  w_in, w_out = P(expert or None, None, tensor or None), P(expert or None, tensor or None, None)
  return jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, tokens, tokens, w_in, w_in, w_out), out_specs=tokens)(
      x_nd, top_i, top_p, *weights
  )
