"""The jitted, sharded learner: one optimizer update per mini-batch with exact micro-batch accumulation.

State is an explicit pytree (`TrainState`: parameters, optax state, update counter, skipped-update
counter), so checkpointing, rollback (MIPU) and sharding are plain tree operations.

Gradient accumulation is exact: the policy loss of each micro-batch is its *unreduced* sum divided by the
denominator of the whole mini-batch (tokens for token-mean, sequences for seq-mean modes), which does
not depend on the parameters and is computed up front, so the sum of micro-batch gradients is the
gradient of the mini-batch loss (Tunix's `(unreduced_sum, denominator)` design). An objective with a
`prepare` step (M2PO's keep-mask) gets its inputs computed once over the whole mini-batch and each micro-batch
gets its rows of them (`minpro_jax.rl.objectives.Objective`).

Batches are `minpro_jax.rl.rollout.RolloutBatch` records; the jitted functions receive only the arrays they
read (`ScoreInputs`, `UpdateInputs`). With `row_tokens` the samples are packed into rows of that many tokens first
(`minpro_jax.rl.packing`): per-token advantages ([R, W]) and segment ids then reach the loss, the micro-batches
are `micro_batch_size` packed rows, and those that hold only padding are skipped.

Every update also reports the effective sample size of its weights and the cosine of its gradient with the
previous update's (`minpro_jax.rl.ess`), and with `ess_step` scales its step by VCPO's sqrt(ESS / B).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minpro_jax.models.logprobs import token_logprobs
from minpro_jax.models.transformer import Transformer
from minpro_jax.rl import packing
from minpro_jax.rl.aggregation import k3
from minpro_jax.rl.ess import ess_metrics, tree_cosine
from minpro_jax.rl.learner_inputs import ScoreInputs, UpdateInputs, device, replayed_routes
from minpro_jax.rl.learner_metrics import METRIC_INIT, NUM_POSITION_BINS, combine_metric, pad_counts, position_bins
from minpro_jax.rl.objectives import get_objective, policy_loss, resolve_hparams
from minpro_jax.rl.optimizer import OptimizerConfig, make_optimizer, make_schedule
from minpro_jax.rl.rollout import RolloutBatch
from minpro_jax.runtime.multihost import settle, to_host
from minpro_jax.runtime.sharding import check_global, replicate_local_leaves
from minpro_jax.runtime.xla_options import learner_compiler_options


@flax.struct.dataclass
class TrainState:
  """params: nnx.State of the model's parameters; opt_state: optax state; step: int32 number of optimizer
  updates applied (= the `policy_version` of `params`); skipped: int32 updates skipped by the non-finite guard."""

  params: Any
  opt_state: Any
  step: jax.Array
  skipped: jax.Array


def _all_finite(tree) -> jax.Array:
  """Scalar bool: every floating-point leaf of `tree` is finite."""
  leaves = [
      jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
  ]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Which objective and its hyper-parameters, plus optional extra terms (all off by default).

  method / hparams: passed to `minpro_jax.rl.objectives.policy_loss`.
  temperature: the sampler's temperature; learner log-probs are scored under the same scaled distribution.
  entropy_coef: adds -coef * token-mean entropy. kl_coef: adds coef * the token-mean k3 ("low_var_kl" in verl)
    estimate of KL(pi_theta || mu) against the behavior policy mu, on mu's samples. router_aux_coef: weight of the MoE load-balancing loss (0 = off).
  router_replay: MoE only: every forward of scoring and the update routes each response token to the experts the
    sampler used (`RolloutBatch.routes`, `models.moe`); the gates stay the learner's own.
  """

  method: str = "minpro"
  hparams: tuple[tuple[str, Any], ...] = ()
  temperature: float = 1.0
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  router_aux_coef: float = 0.0
  logprob_chunk_size: int = 256
  router_replay: bool = False

  @property
  def hparam_dict(self) -> dict[str, Any]:
    return dict(self.hparams)

  @property
  def reads_learner_logp(self) -> bool:
    """Whether the loss reads `learner_logp` (the learner's log-probs at the sampling version, `Learner.score`):
    only with rollout correction (TIS `rollout_is`, MIS `rollout_mis`); every objective else reads `behavior_logp`."""
    hp = self.hparam_dict
    return bool(hp.get("rollout_is") or hp.get("rollout_mis"))

  @property
  def proximal(self) -> str | None:
    """Where decoupled PPO's pi_prox comes from (`minpro_jax.rl.proximal`): "score", "interpolate", or None for an
    objective without one."""
    return resolve_hparams(self.method, self.hparam_dict).get("proximal")

  @property
  def reads_proximal_logp(self) -> bool:
    """Whether each learn step first scores its released batch at the parameters before its first update
    (`RolloutBatch.proximal_logp`): only decoupled PPO with `proximal="score"`."""
    return self.proximal == "score"


def call_policy_loss(loss_cfg: LossConfig, logp, batch: UpdateInputs, prepared: dict[str, jax.Array]):
  """`policy_loss` on `batch` with the configured method and the rows of its prepared inputs. With rollout
  correction (TIS/MIS) on, the three-policy form is used: ratio against the learner at the sampling version
  (`learner_logp`), correction factor against the sampler (`behavior_logp`). Decoupled PPO gets its proximal
  log-probs or interpolation weight when the batch carries them."""
  hp = loss_cfg.hparam_dict
  old = batch.behavior_logp
  if loss_cfg.reads_learner_logp:
    hp = {**hp, "rollout_logp": batch.behavior_logp}
    old = batch.learner_logp
  if _packed(batch):  # one segment per sample: the objectives reduce per segment
    hp = {**hp, "segment_ids": batch.segment_ids}
  if batch.proximal_logp is not None:  # decoupled PPO's pi_prox, scored at the step's first update
    hp = {**hp, "proximal_logp": batch.proximal_logp}
  if batch.proximal_alpha is not None:  # or A-3PO's interpolation weight of this update
    hp = {**hp, "proximal_alpha": batch.proximal_alpha}
  return policy_loss(loss_cfg.method, logp, old, batch.advantages, batch.response_mask, **{**hp, **prepared})


def _packed(batch: UpdateInputs) -> bool:
  """Whether `batch` is packed (static: per-token advantages)."""
  return batch.advantages.ndim == 2


def _skip_padding(fn, out_shapes):
  """`fn` of a micro-batch, or zeros of `out_shapes` when it holds only padding rows (every segment id 0):
  `jax.lax.cond` runs one branch, so a packed mini-batch costs the micro-batches its samples fill."""

  def run(x):
    zeros = lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)  # noqa: E731
    return jax.lax.cond(jnp.any(x.segment_ids != 0), fn, zeros, x)

  return run


def _skip_micro_padding(body, ys_shapes):
  """The accumulation loop's `body(acc, (micro, prepared, bins))`, or `(acc, zeros of ys_shapes)` (its per-row
  outputs: log-probs, token weights) for a micro-batch of padding rows (every segment id 0): `jax.lax.cond` runs one
  branch, so it costs no forward or backward."""

  def skip(acc, xs):
    del xs
    return acc, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ys_shapes)

  return lambda acc, xs: jax.lax.cond(jnp.any(xs[0].segment_ids != 0), body, skip, acc, xs)


class Learner:
  """Jitted update and scoring functions for one model architecture and objective.

  Args:
    model: a `Transformer` (only its graph definition and parameter shapes are kept).
    loss_cfg: objective and extra terms.
    opt_cfg: optimizer.
    micro_batch_size: samples (packed: packed rows) per micro-batch of the accumulation loop.
    mesh: optional mesh; batches are placed along the "batch" logical axis.
    row_tokens: None / 0 (rows of one sample each), or the token budget of packed rows (`learner.row_tokens`,
      `minpro_jax.rl.packing`).
    ess_step: VCPO's step (`learner.ess_step`, arXiv 2602.17616): each update's step is multiplied by
      sqrt(ESS / B) of the mini-batch's sequence likelihood ratios (`minpro_jax.rl.ess`, `ess/seq_is_frac`).
      VCPO's second part, its closed-form off-policy baseline, is not implemented: it weighs each sequence by
      w_i^2 ||grad log pi(y_i)||^2, a gradient norm per sequence, i.e. one backward pass per sequence, where this
      learner accumulates one gradient over micro-batches.

  Raises:
    ValueError: micro_batch_size <= 0; row_tokens < 0; `loss_cfg.method` not registered or hparams it does not
      take (`minpro_jax.rl.objectives.resolve_hparams`); packing with `seq-mean-token-sum-norm` and no
      `max_response_length` (its default, the row width, would change with packing).
  """

  def __init__(
      self,
      model: Transformer,
      loss_cfg: LossConfig,
      opt_cfg: OptimizerConfig,
      *,
      micro_batch_size: int,
      mesh=None,
      row_tokens: int | None = None,
      ess_step: bool = False,
  ):
    if micro_batch_size <= 0:
      raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    if row_tokens is not None and row_tokens < 0:
      raise ValueError(f"learner.row_tokens must be >= 0 (0 = no packing), got {row_tokens}")
    hp = resolve_hparams(loss_cfg.method, loss_cfg.hparam_dict)
    if row_tokens and hp["loss_agg_mode"] == "seq-mean-token-sum-norm" and hp["max_response_length"] is None:
      raise ValueError(
          "learner.row_tokens: loss_agg_mode='seq-mean-token-sum-norm' divides by max_response_length, which "
          "defaults to the row width and so changes with packing; set loss max_response_length (e.g. "
          "sampling.max_new_tokens) or turn packing off (row_tokens=0)"
      )
    self.row_tokens = row_tokens or None
    self.graphdef, _ = nnx.split(model)
    self.loss_cfg = loss_cfg
    self.objective = get_objective(loss_cfg.method)
    self.opt_cfg = opt_cfg
    self.optimizer = make_optimizer(opt_cfg)
    self.schedule = make_schedule(opt_cfg)
    self.micro_batch_size = micro_batch_size
    self.mesh = mesh
    self.ess_step = bool(ess_step)
    self._update = None  # jitted on first use, with the state's shardings as output shardings
    self._zero_grads = None  # likewise
    # public for compile-only tools (`minpro_jax.aot` lowers it)
    self._options = learner_compiler_options(mesh)  # TPU: no windowed einsums (`runtime/xla_options.py`)
    self.jitted_score = jax.jit(self._score_impl, static_argnums=(2,), compiler_options=self._options)

  # ----- state -----
  def init_state(self, params) -> TrainState:
    """A fresh `TrainState` (optimizer moments zero, step 0) for parameter state `params`.

    With a mesh, the leaves on one device (the counters) are replicated on it; in a multi-process run every leaf
    is then checked to be a global array on the mesh, which orbax can checkpoint.

    Raises:
      ConfigError: naming `config.mesh.shape` and the leaf, when one is not (`sharding.check_global`).
    """
    state = TrainState(
        params=params,
        opt_state=self.optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
    )
    if self.mesh is None:
      return state
    state = settle(replicate_local_leaves(state, self.mesh))  # the counters; params and moments are on it already
    if jax.process_count() > 1:  # orbax writes only global arrays there: fail now, not at the first checkpoint
      check_global(state, self.mesh, "the learner state")
    return state

  def _state_shardings(self, state: TrainState):
    """Each leaf's sharding; with a mesh, scalars and other single-device leaves are replicated on it."""

    def one(x):
      if self.mesh is not None and isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      return x.sharding

    return jax.tree.map(one, state)

  def model(self, params) -> Transformer:
    return nnx.merge(self.graphdef, params)

  # ----- scoring -----
  def score(self, params, batch: RolloutBatch, *, return_routes: bool = False, chunk_rows: int | None = None):
    """[N, L] float32 teacher-forced log-probs (sampler temperature) of `batch.tokens` under `params`, in
    micro-batches (the log-prob of token t at index t; values off `response_mask` are not meaningful). With
    `LossConfig.router_replay` the forward replays `batch.routes`; with `batch.kept_logp_threshold` (truncated
    sampling) they are renormalised over the sampler's top-k / top-p sets, as in the update.

    Args:
      return_routes: also return the [N, L, layers, k] int16 experts the learner's router chose (MoE; None for a
        dense model), for the routing-mismatch metric.
      chunk_rows: with `row_tokens`, pack each consecutive chunk of this many samples on its own (the step's
        mini-batches, as the per-process score pass does: `minpro_jax.rl.process_packing`); None: the whole batch.

    Raises:
      ValueError: N not divisible by the micro-batch size or `chunk_rows`; replay without routes in the batch.
    """
    n = batch.size
    mb = min(self.micro_batch_size, n)
    if n % mb:
      raise ValueError(f"batch of {n} rows is not divisible by micro_batch_size {mb}")
    replay = self.loss_cfg.router_replay
    if self.row_tokens is None:
      logp, routes = self.jitted_score(params, ScoreInputs.of(batch, replay), mb)
      logp, routes = to_host((logp, routes if return_routes else None))  # an MoE's [N, L, layers, k]: only if asked
      return (logp, routes) if return_routes else logp
    replayed_routes(batch, replay)  # the same error as unpacked
    plans = packing.plan_chunks(batch.segment_ids, chunk_rows or n, self.row_tokens, mb)
    rows = packing.pack_chunks(batch, plans, packing.SCORE_FIELDS, routes=replay)
    inputs = ScoreInputs(
        *(jnp.asarray(rows[f]) for f in packing.SCORE_FIELDS),
        routes=device(rows.get("routes")),
        kept_logp_threshold=device(rows.get("kept_logp_threshold")),
    )
    logp, routes = self.jitted_score(params, inputs, mb)
    logp, routes = to_host((logp, routes if return_routes else None))
    logp = packing.unpack_chunks(logp, plans, batch.tokens.shape)
    if routes is not None:
      routes = packing.unpack_chunks(routes, plans, batch.tokens.shape, fill=packing.NO_ROUTE)
    return (logp, routes) if return_routes else logp

  def _score_impl(self, params, arrays: ScoreInputs, mb):
    """(logp [N, L], the router's own routes [N, L, layers, k] or None)."""

    def one(x: ScoreInputs):
      # fresh Variables inside the loop body: scanned layers cannot use Variables of the enclosing jit's trace
      lp = token_logprobs(
          nnx.merge(self.graphdef, params, copy=True),
          x.tokens,
          x.segment_ids,
          x.positions,
          temperature=self.loss_cfg.temperature,
          chunk_size=self.loss_cfg.logprob_chunk_size,
          routes_btlk=x.routes,
          kept_logp_threshold_bt=x.kept_logp_threshold,
      )
      return lp.logp, lp.routes

    if self.row_tokens is not None:  # packed: skip the micro-batches of padding rows
      one = _skip_padding(one, jax.eval_shape(one, jax.tree.map(lambda a: a[:mb], arrays)))
    split = jax.tree.map(lambda a: a.reshape(-1, mb, *a.shape[1:]), arrays)
    logp, routes = jax.lax.map(one, split)
    merge = lambda a: a.reshape(arrays.tokens.shape[0], *a.shape[2:])  # noqa: E731
    return merge(logp), None if routes is None else merge(routes)

  # ----- update -----
  def micro_batch(self, rows: int) -> int:
    """The micro-batch of an update of `rows` rows: `micro_batch_size`, or `rows` when smaller.

    Raises:
      ValueError: `rows` not divisible by it.
    """
    mb = min(self.micro_batch_size, rows)
    if rows % mb:
      raise ValueError(f"mini-batch of {rows} samples is not divisible by micro_batch_size {mb}")
    return mb

  def zero_grads(self, params) -> Any:
    """A float32 zero of `params`' shapes, sharded like them: the `previous_grads` of a step's first update (no
    cosine). Made by a program of its own so that every device holds its own buffer: the update donates it."""
    if self._zero_grads is None:  # one program (a lambda made anew would trace and compile at every call)
      shardings = jax.tree.map(lambda p: p.sharding, params)
      zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)  # noqa: E731
      self._zero_grads = jax.jit(zeros, out_shardings=shardings)
    return self._zero_grads(params)

  def update(self, state: TrainState, batch: RolloutBatch, lr_scale: float = 1.0) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer update on a mini-batch (donates `state`).

    Args:
      state: current `TrainState` (invalid after the call).
      batch: the mini-batch of M samples (reads tokens, segment_ids, positions, response_mask,
        behavior_logp, learner_logp and advantages; proximal_logp when set).
      lr_scale: multiplies the scheduled learning rate of this update (a traced scalar: a new value does not
        recompile; `minpro_jax.rl.lr_decay`). AdamW's step, weight decay included, is linear in the rate and its
        moments do not depend on it, so scaling the update is the update at the scaled rate.

    Returns:
      (new state, metrics dict of numpy scalars / arrays). If the loss or gradient is not finite the update
      is skipped: parameters and optimizer state are unchanged and `skipped` increments. Among the metrics:
      "pad_fraction", the share of the token slots run that are padding (`packing.pad_fraction`); at the
      parameters before the update and token-means over the response tokens, `entropy_mean` (nats) of the
      learner's full tempered distribution, `learner_behavior/k3` the k3 estimate of KL(pi_theta || mu) against
      the behavior log-probs (the `kl_coef` term's; 0 on-policy) and `learner_behavior/abs_log_ratio_mean`; the
      effective sample sizes `ess/token_frac`, `ess/seq_frac`, `ess/seq_is_frac` (`minpro_jax.rl.ess`) and
      `ess_step_scale` (sqrt of `ess/seq_is_frac` with `ess_step`, else 1). `grad_cosine` is NaN here: a lone
      update has no previous gradient (`update_arrays` takes one).

    Raises:
      ValueError: M not divisible by the micro-batch size; replay without routes in the batch.
    """
    arrays, pad = self.update_inputs(batch, self.micro_batch(batch.size))
    state, metrics, _ = self.update_arrays(state, arrays, lr_scale, pad_fraction=pad)
    return state, metrics

  def update_arrays(
      self,
      state: TrainState,
      arrays: UpdateInputs,
      lr_scale: float = 1.0,
      *,
      pad_fraction: float | None = None,
      previous_grads: Any = None,
  ) -> tuple[TrainState, dict[str, Any], Any]:
    """`update` of a mini-batch given as its device arrays (donates `state` and `previous_grads`): the host rows of
    `update_inputs`, or in a multi-process run the global [M, ...] arrays the processes assembled from their own
    rows (`minpro_jax.rl.process_inputs`), laid out on the learner's batch sharding.

    Args:
      pad_fraction: the padding share of the slots run, or None to count it on the devices (`pad_counts`: the same
        value `packing.pad_fraction` gives on the host).
      previous_grads: the float32 gradient the previous update of the step returned (its cosine with this one is
        the `grad_cosine` metric), or None (`zero_grads`: the metric is NaN).

    Returns:
      (new state, metrics, this update's float32 gradient: the next update's `previous_grads`; the previous one
      again when this update is skipped). Skips as `update`.

    Raises:
      ValueError: M not divisible by the micro-batch size.
    """
    m = arrays.tokens.shape[0]
    mb = self.micro_batch(m)
    if pad_fraction is None:
      real, active = (int(x) for x in to_host(pad_counts(arrays.segment_ids, mb)))
      pad_fraction = 1.0 - float(real) / max(active * mb * arrays.tokens.shape[1], 1)
    if previous_grads is None:
      previous_grads = self.zero_grads(state.params)
    if self._update is None:  # pin the output layout to the state's so donation works and nothing recompiles
      shardings = self._state_shardings(state)
      self._update = self.jitted_update(shardings)
    state, metrics, grads = self._update(state, arrays, mb, np.asarray(lr_scale, np.float32), previous_grads)
    return state, {**to_host(metrics), "pad_fraction": np.float32(pad_fraction)}, grads

  def update_inputs(self, batch: RolloutBatch, mb: int) -> tuple[UpdateInputs, float]:
    """(the device arrays an update of `batch` reads: its rows, or with `row_tokens` its packed rows, `mb` rows per
    micro-batch (`minpro_jax.rl.packing`); the padding fraction of the slots the update runs)."""
    replay = self.loss_cfg.router_replay
    if self.row_tokens is None:
      return UpdateInputs.of(batch, replay), packing.pad_fraction(batch.segment_ids, mb)
    replayed_routes(batch, replay)  # the same error as unpacked
    rows = packing.pack(batch, packing.plan(batch.segment_ids, self.row_tokens, mb), routes=replay)
    arrays = UpdateInputs(
        *(jnp.asarray(rows[f]) for f in packing.PACKED_FIELDS),
        routes=device(rows.get("routes")),
        kept_logp_threshold=device(rows.get("kept_logp_threshold")),
        proximal_logp=device(rows.get("proximal_logp")),
    )
    return arrays, packing.pad_fraction(rows["segment_ids"], mb)

  def jitted_update(self, state_shardings):
    """The jitted update `update` runs, `(state, UpdateInputs, micro_batch, lr_scale, previous_grads) -> (state,
    metrics, grads)`: the state and the previous float32 gradient donated, the state returned laid out as
    `state_shardings` (a `TrainState` of shardings) and the gradient as its parameters. Compile-only tools lower
    it."""
    return jax.jit(self._update_impl, donate_argnums=(0, 4), static_argnums=(2,),
                   out_shardings=(state_shardings, None, state_shardings.params),
                   compiler_options=self._options)  # fmt: skip

  def _micro_objective(self, params, micro: UpdateInputs, denom, num_tokens, num_rows, prepared):
    lc = self.loss_cfg
    model = self.model(params)
    # the entropy is always computed: the `entropy_mean` metric (a few elementwise passes over each chunk's logits)
    lp = token_logprobs(
        model,
        micro.tokens,
        micro.segment_ids,
        micro.positions,
        temperature=lc.temperature,
        chunk_size=lc.logprob_chunk_size,
        return_entropy=True,
        routes_btlk=micro.routes,
        kept_logp_threshold_bt=micro.kept_logp_threshold,
    )
    out = call_policy_loss(lc, lp.logp, micro, prepared)
    mask = micro.response_mask.astype(jnp.float32)
    total = out.loss_sum / denom
    if lc.entropy_coef != 0.0:
      total = total - lc.entropy_coef * jnp.sum(lp.entropy * mask) / num_tokens
    if lc.kl_coef:
      delta = jnp.clip(jnp.where(mask > 0, micro.behavior_logp - lp.logp, 0.0), -20.0, 20.0)
      total = total + lc.kl_coef * jnp.sum(k3(delta) * mask) / num_tokens
    if lc.router_aux_coef:
      total = total + lc.router_aux_coef * lp.router_aux_loss * micro.tokens.shape[0] / num_rows
    return total, (out, lp)

  def _update_impl(self, state: TrainState, arrays: UpdateInputs, mb, lr_scale, previous_grads):
    lc = self.loss_cfg
    m = arrays.tokens.shape[0]
    mask = arrays.response_mask
    num_tokens = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)

    prepared = {}
    if self.objective.prepare is not None:  # inputs that are a function of the whole mini-batch's log-ratios
      logp_all = self._score_impl(state.params, arrays.score_inputs(), mb)[0]
      prepared = self.objective.prepare(
          jax.lax.stop_gradient(logp_all) - arrays.behavior_logp,
          arrays.advantages,
          mask,
          resolve_hparams(lc.method, lc.hparam_dict),
      )
    # The policy-loss denominator does not depend on the parameters: get it for the whole mini-batch.
    denom = jnp.maximum(call_policy_loss(lc, jnp.zeros(mask.shape, jnp.float32), arrays, prepared).denominator, 1.0)

    alpha = arrays.proximal_alpha  # a scalar of the whole update (A-3PO), not split into micro-batches
    split = jax.tree.map(lambda a: a.reshape(m // mb, mb, *a.shape[1:]), arrays._replace(proximal_alpha=None))
    split_prepared = jax.tree.map(lambda a: a.reshape(m // mb, mb, *a.shape[1:]), prepared)
    grad_fn = jax.grad(self._micro_objective, has_aux=True)
    bins = position_bins(mask, arrays.segment_ids if _packed(arrays) else None)
    split_bins = bins.reshape(m // mb, mb, -1)
    rows = m  # that run: packed, the micro-batches of padding rows are skipped (the router aux loss's mean)
    if _packed(arrays):
      rows = mb * jnp.sum(jnp.any(split.segment_ids != 0, axis=(1, 2))).astype(jnp.float32)

    def body(acc, xs):
      micro, mprepared, mbins = xs
      micro = micro._replace(proximal_alpha=alpha)
      grads, (out, lp) = grad_fn(state.params, micro, denom, num_tokens, rows, mprepared)
      g_acc, loss_acc, metric_acc, by_bin = acc
      g_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_acc, grads)
      valid = micro.response_mask.astype(jnp.float32)
      onehot = jax.nn.one_hot(mbins, NUM_POSITION_BINS) * valid[..., None]
      tw = out.token_weights.astype(jnp.float32)
      abs_log_ratio = jnp.abs(lp.logp - micro.behavior_logp)
      # the k3 estimate of KL(pi_theta || mu) the `kl_coef` term penalises (clamped as there)
      kl_k3 = k3(jnp.clip(jnp.where(valid > 0, micro.behavior_logp - lp.logp, 0.0), -20.0, 20.0))
      ent = jax.lax.stop_gradient(lp.entropy)
      per_token = jnp.stack([jnp.ones_like(tw), tw, tw * tw, abs_log_ratio, kl_k3, ent])  # [6, n, l]: per position bin
      by_bin = by_bin + jnp.einsum("nlb,knl->kb", onehot, jnp.where(valid > 0, per_token, 0.0))
      w = jnp.sum(valid) / num_tokens
      metric_acc = {k: combine_metric(k, metric_acc[k], v, w) for k, v in out.metrics.items()}
      return (g_acc, loss_acc + out.loss_sum, metric_acc, by_bin), (lp.logp, tw)

    if _packed(arrays):  # a micro-batch of padding rows adds nothing: skip its forward and backward
      per_row = jax.ShapeDtypeStruct((mb, *arrays.tokens.shape[1:]), jnp.float32)
      body = _skip_micro_padding(body, (per_row, per_row))
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    first, first_prepared = jax.tree.map(lambda a: a[0], (split, split_prepared))
    first = first._replace(proximal_alpha=alpha)
    metric_shape = jax.eval_shape(lambda: call_policy_loss(lc, first.behavior_logp, first, first_prepared).metrics)
    zero_metrics = {
        k: jnp.full(s.shape, METRIC_INIT.get(k.rsplit("_", 1)[-1], 0.0), jnp.float32) for k, s in metric_shape.items()
    }
    init = (
        zero_grads,
        jnp.zeros((), jnp.float32),
        zero_metrics,
        # per bin: tokens, sums of w, w^2, |log ratio|, k3, entropy
        jnp.zeros((6, NUM_POSITION_BINS), jnp.float32),
    )
    (grads, loss_sum, metrics, by_bin), (logp, token_weights) = jax.lax.scan(
        body, init, (split, split_prepared, split_bins)
    )
    wcnt, wsum, wsq, abs_lr, kl_k3, ent = by_bin
    logp, token_weights = logp.reshape(mask.shape), token_weights.reshape(mask.shape)
    ess = ess_metrics(token_weights, logp, arrays.behavior_logp, mask, arrays.segment_ids if _packed(arrays) else None)
    # VCPO (arXiv 2602.17616): the step times sqrt(ESS / B) of the sequence likelihood ratios (mit-han-lab/vcpo:
    # lr x min(1, ess_ratio / base_ess_ratio) ** 0.5, base 1, unclipped ratios)
    ess_scale = jnp.sqrt(ess["ess/seq_is_frac"]) if self.ess_step else jnp.ones((), jnp.float32)
    loss = loss_sum / denom
    grad_norm = optax.global_norm(grads)
    grads_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    safe_grads = jax.tree.map(lambda g: jnp.where(grads_finite, g, 0.0), grads)
    updates, new_opt = self.optimizer.update(safe_grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: (u * (lr_scale * ess_scale)).astype(u.dtype), updates)
    new_params = optax.apply_updates(state.params, updates)
    # an update that makes the parameters or the optimizer state non-finite is skipped too
    finite = grads_finite & _all_finite(new_params) & _all_finite(new_opt)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = TrainState(
        params=keep(new_params, state.params),
        opt_state=keep(new_opt, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
    )
    valid = mask.astype(bool)
    delta = jnp.where(valid, logp - arrays.behavior_logp, 0.0)
    out_metrics = {f"policy/{k}": v for k, v in metrics.items()}
    out_metrics.update(
        {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.schedule(state.step) * lr_scale * ess_scale,
            **ess,
            "ess_step_scale": ess_scale,
            # GAC (arXiv 2603.01501): the cosine with the previous update's gradient (NaN without one)
            "grad_cosine": tree_cosine(previous_grads, grads),
            "update_skipped": ~finite,
            "learner_behavior/abs_log_ratio_mean": jnp.sum(jnp.abs(delta)) / num_tokens,
            "learner_behavior/k3": jnp.sum(kl_k3) / num_tokens,
            "entropy_mean": jnp.sum(ent) / num_tokens,
            "weight_by_position_bin": wsum / jnp.maximum(wcnt, 1.0),
            "weight_sq_by_position_bin": wsq / jnp.maximum(wcnt, 1.0),
            "abs_log_ratio_by_position_bin": abs_lr / jnp.maximum(wcnt, 1.0),
            "tokens_by_position_bin": wcnt,
        }
    )
    next_grads = jax.tree.map(lambda g, p: jnp.where(finite, g, p), grads, previous_grads)
    return new_state, out_metrics, next_grads


def staleness(update_index: int, policy_version: np.ndarray) -> np.ndarray:
  """[N] int64 updates applied between sampling and this update: `update_index - policy_version` per sample
  (what the delay buffer makes of it: see minpro_jax.rl.rollout)."""
  return update_index - np.asarray(policy_version, np.int64)
