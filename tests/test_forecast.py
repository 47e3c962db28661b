"""The step forecast's parts by hand: collective times on a slice's links (alpha + beta), per-op floors, which
collectives the HLO serialises, and the trainer's own rules for the score pass and the evaluation."""

import itertools

import numpy as np
import pytest

from minpro_jax.aot.efficiency import TPU, Band, Constants
from minpro_jax.aot.forecast import Forecaster
from minpro_jax.aot.hlo_cost import HloCost
from minpro_jax.aot.links import Links, collective_seconds
from minpro_jax.aot.topologies import Chip, parse_slice

US = 1e-6
LINK = 9e10  # v5p, one link one way (scaling book tpus.md)
BAND = dict(hop_latency=np.array([1 * US]), overhead=np.array([5 * US]), efficiency=np.array([1.0]))


def _v5p(dims):
  """`Links` of a v5p slice of `dims` chips, partition ids in x-fastest order (as the TPU topology lists them)."""
  coords = np.array([c[::-1] for c in itertools.product(*(range(d) for d in dims[::-1]))])
  wrap = all(d % 4 == 0 for d in dims)
  return Links(tuple(dims), (wrap,) * 3, LINK, coords)


def _ids(links, pred):
  return [i for i, c in enumerate(links.coords.tolist()) if pred(*c)]


def test_wraparound_only_on_full_cubes_and_16_axes():
  assert parse_slice("v5p-64").dims == (2, 4, 4) and parse_slice("v5p-64").wraparound == (False,) * 3
  assert parse_slice("v5p-128").wraparound == (True,) * 3  # 4x4x4
  assert parse_slice("v5p-32").wraparound == (False,) * 3  # 2x2x4: no optical switch
  assert parse_slice("v5e-256").wraparound == (True, True)  # 16x16
  assert parse_slice("v6e-32").wraparound == (False, False)  # 4x8
  assert parse_slice("v6e-128").wraparound == (False, True)  # 8x16: the 16 axis closes


def test_all_reduce_of_a_tensor_group_on_2x4x4_and_4x4x4():
  # a tensor=8 group on x in {0, 1}, y in 0..3, z = 0 (what data=4,tensor=8 gives on v5p-64), all-reducing a
  # bf16[128, 4096] (1 MiB): a chip receives 2 R 7/8 over its incoming links, 2 phases of the group's hops
  r = 128 * 4096 * 2
  ici = 2 * r * 7 / 8
  small = _v5p((2, 4, 4))
  group = _ids(small, lambda x, y, z: x < 2 and z == 0)
  assert small.group_axes(group) == [(2, False), (4, False)]  # two lines: 1 link each, 1 + 3 hops
  t = collective_seconds("all-reduce", r, ici, group, small, **BAND)
  assert t[0] == pytest.approx(5 * US + 2 * (1 + 3) * US + ici / (2 * LINK))
  cube = _v5p((4, 4, 4))
  group = _ids(cube, lambda x, y, z: x < 2 and z == 0)
  assert cube.group_axes(group) == [(2, False), (4, True)]  # y closes into a ring on a full cube: 2 links, 2 hops
  t_cube = collective_seconds("all-reduce", r, ici, group, cube, **BAND)
  assert t_cube[0] == pytest.approx(5 * US + 2 * (1 + 2) * US + ici / (3 * LINK))
  assert t_cube[0] < t[0]


def test_all_gather_along_a_whole_axis_with_and_without_wraparound():
  r = 4 * 2**20  # result bytes; a chip receives 3/4 of it from the other 3 chips of the z axis
  for dims, ports, hops in (((2, 4, 4), 1, 3), ((4, 4, 4), 2, 2)):
    links = _v5p(dims)
    group = _ids(links, lambda x, y, z: x == 0 and y == 0)
    t = collective_seconds("all-gather", r, r * 3 / 4, group, links, **BAND)
    assert t[0] == pytest.approx(5 * US + hops * US + r * 3 / 4 / (ports * LINK)), dims
  # bandwidth-bound: no wraparound takes twice the beta term (scaling book tpus.md: "typically doubles the time")
  line, ring = (collective_seconds("all-gather", 2**30, 2**30 * 3 / 4, _ids(links, lambda x, y, z: x == y == 0), links,
                                   hop_latency=np.zeros(1), overhead=np.zeros(1), efficiency=np.ones(1))[0]
                for links in (_v5p((2, 4, 4)), _v5p((4, 4, 4))))  # fmt: skip
  assert line == pytest.approx(2 * ring)


def test_band_levels_and_a_permute_between_neighbours():
  links = _v5p((2, 4, 4))
  t = collective_seconds("collective-permute", 1e6, 1e6, (), links, pair=(0, 1), hop_latency=np.array([1, 1]) * US,
                         overhead=np.array([0, 5]) * US, efficiency=np.array([1.0, 0.5]))  # fmt: skip
  np.testing.assert_allclose(t, [1 * US + 1e6 / LINK, 6 * US + 1e6 / (0.5 * LINK)])
  assert links.distance(0, 1) == 1 and links.distance(0, 31) == 1 + 3 + 3  # corner to corner, no wraparound


# A scheduled module on 8 devices: two matmul fusions with a synchronous all-reduce between them (one chain), two
# tiny fusions beside them, and an all-gather of a parameter that nothing reads before the end.
CHAIN_HLO = """HloModule chain, is_scheduled=true, num_partitions=8

%fused_dot (p0: bf16[128,1024], p1: bf16[1024,1024]) -> bf16[128,1024] {
  %p0 = bf16[128,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[128,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (q0: f32[16], q1: f32[16]) -> f32[16] {
  %q0 = f32[16]{0} parameter(0)
  %q1 = f32[16]{0} parameter(1)
  ROOT %a = f32[16]{0} add(%q0, %q1)
}

%sum (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %z = bf16[] add(%x, %y)
}

ENTRY %main (x: bf16[128,1024], w: bf16[1024,1024], s: f32[16]) -> (bf16[128,1024], f32[16], f32[128]) {
  %x = bf16[128,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0} parameter(1)
  %s = f32[16]{0} parameter(2)
  %m1 = bf16[128,1024]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ar = bf16[128,1024]{1,0} all-reduce(%m1), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%sum
  %m2 = bf16[128,1024]{1,0} fusion(%ar, %w), kind=kOutput, calls=%fused_dot
  %t1 = f32[16]{0} fusion(%s, %s), kind=kLoop, calls=%fused_add
  %t2 = f32[16]{0} fusion(%t1, %s), kind=kLoop, calls=%fused_add
  %ag = f32[128]{0} all-gather(%s), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %out = (bf16[128,1024]{1,0}, f32[16]{0}, f32[128]{0}) tuple(%m2, %t2, %ag)
}
"""

# A loop of 5 iterations whose body runs one tiny fusion and a scalar counter.
LOOP_HLO = """HloModule loop, is_scheduled=true, num_partitions=1

%fused_add (q0: f32[16], q1: f32[16]) -> f32[16] {
  %q0 = f32[16]{0} parameter(0)
  %q1 = f32[16]{0} parameter(1)
  ROOT %a = f32[16]{0} add(%q0, %q1)
}

%body (b: (s32[], f32[16])) -> (s32[], f32[16]) {
  %b = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %v = f32[16]{0} get-tuple-element(%b), index=1
  %v2 = f32[16]{0} fusion(%v, %v), kind=kLoop, calls=%fused_add
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16]{0}) tuple(%i2, %v2)
}

%cond (c: (s32[], f32[16])) -> pred[] {
  %c = (s32[], f32[16]{0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %five = s32[] constant(5)
  ROOT %lt = pred[] compare(%j, %five), direction=LT
}

ENTRY %main (v: f32[16]) -> f32[16] {
  %v = f32[16]{0} parameter(0)
  %z = s32[] constant(0)
  %in = (s32[], f32[16]{0}) tuple(%z, %v)
  %loop = (s32[], f32[16]{0}) while(%in), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[16]{0} get-tuple-element(%loop), index=1
}
"""

ONE = Band(1.0, 1.0, 1.0, "", "test")
FLOOR = np.array([1, 2, 4]) * US
OVERHEAD = np.array([0, 5, 10]) * US
K = Constants(mxu=ONE, attention=ONE, hbm=ONE, matmul_hbm=ONE, paged_attention=ONE,
              op_floor=Band(*FLOOR, "s", "test"), hop_latency=Band(1 * US, 1 * US, 1 * US, "s", "test"),
              collective_overhead=Band(*OVERHEAD, "s", "test"), link_efficiency=ONE, host_scale=ONE)  # fmt: skip
CHIP = Chip("test", 0, 1e12, 1e10, 1, (8, 1, 1), 1, "test", 1e9, 1e9, 2)
LINE8 = Links((8,), (False,), 1e9)  # no coordinates: a group is a line of its chips


def _forecast(text, n):
  return Forecaster(HloCost(text, n), CHIP, LINE8, K).program()


def test_per_op_floor_and_a_loop_by_hand():
  f = _forecast(LOOP_HLO, 1)
  # 5 iterations x (one fusion of 192 bytes, 1.9e-8 s of traffic: the floor; the counter's scalar add, 12 bytes, and
  # the condition's compare, 9 bytes: no kernels, their traffic only)
  np.testing.assert_allclose(f["seconds"], 5 * (FLOOR + (12 + 9) / 1e10))
  np.testing.assert_allclose(f["terms"]["op_floor"], 5 * (FLOOR - 192 / 1e10))
  assert f["ops"] == 5 * 3


def test_a_synchronous_all_reduce_between_matmuls_is_serial():
  f = _forecast(CHAIN_HLO, 8)
  mm = max(2 * 128 * 1024 * 1024 / 1e12, (128 * 1024 * 2 * 2 + 1024 * 1024 * 2) / 1e10)  # compute-bound: 268 us
  ar = OVERHEAD + 2 * 7 * US + 2 * (128 * 1024 * 2) * 7 / 8 / 1e9  # a line of 8: 7 hops per phase, 1 link
  ag = OVERHEAD + 7 * US + 128 * 4 * 7 / 8 / 1e9
  ops = 2 * mm + 2 * FLOOR
  # low: the all-reduce hides behind the two tiny fusions (neither its ancestors nor its descendants), the
  # all-gather behind the matmuls; central and high: the schedule's synchronous collectives block
  expect = ops + np.array([ar[0] - 2 * FLOOR[0], ar[1] + ag[1], ar[2] + ag[2]])
  np.testing.assert_allclose(f["seconds"], expect, rtol=1e-9)
  np.testing.assert_allclose(f["terms"]["collectives"] + f["terms"]["collectives_hidden"], ar + ag, rtol=1e-9)
  assert (f["ops"], f["collectives"]) == (4, 2)


def test_an_async_all_gather_hides_behind_what_is_scheduled_before_its_done():
  text = CHAIN_HLO.replace(
      "  %ag = f32[128]{0} all-gather(%s), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}\n", ""
  ).replace(
      "  %t1 = f32[16]{0} fusion(%s, %s)",
      "  %ags = (f32[16]{0}, f32[128]{0}) all-gather-start(%s), channel_id=2, replica_groups=[1,8]<=[8], "
      "dimensions={0}\n  %t1 = f32[16]{0} fusion(%s, %s)",
  ).replace(
      "  ROOT %out", "  %ag = f32[128]{0} all-gather-done(%ags)\n  ROOT %out"
  )  # fmt: skip
  f = _forecast(text, 8)
  ag = OVERHEAD + 7 * US + 128 * 4 * 7 / 8 / 1e9
  ar = OVERHEAD + 2 * 7 * US + 2 * (128 * 1024 * 2) * 7 / 8 / 1e9
  hidden = np.minimum(ag, 2 * FLOOR)  # t1 and t2 run between its start and its done
  np.testing.assert_allclose(f["terms"]["collectives"][1:], (ar + ag - hidden)[1:], rtol=1e-9)


def test_tpu_constants_carry_a_source_and_order_their_levels():
  for name, band in TPU.as_dict().items():
    assert band["source"], name
    values = [band["low"], band["central"], band["high"]]
    shares = band["unit"].startswith("of ")  # an efficiency: the low time takes the highest share
    assert values == sorted(values, reverse=shares), name


def test_score_and_eval_follow_the_trainer():
  from minpro_jax.aot.step_rows import eval_calls, eval_sampling, score_every
  from minpro_jax.config_lib.paper import paper_config

  c = paper_config("qwen3-8b", "x", "minpro,2", mesh="fsdp=-1")
  assert score_every(c) == 10  # MinPRO reads behavior_logp: the score pass only for the mismatch metrics
  c.loss.rollout_is = "token"
  assert score_every(c) == 1  # TIS reads learner_logp: every step
  assert eval_calls(c) == (16 * 16, 63)  # 16 prompts x n=16 per call, ceil(1000 / 16) calls
  sp = eval_sampling(c)
  assert (sp.temperature, sp.top_p, sp.max_new_tokens) == (0.7, 0.95, 20480)


# XLA:TPU prefetches a weight into VMEM in async slices, joins them with a ConcatBitcast and multiplies by it: the
# weight's HBM bytes are read once, counted where the dot reads them.
SLICED_HLO = """HloModule sliced, num_partitions=1

%fused_dot (p0: bf16[8,256], p1: bf16[256,128]) -> bf16[8,128] {
  %p0 = bf16[8,256]{1,0} parameter(0)
  %p1 = bf16[256,128]{1,0} parameter(1)
  ROOT %d = bf16[8,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[8,256], w: bf16[256,128]) -> bf16[8,128] {
  %x = bf16[8,256]{1,0} parameter(0)
  %w = bf16[256,128]{1,0} parameter(1)
  %s0 = ((bf16[256,128]{1,0}), bf16[128,128]{1,0:S(1)}, s32[]) slice-start(%w), slice={[0:128], [0:128]}
  %s1 = ((bf16[256,128]{1,0}), bf16[128,128]{1,0:S(1)}, s32[]) slice-start(%w), slice={[128:256], [0:128]}
  %d0 = bf16[128,128]{1,0:S(1)} slice-done(%s0)
  %d1 = bf16[128,128]{1,0:S(1)} slice-done(%s1)
  %cat = bf16[256,128]{1,0:S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
  ROOT %y = bf16[8,128]{1,0} fusion(%x, %cat), kind=kOutput, calls=%fused_dot
}
"""


def test_async_weight_slices_are_read_once():
  total = HloCost(SLICED_HLO, 1).total()
  assert total.hbm_bytes == 8 * 256 * 2 + 256 * 128 * 2 + 8 * 128 * 2  # x and w read, y written: nothing else
  assert total.flops == 2 * 8 * 128 * 256


def test_mean_schedule_of_several_calls():
  from minpro_jax.aot.paged_schedule import paged_schedule
  from minpro_jax.aot.step_rows import mean_schedule

  kw = dict(rows=4, refill_rows=4, prompt_len=3, max_new_tokens=8, page_size=2, num_pages=64)
  a, b = paged_schedule([8, 2, 5, 1], **kw), paged_schedule([3, 3, 3, 3], **kw)
  m = mean_schedule([a, b])
  assert m.decode_steps == (a.decode_steps + b.decode_steps) / 2 == (7 + 2) / 2  # each call to its longest row
  assert m.iterations == (a.iterations + b.iterations) / 2
  assert m.kv_pages_read == (a.kv_pages_read + b.kv_pages_read) / 2 and m.peak_pages == max(a.peak_pages, b.peak_pages)
  assert (m.page_size, m.num_pages) == (2, 64)


# A remat policy's offload: an activation written into a host-memory (S(5)) stack of 4 layers, async.
OFFLOAD_HLO = """HloModule offload, is_scheduled=true, num_partitions=1

ENTRY %main (h: bf16[4,1024,512], x: bf16[1,1024,512], i: s32[]) -> bf16[4,1024,512] {
  %h = bf16[4,1024,512]{2,1,0:S(5)} parameter(0)
  %x = bf16[1,1024,512]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %s = ((bf16[4,1024,512]{2,1,0:S(5)}, bf16[1,1024,512]{2,1,0}, s32[]), bf16[4,1024,512]{2,1,0:S(5)}, u32[]) dynamic-update-slice-start(%h, %x, %i, %z, %z)
  ROOT %d = bf16[4,1024,512]{2,1,0:S(5)} dynamic-update-slice-done(%s)
}
"""


def test_an_offloaded_activation_moves_over_the_host_link_once():
  update = 1024 * 512 * 2
  assert HloCost(OFFLOAD_HLO, 1).total().hbm_bytes == update  # read once from HBM, not the host stack
  chip = Chip("test", 0, 1e12, 1e10, 1, (8, 1, 1), 1, "test", 1e9, 1e9, 2, host_bytes_per_s=1e8)
  f = Forecaster(HloCost(OFFLOAD_HLO, 1), chip, LINE8, K).program()
  np.testing.assert_allclose(f["terms"]["host_transfers"], update / 1e8)  # nothing to hide behind: exposed


def test_a_collective_wrapped_in_async_collective_start_hides_like_an_async_pair():
  # XLA:TPU's async collective fusion: the all-gather's result goes into an AsyncCollectiveStart custom call, and
  # an AsyncCollectiveDone ends it; t1 and t2 run between the two
  text = CHAIN_HLO.replace(
      "  %ag = f32[128]{0} all-gather(%s), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}\n", ""
  ).replace(
      "  %t1 = f32[16]{0} fusion(%s, %s)",
      "  %ag0 = f32[128]{0} all-gather(%s), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}\n"
      '  %acs = (f32[128]{0}, u32[]) custom-call(%ag0), custom_call_target="AsyncCollectiveStart"\n'
      "  %t1 = f32[16]{0} fusion(%s, %s)",
  ).replace(
      "  ROOT %out",
      '  %ag = f32[128]{0} custom-call(%acs), custom_call_target="AsyncCollectiveDone"\n  ROOT %out',
  )  # fmt: skip
  f = _forecast(text, 8)
  ag = OVERHEAD + 7 * US + 128 * 4 * 7 / 8 / 1e9
  ar = OVERHEAD + 2 * 7 * US + 2 * (128 * 1024 * 2) * 7 / 8 / 1e9
  hidden = np.minimum(ag, 2 * FLOOR)
  np.testing.assert_allclose(f["terms"]["collectives"][1:], (ar + ag - hidden)[1:], rtol=1e-9)
