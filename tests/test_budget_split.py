"""The step budget's packed learner programs (`aot/packed.py`) and its overlapped step (`aot/split_step.py`)."""

import numpy as np
import pytest

from minpro_jax.aot.hlo_cost import Cost, HloCost, Node
from minpro_jax.aot.packed import Packed, learner_packing, static_rows, weight_active
from minpro_jax.aot.programs import run_shapes
from minpro_jax.aot.split_step import _steps, sub_slice
from minpro_jax.aot.topologies import parse_slice
from minpro_jax.rl import packing


def test_plan_shape_of_a_hand_case_is_the_plans():
  # first-fit decreasing into rows of 12: 10 -> row 0; 7 -> row 1; 5 -> row 1 (12); 4 -> row 2; 3 -> row 2 (7);
  # 2 -> row 0 (12): 3 rows used; the static count for 6 samples of width 12 in rows of 12 is 6 (2L >= W)
  lengths = np.array([4, 10, 3, 7, 2, 5])
  assert packing.plan_shape(lengths, 12, 12, 2) == (6, 3, 12)
  seg = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int32)
  p = packing.plan(seg, 12, 2)
  assert (p.num_rows, p.used_rows, p.width) == (6, 3, 12)
  # rows of 30 hold the 31 tokens in 2 rows; static: min(6, ceil(2 * 6 * 12 / 30) = 5) -> 6 at micro-batch 2
  assert packing.plan_shape(lengths, 12, 30, 2) == (6, 2, 30)
  assert packing.plan_shape(lengths, 12, 30, 1) == (5, 2, 30)


def _config(**fields):
  from minpro_jax.config_lib import set_fields
  from minpro_jax.config_lib.defaults import get_config

  c = get_config()
  c.prompts_per_step, c.group_size, c.num_updates_per_step, c.micro_batch_size = 4, 2, 2, 2
  c.sampling.max_new_tokens, c.data.max_prompt_tokens = 8, 4
  return set_fields(c, fields)


def test_packed_rows_per_mini_batch_from_the_draw():
  c = _config(**{"learner.row_tokens": 12})
  shapes = run_shapes(c)  # N = 8 samples of L = 12, mini-batches of 4, micro-batches of 2
  assert static_rows(c, shapes) == (4, 8, 12)
  # real tokens (responses + 1 prompt token): 10 8 3 2 | 4 9 1 2
  pk = learner_packing(c, shapes, np.array([9, 7, 2, 1, 3, 8, 0, 1]), prompt_len=1)
  # update, mini-batch 1: 10 -> row 0, 8 -> row 1, 3 -> row 1 (11), 2 -> row 0 (12): 2 rows, 1 of 2 micro-batches;
  # mini-batch 2: 9 -> row 0, 4 -> row 1, 2 -> row 0 (11), 1 -> row 0 (12): 2 rows
  assert pk["update"].used == (2, 2) and pk["update"].active == (1, 1) and pk["update"].active_fraction == 0.5
  # score packs the same mini-batches side by side in one run of 2 x 4 rows: 2 of its 4 micro-batches run
  assert pk["score"].used == (2, 2) and pk["score"].rows == 8 and pk["score"].active == (1, 1)
  assert pk["score"].active_fraction == 0.5 and pk["score"].chunks_per_run == 2
  assert pk["update"].real_tokens == pk["score"].real_tokens == 39
  assert learner_packing(_config(), shapes, np.zeros(8, int), 2) is None and static_rows(_config(), shapes) is None


def test_weight_active_runs_the_micro_batch_branch_for_the_used_rows_only():
  branch = Node("run", "branch", 1.0, "max", Cost(flops=10.0))
  inner = Node("layers", "while", 3.0, "inferred", Cost(flops=1.0))  # a layer scan: not the micro-batch loop
  branch.children.append(inner)
  loop = Node("micro", "while", 4.0, "inferred", Cost(flops=2.0), children=[branch])
  root = Node("entry", "entry", 1.0, "known", Cost(flops=5.0), children=[loop])
  assert root.per_run().flops == 5 + 4 * (2 + 10 + 3)
  p = Packed(rows=8, width=16, micro_batch=2, used=(3, 1), real_tokens=40)  # 2 and 1 of 4 micro-batches
  assert p.micro_batches == 4 and p.active == (2, 1) and p.active_fraction == pytest.approx(1.5 / 4)
  assert weight_active(root, p) == 1
  assert root.per_run().flops == pytest.approx(5 + 4 * (2 + 1.5 / 4 * (10 + 3)))
  assert branch.trip_source == "weight"
  assert p.slot_fraction == pytest.approx(40 / (3 * 2 * 16))


def test_the_overlapped_step_is_transfer_plus_the_longer_side_plus_scoring():
  parts = {
      "sampling": {"seconds_overlapped": 100.0, "seconds_serial": 120.0, "bound_seconds": 50.0},
      "score": {"seconds_overlapped": 10.0, "seconds_serial": 11.0, "bound_seconds": 5.0},
      "update": {"seconds_overlapped": 60.0, "seconds_serial": 70.0, "bound_seconds": 30.0},
  }
  transfer = {"seconds_overlapped": 1.0, "seconds_serial": 1.0, "bound_seconds": 1.0}
  over, seq = _steps(parts, transfer, multi_host=True)
  assert (over["seconds_overlapped"], seq["seconds_overlapped"]) == (111.0, 171.0)
  assert (over["seconds_serial"], seq["seconds_serial"]) == (132.0, 202.0)
  assert over["bound_seconds"] == 56.0 and over["ratio"] == pytest.approx(111 / 56)
  assert "one process" in over["note"]
  parts["update"]["seconds_overlapped"] = 150.0  # the learner is the longer side
  assert _steps(parts, transfer, multi_host=False)[0]["seconds_overlapped"] == 161.0
  parts["score"] = {"fits": False}
  assert _steps(parts, transfer, multi_host=False)[0]["seconds_overlapped"] is None


def test_sub_slices_give_the_sampler_the_last_chips_as_the_trainer_does():
  from minpro_jax.runtime.device_split import split_devices

  sl = parse_slice("cpu:8")
  split = split_devices(6, sl.devices())
  s = sub_slice(sl, split.sampler, "sampler")
  assert [d.id for d in s.devices()] == [2, 3, 4, 5, 6, 7] and s.num_chips == 6 and s.chips_per_host == (6, 1, 1)
  assert s.chip == sl.chip and "sampler: 6 chips" in s.name


@pytest.mark.slow
def test_packed_score_costs_only_the_micro_batches_that_hold_samples(tmp_path):
  from minpro_jax.aot.budget import Budget

  c = _config(**{"learner.row_tokens": 24, "micro_batch_size": 8, "prompts_per_step": 8, "num_updates_per_step": 1})
  b = Budget(c, parse_slice("cpu:8"), "fsdp=8", lengths="const:4", prompt_len=2, parts=("score",),
             dump_hlo=str(tmp_path))  # fmt: skip
  row = {r["part"]: r for r in b.run()}["score"]
  # 16 samples of 6 real tokens: 4 per row of 24 -> 4 rows used of 16, 1 of 2 micro-batches of 8 run
  packed = row["packed"]
  assert (list(packed["used"]), list(packed["active"]), packed["micro_batches"]) == ([4], [1], 2)
  whole = HloCost((tmp_path / "score.hlo.txt").read_text(), 8).total().flops  # every micro-batch
  assert row["per_call"]["flops"] == pytest.approx(whole / 2, rel=0.05)


def test_learner_programs_turn_windowed_einsums_off_on_tpu_only():
  from types import SimpleNamespace

  from minpro_jax.runtime.xla_options import LEARNER_TPU_OPTIONS, learner_compiler_options

  def mesh(platform):
    return SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)] * 4))

  assert learner_compiler_options(mesh("tpu")) == LEARNER_TPU_OPTIONS
  assert not any(LEARNER_TPU_OPTIONS.values())
  assert learner_compiler_options(mesh("cpu")) is None and learner_compiler_options(None) is None
