"""One process of the multi-process tests (`tests/test_multihost.py`), started by `minpro_jax.launch_local`.

    python -m tests.multihost_worker MODE OUT_DIR

MODE "primitives": initializes jax.distributed through `maybe_initialize_distributed` (the trainer's path), runs
the host-side primitives of `minpro_jax.runtime.multihost`, the per-process batches of `.row_layout` and the
trainer's data order on a 2 x 2 mesh, and writes what this process saw to OUT_DIR/process_<i>.json. MODE "layout": places a tree with a one-device scalar on the
mesh of every device (`sharding.replicate_local_leaves`), checks and saves it with orbax, and records what
`sharding.check_global` says of leaves that are not global. MODE "process_inputs": the per-process learner inputs and delay buffer of `rl.process_inputs`. MODE
"sampled_rows": the sampler's outputs and the score pass per process. MODE "fail": process 1 exits with status 3, the others wait.
MODE "sleep": every process waits for SIGTERM, records it in OUT_DIR/process_<i>.signal and exits 143. MODE
"stubborn": every process ignores SIGTERM and waits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def primitives(out_dir: str) -> dict:
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  assert maybe_initialize_distributed() is True
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.data import ProblemLoader
  from minpro_jax.data.records import MathProblem
  from minpro_jax.errors import LaunchError
  from minpro_jax.run.heldout import grade_split
  from minpro_jax.runtime import multihost
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh({"data": 2, "fsdp": 2})
  rows = np.arange(24, dtype=np.float32).reshape(8, 3)  # the same host value on every process
  sharded = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P(("data", "fsdp"))))(rows)
  problems = [MathProblem(id=f"p{i}", prompt=f"q{i}", answer=str(i), source="toy") for i in range(40)]
  loader = ProblemLoader(problems, 6, seed=3, shard_index=0, shard_count=1)
  batch = next(loader)
  mine = batch[multihost.process_rows(len(batch))]
  responses = [f"\\boxed{{{p.answer if k % 2 else 'x'}}}" for k, p in enumerate(batch)]
  rewards, stats = grade_split(responses, [p.answer for p in batch], mode="math")
  mine_only = [r if k in range(6)[multihost.process_rows(6)] else None for k, r in enumerate(responses)]
  rewards_mine_only, _ = grade_split(mine_only, [p.answer for p in batch], mode="math")  # the others not decoded
  try:
    multihost.check_same(f"config of process {jax.process_index()}", "the config")
    same_error = None
  except LaunchError as e:
    same_error = str(e)
  multihost.check_same("one config", "the config")
  return {
      **_host_batch(mesh),
      "micro_batch_error": _micro_batch_error(out_dir),
      "odd_prompts_error": _micro_batch_error(out_dir, prompts_per_step=3, num_updates_per_step=3, micro_batch_size=4),
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "devices": jax.device_count(),
      "local_devices": jax.local_device_count(),
      "fully_addressable": bool(sharded.is_fully_addressable),
      "to_host": multihost.to_host(sharded).tolist(),
      "sum": multihost.sum_over_processes(np.asarray([1, jax.process_index()])).tolist(),
      "gathered": multihost.gather_rows(np.arange(7)[multihost.process_rows(7)] * 10, 7).tolist(),
      "batch_ids": [p.id for p in batch],
      "my_ids": [p.id for p in mine],
      "rewards": rewards,
      "rewards_mine_only": rewards_mine_only,
      "stats": stats,
      "check_same_error": same_error,
  }


def _host_batch(mesh) -> dict:
  """Per-process batches (`runtime.row_layout`): 4 prompts x 2 samples; each process makes only its groups' rows,
  computes their advantages and places them; the global values and statistics come back on both."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from minpro_jax.errors import ConfigError
  from minpro_jax.rl.advantages import group_advantages
  from minpro_jax.runtime import multihost, row_layout
  from minpro_jax.runtime.sharding import make_mesh

  prompts, group, n = 4, 2, 8
  rows = row_layout.process_group_rows(prompts, group)
  rewards = np.asarray([1.0, 0.0, 0.5, 0.5, 0.25, 1.0, 0.0, 0.0], np.float32)[rows]  # only this process's rows
  group_ids = np.arange(prompts).repeat(group)[rows]
  adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(group_ids)))
  sharding = row_layout.batch_sharding(mesh, ("data", "fsdp"))
  row_layout.check_layout(sharding, prompts, group)
  placed = row_layout.global_rows({"rewards": rewards, "advantages": adv}, sharding, n)
  doubled = jax.jit(lambda x: 2 * x, out_shardings=sharding)(placed["rewards"])  # a program on the global array
  reversed_mesh = make_mesh({"data": 2, "fsdp": 2}, devices=jax.devices()[::-1])  # process 1's devices first
  try:
    row_layout.check_layout(row_layout.batch_sharding(reversed_mesh, ("data", "fsdp")), prompts, group)
    layout_error = None
  except ConfigError as e:
    layout_error = str(e)
  return {
      "hb_rows": [rows.start, rows.stop],
      "hb_shards": [int(s.data.shape[0]) for s in placed["rewards"].addressable_shards],
      "hb_rewards": multihost.to_host(placed["rewards"]).tolist(),
      "hb_advantages": multihost.to_host(placed["advantages"]).tolist(),
      "hb_doubled": multihost.to_host(doubled).tolist(),
      "hb_local_doubled": row_layout.local_rows(doubled).tolist(),  # no collective: this process's shards
      "hb_stats": row_layout.batch_stats({"reward": rewards, "length": np.asarray([3, 5])[: jax.process_index()]}),
      "hb_layout_error": layout_error,
  }


def _micro_batch_error(out_dir: str, **overrides) -> str | None:
  """The trainer's config check of micro-batches of 2 on fsdp=-1 (the mesh spans both processes' 4 devices), or of
  the config with `overrides`."""
  from minpro_jax.config_lib.defaults import get_config
  from minpro_jax.run import run_config

  c = get_config()
  c.update_from_flattened_dict(
      {
          "workdir": os.path.join(out_dir, "run"),
          "mesh.shape": "fsdp=-1",
          "micro_batch_size": 2,
          "prompts_per_step": 4,
          **overrides,
      }
  )  # the default's group_size 8 and 4 updates: mini-batches of 8
  try:
    run_config.validate_config(c)
  except run_config.ConfigError as e:
    return str(e)
  return None


def layout(out_dir: str) -> dict:
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  assert maybe_initialize_distributed() is True
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.errors import ConfigError
  from minpro_jax.runtime.sharding import check_global, make_mesh, replicate_local_leaves

  mesh = make_mesh({"data": -1})
  replicated = NamedSharding(mesh, P())

  def check(tree):
    try:
      check_global(tree, mesh, "the tree")
      return None
    except ConfigError as e:
      return str(e)

  w = jax.jit(lambda: jnp.arange(4.0), out_shardings=replicated)()
  tree = {"w": w, "count": jnp.zeros((), jnp.int32) + 5}  # `count` on this process's first device, like optax's
  placed = replicate_local_leaves(tree, mesh)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(out_dir, "ckpt"), placed)
  ckptr.wait_until_finished()
  restored = ckptr.restore(os.path.join(out_dir, "ckpt"), jax.tree.map(ocp.utils.to_shape_dtype_struct, placed))
  raw = jax.device_put(jnp.zeros((), jnp.int32), replicated)  # the path init_state took before
  try:
    raw.addressable_shards  # noqa: B018
    raw_readable = True
  except ValueError:
    raw_readable = False
  return {
      "local_devices": jax.local_device_count(),
      "w_kept": placed["w"] is w,
      "count_replicated": placed["count"].sharding == replicated,
      "placed_error": check(placed),
      "restored": {k: jax.device_get(v.addressable_shards[0].data).tolist() for k, v in restored.items()},
      "one_device_error": check({"x": jax.device_put(jnp.zeros(()), jax.local_devices()[0])}),
      "raw_readable": raw_readable,
      "raw_error": check({"x": raw}),
  }


def _dynamic_rounds(np, jax) -> dict:
  """Dynamic sampling's filled batch from per-process rounds (`process_dynamic.take_own_groups`) against this
  process's rows of `take_groups` over the whole rounds: two rounds of 4 groups of 2, prompts 3 and 5 wide."""
  from minpro_jax.rl.dynamic_sampling import take_groups
  from minpro_jax.rl.process_dynamic import take_own_groups
  from minpro_jax.sampling.batch import GenerationBatch

  rng = np.random.default_rng(3)

  def round_(p):
    return GenerationBatch(
        prompt_tokens=rng.integers(1, 50, (8, p)).astype(np.int32),
        prompt_mask=rng.random((8, p)) < 0.8,
        response_tokens=rng.integers(1, 50, (8, 4)).astype(np.int32),
        response_mask=rng.random((8, 4)) < 0.7,
        behavior_logp=rng.normal(size=(8, 4)).astype(np.float32),
        entropy=rng.random((8, 4)).astype(np.float32),
        lengths=rng.integers(0, 5, 8).astype(np.int32),
        finish_reason=np.where(rng.random(8) < 0.5, "stop", "length"),
        group_ids=np.repeat(np.arange(4, dtype=np.int64), 2),
        sample_index=np.tile(np.arange(2, dtype=np.int32), 4),
        policy_version=3,
    )

  whole = [round_(3), round_(5)]
  groups = [(1, 0), (0, 3), (1, 2), (0, 1)]  # slot 0 from process 0's round-1 rows, slot 1 from process 1's, ...
  rows = slice(4 * jax.process_index(), 4 * jax.process_index() + 4)
  want = take_groups(whole, groups, 2, pad_id=0).select(rows)
  got = take_own_groups([g.select(rows) for g in whole], groups, 2, 0)
  fields = [f for f in want.__dataclass_fields__ if f != "group_ids"]
  return {
      "equal": {f: bool(np.array_equal(getattr(got, f), getattr(want, f))) for f in fields},
      "shape": list(got.prompt_tokens.shape),
  }


def per_process_batch(out_dir: str) -> dict:
  """`rl.process_inputs` in two processes: each keeps its rows of a step's batch, the learner's global arrays are
  staged from them, mini-batch j is sliced on the devices (its 4 rows are one process's), and the delay buffer is
  checkpointed and restored per process."""
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  assert maybe_initialize_distributed() is True
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.rl import process_inputs
  from minpro_jax.rl.rollout import RolloutBatch, RolloutBuffer
  from minpro_jax.run.checkpoint import RunCheckpointer, buffer_state_from_restored
  from minpro_jax.runtime import multihost, row_layout
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh({"data": 2, "fsdp": 2})
  n, length = 8, 5
  tokens = np.arange(n * length, dtype=np.int32).reshape(n, length)
  whole = RolloutBatch(  # the step's graded batch, as every process has it after grading
      tokens=tokens,
      segment_ids=(tokens % 5 != 0).astype(np.int32),
      positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
      response_mask=np.tile(np.arange(length) >= 2, (n, 1)),
      behavior_logp=(-tokens / 100.0).astype(np.float32),
      learner_logp=np.zeros((n, length), np.float32),
      advantages=np.arange(n, dtype=np.float32),
      rewards=np.arange(n, dtype=np.float32) / 8,
      group_ids=np.arange(n, dtype=np.int64) // 2,
      policy_version=np.full(n, 7, np.int64),
      response_lengths=np.full(n, 3, np.int32),
      truncated=np.zeros(n, bool),
  )
  mine = process_inputs.own_rows(whole, 4, 2)
  staged = process_inputs.stage(mine, mesh, n)
  minis = list(process_inputs.mini_batches(staged, 2, mesh))
  sums = [jax.jit(lambda x: jnp.sum(x.advantages))(m) for m in minis]  # a program on each mini-batch
  try:
    row_layout.staging_sharding(jax.devices()[::-1])
    order_error = None
  except ValueError as e:
    order_error = str(e)
  # the delay buffer: each process checkpoints and restores its own rows
  buffer = RolloutBuffer(1)
  buffer.push(0, mine)
  state = buffer.state_dict()
  meta = {"global_step": 0, "buffer": process_inputs.buffer_layout(state, n)}
  ckpt = RunCheckpointer(os.path.join(out_dir, "run"))
  params = {"w": jax.make_array_from_process_local_data(NamedSharding(mesh, P()), np.arange(4.0, dtype=np.float32))}
  ckpt.save(0, params, process_inputs.buffer_to_global(state, n), meta)
  multihost.barrier("saved")
  files = sorted(os.listdir(os.path.join(out_dir, "run", "checkpoints", "0", "buffer")))
  _, _, buf_state, _ = ckpt.restore_latest(params, buffer_template=process_inputs.buffer_template)
  restored = RolloutBuffer(1)
  restored.load_state_dict(buffer_state_from_restored(buf_state))
  back = restored.pop(1)
  ckpt.close()
  dynamic = _dynamic_rounds(np, jax)
  return {
      "dynamic": dynamic,
      "own_first_tokens": mine.tokens[:, 0].tolist(),
      "staged_shards": [int(s.data.shape[0]) for s in staged.arrays.tokens.addressable_shards],
      "staged_local_rows": row_layout.local_rows(staged.arrays.tokens)[:, 0].tolist(),
      "policy_version": staged.policy_version.tolist(),
      "real_tokens": staged.real_tokens,
      "mini_tokens": [multihost.to_host(m.tokens).tolist() for m in minis],
      "mini_local_rows": [row_layout.local_rows(m.tokens)[:, 0].tolist() for m in minis],
      "mini_sharded": [m.tokens.sharding == process_inputs.learner_sharding(mesh, 4) for m in minis],
      "mini_sums": [float(multihost.to_host(x)) for x in sums],
      "gathered_equal": bool(np.array_equal(process_inputs.gather_batch(mine, n).tokens, tokens)),
      "order_error": order_error,
      "buffer_files": files,
      "restored_first_tokens": back.tokens[:, 0].tolist(),
      "restored_equal": all(np.array_equal(v, mine.to_dict()[k]) for k, v in back.to_dict().items()),
  }


def sampled_rows(out_dir: str) -> dict:
  """Per-process sampler outputs and score pass: each process gets back only its rows of `Sampler.generate`
  (`own_rows=True`, continuous and static samplers) and of `process_inputs.score`, equal to its rows of the global
  ones; the router-mismatch fraction reduced over the processes equals the whole batch's."""
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  assert maybe_initialize_distributed() is True
  import jax
  import numpy as np
  from flax import nnx

  from minpro_jax.models import get_preset, init_model
  from minpro_jax.models.moe import route_mismatch
  from minpro_jax.rl import process_inputs, rollout_metrics
  from minpro_jax.rl.learner import Learner, LossConfig
  from minpro_jax.rl.optimizer import OptimizerConfig
  from minpro_jax.rl.rollout import RolloutBatch
  from minpro_jax.runtime import multihost, row_layout
  from minpro_jax.runtime.sharding import make_mesh, use_mesh
  from minpro_jax.sampling import PagedKV, Sampler, SamplingParams, engines

  mesh = make_mesh({"data": 2, "fsdp": 2})
  kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
  model = init_model(get_preset("tiny", **kw, head_dim=16), seed=0, mesh=mesh)
  params = nnx.split(model)[1]
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
  sp = SamplingParams(temperature=1.0, max_new_tokens=6)
  rows = row_layout.process_group_rows(4, 2)
  out: dict = {"rows": [rows.start, rows.stop]}
  for name, engine in (
      ("continuous", engines.Continuous(decode_rows=4)),
      ("paged", engines.Paged(decode_rows=4, kv=PagedKV(4))),
      ("static", engines.Static()),
  ):
    sampler = Sampler(model.config, mesh=mesh, engine=engine)
    with use_mesh(mesh):
      whole = sampler.generate(params, prompts, sp, 7, group_size=2, group_ids=[10, 11, 12, 13], policy_version=3)
      mine = sampler.generate(
          params, prompts, sp, 7, group_size=2, group_ids=[10, 11, 12, 13], policy_version=3, own_rows=True
      )
    want = whole.select(rows)
    out[name] = {
        "len": len(mine),
        "shapes": [list(mine.response_tokens.shape), list(mine.prompt_tokens.shape)],
        "equal": all(
            np.array_equal(getattr(mine, f), getattr(want, f))
            for f in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "behavior_logp", "entropy")
            + ("lengths", "finish_reason", "group_ids", "sample_index")
        ),
        "group_ids": mine.group_ids.tolist(),
    }
  n = len(whole)
  batch = RolloutBatch.from_generation(whole, rewards=np.zeros(n, np.float32), advantages=np.zeros(n, np.float32))
  learner = Learner(model, LossConfig(), OptimizerConfig(), micro_batch_size=4, mesh=mesh)
  with use_mesh(mesh):
    global_logp = learner.score(params, batch)
    local_logp = process_inputs.score(learner, params, batch.select(rows), n)
  # packing from per-process rows (`process_packing`): each process packs its mini-batch (4 rows, 2 updates)
  packed = Learner(model, LossConfig(), OptimizerConfig(), micro_batch_size=2, mesh=mesh, row_tokens=70)
  with use_mesh(mesh):
    packed_whole = packed.score(params, batch, chunk_rows=4)
    packed_mine = process_inputs.score(packed, params, batch.select(rows), n, chunk_rows=4)
    staged = process_inputs.for_learner(batch.select(rows), packed, n, 2)
    minis = [jax.tree.map(multihost.to_host, m) for m in process_inputs.mini_batches(staged, 2, mesh)]
    # one mini-batch of 8 rows spans both processes: the rows are gathered and packed whole (the former path)
    spanning = process_inputs.for_learner(batch.select(rows), packed, n, 1)
    spanning_score = process_inputs.score(packed, params, batch.select(rows), n, chunk_rows=8)
    whole_score = packed.score(params, batch, chunk_rows=8)
  host_minis = [packed.update_inputs(mini, 2)[0] for mini in batch.split(2)]
  fields = ("tokens", "segment_ids", "positions", "response_mask", "behavior_logp", "advantages")
  mask = batch.response_mask[rows]
  rng = np.random.default_rng(0)  # routes of 8 rows x 3 tokens x 2 layers x k = 2, some unrecorded
  recorded = rng.integers(0, 4, (8, 3, 2, 2)).astype(np.int16)
  recorded[:, -1] = -1
  own = rng.integers(0, 4, (8, 3, 2, 2)).astype(np.int16)
  return {
      **out,
      "score_shape": list(local_logp.shape),
      "score_max_diff": float(np.abs(np.where(mask, local_logp - global_logp[rows], 0.0)).max()),
      "packed_score_max_diff": float(np.abs(np.where(mask, packed_mine - packed_whole[rows], 0.0)).max()),
      "packed_staged": type(staged).__name__,
      "spanning": [type(spanning).__name__, spanning.size],
      "spanning_score_max_diff": float(np.abs(np.where(mask, spanning_score - whole_score[rows], 0.0)).max()),
      "packed_rows": list(staged.arrays.tokens.shape),
      "packed_equal": all(
          np.array_equal(getattr(m, f), np.asarray(getattr(h, f))) for m, h in zip(minis, host_minis) for f in fields
      ),
      "route_frac": rollout_metrics.route_mismatch_frac(own[rows], recorded[rows], True),
      "route_frac_whole": route_mismatch(own, recorded)[0],
      "addressable": jax.local_device_count(),
  }


def main() -> None:
  mode, out_dir = sys.argv[1], sys.argv[2]
  index = int(os.environ["JAX_PROCESS_ID"])
  if mode == "primitives":
    with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
      json.dump(primitives(out_dir), f)
  elif mode == "process_inputs":
    with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
      json.dump(per_process_batch(out_dir), f)
  elif mode == "sampled_rows":
    with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
      json.dump(sampled_rows(out_dir), f)
  elif mode == "layout":
    with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
      json.dump(layout(out_dir), f)
  elif mode == "fail":
    if index == 1:
      sys.exit(3)
    time.sleep(120)
  elif mode == "sleep":

    def handler(signum, frame):
      del frame
      with open(os.path.join(out_dir, f"process_{index}.signal"), "w") as f:
        f.write(str(signum))
      sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    open(os.path.join(out_dir, f"process_{index}.ready"), "w").close()
    time.sleep(120)
  elif mode == "stubborn":  # a process that cannot act on SIGTERM (as one blocked in a collective)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out_dir, f"process_{index}.ready"), "w").close()
    time.sleep(120)
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main()
