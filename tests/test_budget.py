"""The step budget (`python -m minpro_jax.aot --budget`): HLO loop costs, the sampler's schedule, the bound."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minpro_jax.aot.hlo_cost import HloCost, Rates, replica_group_ids
from minpro_jax.aot.hlo_text import parse_hlo
from minpro_jax.aot.lengths import draw_lengths
from minpro_jax.aot.schedule import (
    continuous_schedule,
    kv_tokens_read,
    learning_flops,
    sampling_bound,
    static_schedule,
)
from minpro_jax.errors import ConfigError
from minpro_jax.models.attention_core import live_length_buckets

# An outer while (no trip count: data-dependent) whose body runs an inner scan of 3 steps; the scan's body
# all-gathers a f32[16,64] layer into a f32[64,64] weight (16 KiB) over groups of 4 of 8 devices and multiplies by it.
NESTED_HLO = """HloModule nested, num_partitions=8

%fused_dot (p0: f32[16,64], p1: f32[64,64]) -> f32[16,64] {
  %p0 = f32[16,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (q0: f32[3,16,64], q1: s32[]) -> f32[16,64] {
  %q0 = f32[3,16,64]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,16,64]{2,1,0} dynamic-slice(%q0, %q1, %c0, %c0), dynamic_slice_sizes={1,16,64}
  ROOT %bc = f32[16,64]{1,0} bitcast(%ds)
}

%inner_body (ib: (s32[], f32[16,64], f32[3,16,64])) -> (s32[], f32[16,64], f32[3,16,64]) {
  %ib = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%ib), index=0
  %x = f32[16,64]{1,0} get-tuple-element(%ib), index=1
  %w = f32[3,16,64]{2,1,0} get-tuple-element(%ib), index=2
  %wl = f32[16,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %ag = f32[64,64]{1,0} all-gather(%wl), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %y = f32[16,64]{1,0} fusion(%x, %ag), kind=kOutput, calls=%fused_dot
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%i2, %y, %w)
}

%inner_cond (ic: (s32[], f32[16,64], f32[3,16,64])) -> pred[] {
  %ic = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  %j = s32[] get-tuple-element(%ic), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

%outer_body (ob: (s32[], f32[16,64], f32[3,16,64])) -> (s32[], f32[16,64], f32[3,16,64]) {
  %ob = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  %k = s32[] get-tuple-element(%ob), index=0
  %xo = f32[16,64]{1,0} get-tuple-element(%ob), index=1
  %wo = f32[3,16,64]{2,1,0} get-tuple-element(%ob), index=2
  %zero = s32[] constant(0)
  %init = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%zero, %xo, %wo)
  %scan = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %xs = f32[16,64]{1,0} get-tuple-element(%scan), index=1
  %one.2 = s32[] constant(1)
  %k2 = s32[] add(%k, %one.2)
  ROOT %t2 = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%k2, %xs, %wo)
}

%outer_cond (oc: (s32[], f32[16,64], f32[3,16,64])) -> pred[] {
  %oc = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) parameter(0)
  %x0 = f32[16,64]{1,0} get-tuple-element(%oc), index=1
  %never = pred[] constant(true)
  ROOT %r = pred[] and(%never, %never)
}

ENTRY %main (a: f32[16,64], b: f32[3,16,64]) -> f32[16,64] {
  %a = f32[16,64]{1,0} parameter(0)
  %b = f32[3,16,64]{2,1,0} parameter(1)
  %z = s32[] constant(0)
  %in = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) tuple(%z, %a, %b)
  %loop = (s32[], f32[16,64]{1,0}, f32[3,16,64]{2,1,0}) while(%in), condition=%outer_cond, body=%outer_body
  ROOT %out = f32[16,64]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_nested_loop_costs_follow_the_trip_counts():
  seen = []

  def trips(ins, path):
    seen.append((ins.name, tuple(path)))
    return 7  # the outer loop's data-dependent count

  h = HloCost(NESTED_HLO, 8, {"data": 2, "fsdp": 4}, while_trips=trips)
  assert seen == [("loop", ())]  # only the unannotated loop asks; the scan's count is XLA's
  outer, inner = h.loops()
  assert (outer["name"], outer["trips"], outer["trip_source"], outer["total_trips"]) == ("loop", 7, "given", 7)
  assert (inner["name"], inner["trips"], inner["trip_source"], inner["total_trips"]) == ("scan", 3, "known", 21)
  gather = inner["per_iteration"]["collectives"]["all-gather"]
  # [2,4]<=[8]: groups {0..3}, {4..7}: 4 devices along fsdp; a chip receives 3/4 of the 64x64 f32 result
  assert gather == {"count": 1, "bytes": 64 * 64 * 4, "ici_bytes": 64 * 64 * 4 * 3 / 4, "axes": ["fsdp"]}
  assert inner["per_iteration"]["flops"] == 2 * 16 * 64 * 64
  # the slice fusion reads one layer (4 KiB, not the stacked 12 KiB weight) and its 4 B index and writes 4 KiB;
  # the dot reads x and the gathered weight and writes y; the add reads 2 x 4 B and writes 4 B; the loop's
  # condition compares two s32 into a pred
  assert inner["per_iteration"]["hbm_bytes"] == (4096 + 4 + 4096) + (4096 + 16384 + 4096) + 12 + 9
  assert outer["per_iteration"]["collectives"]["all-gather"]["count"] == 3
  total = h.total()
  assert total.collectives["all-gather"]["count"] == 21
  assert total.flops == 21 * 2 * 16 * 64 * 64
  assert total.ici_bytes == pytest.approx(21 * 64 * 64 * 4 * 3 / 4)


def test_times_of_an_iteration_serial_and_overlapped():
  rates = Rates(peak_flops=1e9, hbm_bandwidth=1e8, ici_bandwidth=1e6)
  h = HloCost(NESTED_HLO, 8, None, rates, while_trips=lambda ins, path: 7)
  inner = h.loops()[1]
  # each computation of an iteration (the body, then the condition) takes its own roofline time
  serial = overlapped = 0.0
  for name in ("inner_body", "inner_cond"):
    c = h.own_cost(name)
    compute, memory, ici = c.flops / 1e9, c.hbm_bytes / 1e8, c.ici_bytes / 1e6
    serial += max(compute, memory) + ici
    overlapped += max(compute, memory, ici)
  assert inner["seconds_per_iteration"]["serial"] == pytest.approx(serial)
  assert inner["seconds_per_iteration"]["overlapped"] == pytest.approx(overlapped)
  assert serial > overlapped
  assert inner["seconds_per_iteration"]["limiter"] == "ici"
  assert h.seconds(overlapped=False) > h.seconds(overlapped=True) > 0


def test_replica_groups_in_all_three_spellings():
  explicit = replica_group_ids("{{0,2},{1,3}}", 4)
  np.testing.assert_array_equal(explicit, [[0, 2], [1, 3]])
  iota = replica_group_ids("[2,2]<=[2,2]T(1,0)", 4)
  np.testing.assert_array_equal(iota, [[0, 2], [1, 3]])
  mesh = replica_group_ids("mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", 4)
  np.testing.assert_array_equal(mesh, [[0, 2], [1, 3]])
  np.testing.assert_array_equal(replica_group_ids("{}", 3), [[0, 1, 2]])


def test_scan_flops_scale_where_cost_analysis_counts_the_body_once():
  w = jnp.ones((10, 32, 32))

  def f(x, w):
    return jax.lax.scan(lambda x, wl: (jnp.tanh(x @ wl), None), x, w)[0]

  compiled = jax.jit(f).lower(jnp.ones((8, 32)), w).compile()
  ours = HloCost(compiled.as_text(), 1).total().flops
  assert ours == 10 * 2 * 8 * 32 * 32
  # XLA's own figure is one body's (the reason this module exists)
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  assert ca["flops"] < ours / 5


def test_parse_keeps_tuple_shapes_and_entry():
  comps = parse_hlo(NESTED_HLO)
  assert [c.name for c in comps.values() if c.entry] == ["main"]
  assert comps["outer_body"].by_name["scan"].opcode == "while"
  assert comps["outer_body"].by_name["scan"].shape.startswith("(s32[]")


KERNEL_HLO = """
HloModule m

ENTRY %main (q: bf16[16,8,128], pages: bf16[2,1024,128,128]) -> bf16[16,8,128] {
  %q = bf16[16,8,128]{2,1,0} parameter(0)
  %pages = bf16[2,1024,128,128]{3,2,1,0} parameter(1)
  %splash.1 = bf16[16,8,128]{2,1,0} custom-call(%q, %pages), custom_call_target="tpu_custom_call"
  ROOT %paged_attention.3 = bf16[16,8,128]{2,1,0} custom-call(%splash.1, %pages, %pages), custom_call_target="tpu_custom_call"
}
"""


def test_a_paged_attention_kernel_counts_its_result_not_the_pool():
  """A Pallas kernel counts its operands and result, except jax's paged attention kernels (`DMA_KERNELS`), which
  DMA only the pages they read: only their result (the budget adds the pages analytically)."""
  q, pool = 16 * 8 * 128 * 2, 2 * 1024 * 128 * 128 * 2
  assert HloCost(KERNEL_HLO, 1).total().hbm_bytes == (q + pool + q) + q


# ------------------------------------------------------------------------------------------- schedule
def _naive_continuous(lengths, rows, refill, p_len, buckets):
  """The continuous sampler's loop, one iteration at a time, as `decode_with_refills` / `decode_step` run it."""
  n = len(lengths)
  done, step, req = [True] * rows, [0] * rows, [n] * rows
  nxt = decode = refills = 0
  hist = [0] * len(buckets)
  while nxt < n or not all(done):
    waiting = n - nxt
    n_done = sum(done)
    if waiting > 0 and n_done >= min(refill, waiting):
      count = min(n_done, refill, waiting)
      free = [b for b in range(rows) if done[b]][:count]
      for b in free:
        req[b], step[b] = nxt, 1  # the refill samples index 0
        done[b] = lengths[nxt] == 1
        nxt += 1
      refills += 1
      continue
    live = [b for b in range(rows) if not done[b]]
    live_len = p_len + max(step[b] for b in live)
    hist[next(i for i, x in enumerate(buckets) if x >= live_len or i == len(buckets) - 1)] += 1
    for b in live:  # samples index step[b]
      step[b] += 1
      done[b] = step[b] >= lengths[req[b]]
    decode += 1
  return decode, refills, hist


@pytest.mark.parametrize("rows,refill", [(8, 1), (8, 3), (16, 2), (4, 4)])
def test_continuous_schedule_equals_the_loop_one_iteration_at_a_time(rows, refill):
  rng = np.random.default_rng(rows * 10 + refill)
  lengths = rng.integers(1, 40, size=37)
  buckets = live_length_buckets(16 + 40, min_slots=8)
  sched = continuous_schedule(lengths, rows, refill, 16, buckets)
  decode, refills, hist = _naive_continuous(list(lengths), rows, refill, 16, buckets)
  assert (sched.decode_steps, sched.refills, list(sched.bucket_steps)) == (decode, refills, hist)
  assert sched.iterations == decode + refills


def test_static_schedule_runs_to_the_longest_row():
  s = static_schedule([3, 9, 1], 4, (8, 16))
  assert (s.decode_steps, s.refills, s.bucket_steps) == (8, 1, (0, 8))


def test_bound_of_a_three_row_draw_by_hand():
  lengths, p = np.array([3, 1, 5]), 2
  # tokens in the cache when a row samples index t = 1 .. L - 1: p + t
  assert kv_tokens_read(lengths, p) == (3 + 4) + 0 + (3 + 4 + 5 + 6)
  b = sampling_bound(
      lengths, p, kv_bytes_per_token=10.0, weight_bytes=800.0, chips=2, resident_chips=4, hbm_bandwidth=100.0
  )
  assert b["kv"] == pytest.approx(25 * 10.0 / (2 * 100.0))
  assert b["weights"] == pytest.approx((5 - 1) * 800.0 / 4 / 100.0)
  assert b["total"] == pytest.approx(b["kv"] + b["weights"])
  # learning: T = p + L tokens each: T * 2 * params + attn * T (T + 1) / 2
  t = np.array([5.0, 3.0, 7.0])
  want = float(np.sum(t * 2 * 100 + 6 * t * (t + 1) / 2))
  assert learning_flops(lengths, p, matmul_params=100, attn_flops_per_ctx=6) == pytest.approx(want)


def test_length_models(tmp_path):
  g, what = draw_lengths("gamma:mean=100", 4000, 150, seed=3)
  assert g.min() >= 1 and g.max() == 150 and 80 < g.mean() < 100  # the clip at 150 lowers the mean
  assert "gamma" in what
  np.testing.assert_array_equal(draw_lengths("gamma:mean=100", 50, 150, seed=3)[0], g[:50])
  np.testing.assert_array_equal(draw_lengths("const:20", 3, 16, 0)[0], [16, 16, 16])
  listed = tmp_path / "l.json"
  listed.write_text("[5, 7, 9]")
  np.testing.assert_array_equal(draw_lengths(str(listed), 3, 100, 0)[0], [5, 7, 9])
  metrics = tmp_path / "metrics.jsonl"
  rows = [{"step": 0, "response/length_mean": 50.0}, {"step": 1, "response/length_quantiles": [10] * 5 + [20] * 6}]
  metrics.write_text("\n".join(json.dumps(r) for r in rows))
  drawn, what = draw_lengths(str(metrics), 1000, 100, 0)
  assert 10 <= drawn.min() and drawn.max() <= 20 and "step 1" in what
  for bad in ("gamma:mean=-1", "gamma:mu=3", "const:0", "poisson:3", str(tmp_path / "missing.json")):
    with pytest.raises(ConfigError, match="--lengths"):
      draw_lengths(bad, 3, 100, 0)


# ----------------------------------------------------------------------------------- the whole budget
def _small(**fields):
  from minpro_jax.config_lib import set_fields
  from minpro_jax.config_lib.defaults import get_config

  c = get_config()
  c.prompts_per_step, c.group_size, c.num_updates_per_step, c.micro_batch_size = 8, 2, 1, 16
  c.sampling.max_new_tokens, c.data.max_prompt_tokens = 8, 16
  return set_fields(c, fields)


def _budget_rows(mesh, parts=("sampling",), **fields):
  from minpro_jax.aot.budget import Budget
  from minpro_jax.aot.topologies import parse_slice

  b = Budget(_small(**fields), parse_slice("cpu:8"), mesh, lengths="gamma:mean=5", prompt_len=6, parts=parts)
  return b, {r["part"]: r for r in b.run()}


def test_continuous_decode_gathers_weights_every_step_on_fsdp_and_not_on_data():
  dense = {"sampling.kv_cache": "dense"}  # the dense continuous sampler's schedule (the paged one's: below)
  b, rows = _budget_rows("fsdp=8", **dense)
  rows_count, refill = b.progs.trainer_sampler.engine.rows_and_refill(16)
  sched = continuous_schedule(b.lengths, rows_count, refill, 16, b.buckets)
  assert rows["sampling"]["iterations"] == sched.iterations
  assert rows["sampling: decode step"]["iterations"] == sched.decode_steps
  assert rows["sampling: refill"]["iterations"] == sched.refills
  from minpro_jax.aot.budget import param_bytes

  weights = param_bytes(b.progs.prepared_params())
  gathers = rows["sampling: decode step"]["per_iteration"]["collectives"].get("all-gather", {})
  assert gathers.get("count", 0) >= b.cfg.num_layers and "fsdp" in gathers["axes"]
  assert gathers["bytes"] >= 0.9 * weights  # every weight matrix is gathered at every decode step
  _, rows = _budget_rows("data=8", **dense)
  gathers = rows["sampling: decode step"]["per_iteration"]["collectives"].get("all-gather", {"bytes": 0})
  assert gathers["bytes"] < 0.05 * weights  # activations only (each device holds every weight)


def test_paged_sampler_budget_replays_the_pool_and_adds_the_attention_reads():
  from minpro_jax.aot.paged_schedule import page_bytes_per_device, sampler_paged_schedule

  b, rows = _budget_rows("fsdp=8", **{"sampling.kv_cache": "paged", "sampling.page_size": 4})
  s = b.progs.trainer_sampler
  sched = sampler_paged_schedule(s, b.lengths, 16, 6, 16, 8, 2)
  # 16 rows on fsdp=8: 8 row groups of 2 rows, refills of 1 row a group, so units of 1 (`share_unit`)
  assert (sched.groups, sched.unit, sched.num_pages) == (8, 1, 2 * 6) and sched.decode_steps > 0
  assert rows["sampling"]["iterations"] == sched.iterations
  assert rows["sampling: decode step"]["iterations"] == sched.decode_steps
  kv = rows["sampling"]["analytic_kv"]
  cfg = s.config  # K heads of head_dim, bf16 or fp32 pages, one device holds every head on fsdp=8
  page = 4 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize
  assert page_bytes_per_device(cfg, 4, s.mesh, s.rules) == page
  assert kv["bytes_per_device"] == sched.kv_pages_read * page and kv["seconds"] is None  # cpu: no bandwidth


def test_inflight_sampler_budget_replays_the_streaming_pool():
  """`staleness.mode=inflight`: the sampling part's trip counts are the streaming pool's steady state, replayed over
  the step's draw and 7 more (issue 59), on the dense continuous sampler the mode runs."""
  from minpro_jax.aot import budget
  from minpro_jax.aot.lengths import draw_lengths
  from minpro_jax.aot.schedule import learning_flops
  from minpro_jax.aot.stream_schedule import steady_schedule, streaming_schedule

  ov = {"staleness.mode": "inflight", "staleness.inflight_every": 3, "staleness.inflight_kv": "recompute", "delay": 1}
  b, rows = _budget_rows("fsdp=8", parts=("sampling", "score"), **ov)
  assert b.progs.trainer_sampler.engine.name == "continuous"  # "auto" is the dense cache in this mode
  rows_count, refill = b.progs.trainer_sampler.engine.rows_and_refill(16)
  draws = [b.lengths] + [draw_lengths("gamma:mean=5", 16, 8, 1000 + i)[0] for i in range(7)]
  steps = streaming_schedule(draws, rows_count, refill, 3, 1, 16, b.buckets)
  want = steady_schedule(steps, 2, b.buckets)
  assert rows["sampling: decode step"]["iterations"] == pytest.approx(want.decode_steps)
  assert rows["sampling: refill"]["iterations"] == pytest.approx(want.refills)
  delay = continuous_schedule(b.lengths, rows_count, refill, 16, b.buckets)
  assert want.decode_steps != delay.decode_steps  # the replay, not one delay-mode call
  # the swap's recompute: the score pass's cost scaled by the live rows' forward FLOPs over the score's
  rec, score = rows["recompute (in flight)"], next(r for name, r in rows.items() if name.startswith("score"))
  drawn = [x for s in steps[2:] for x in s.live_lengths_at_swap]
  assert drawn and rec["detail"]["live_rows_at_swap"] == pytest.approx(len(drawn) / 6)
  mm = {"matmul_params": budget._matmul_params(b.cfg), "attn_flops_per_ctx": budget._attn_per_ctx(b.cfg)}
  flops = learning_flops(np.asarray(drawn), b.prompt_len, **mm) / 6
  assert rec["detail"]["forward_flops"] == pytest.approx(flops)
  fwd = learning_flops(b.lengths, b.prompt_len, **mm)
  calls = 1.0 / b.c.log.mismatch_every
  assert rec["seconds_overlapped"] == pytest.approx(score["seconds_overlapped"] * flops / fwd / calls)


def test_static_sampler_budget_runs_prefill_then_decode_to_the_longest_row():
  b, rows = _budget_rows("fsdp=8", **{"sampling.continuous": False})
  assert rows["sampling: prefill"]["iterations"] == 1
  assert rows["sampling: decode"]["iterations"] == int(b.lengths.max()) - 1
  decode_loop = rows["sampling: decode"]["loops"][0]
  assert (decode_loop["trips"], decode_loop["trip_source"]) == (int(b.lengths.max()) - 1, "given")


def test_budget_refuses_bad_parts_and_prompt_lengths():
  from minpro_jax.aot.budget import Budget
  from minpro_jax.aot.topologies import parse_slice

  for kw in ({"parts": ("sampling", "warmup")}, {"prompt_len": 0}, {"prompt_len": 17}):
    with pytest.raises(ConfigError, match="--parts|--prompt-len"):
      Budget(_small(), parse_slice("cpu:8"), "fsdp=8", lengths="const:4", **kw)


_TPU_BUDGET = """
import json, subprocess, sys, tempfile, os
out = os.path.join(tempfile.mkdtemp(), "b.json")
cmd = [sys.executable, "-m", "minpro_jax.aot", "--budget", "--topology=v5e-4", "--mesh=fsdp=4",
       "--lengths=gamma:mean=5", "--prompt-len=6", f"--out={out}",
       "--config.prompts_per_step=8", "--config.group_size=2", "--config.num_updates_per_step=1",
       "--config.micro_batch_size=16", "--config.sampling.max_new_tokens=8", "--config.data.max_prompt_tokens=16"]
proc = subprocess.run(cmd, capture_output=True, text=True)
assert proc.returncode == 0, proc.stderr[-3000:]
print(proc.stdout)
for r in json.load(open(out))["rows"]:
  f = ((r.get("forecast") or {}).get("seconds") or {}).get("central")
  print(f"RESULT part={r['part'].replace(' ', '_')} seconds={r.get('seconds_overlapped')} bound={r.get('bound_seconds')} "
        f"forecast={f}")
"""


@pytest.mark.slow
@pytest.mark.xdist_group("budget_tpu")
def test_the_tiny_budget_on_v5e_4_prints_every_part():
  from tests.tpu_helpers import run_with_libtpu

  rows = {r["part"]: r for r in run_with_libtpu(_TPU_BUDGET, timeout=900)}
  for part in ("sampling", "transfer", "score", "update", "step"):
    assert float(rows[part]["seconds"]) > 0, rows[part]
    assert float(rows[part]["bound"]) > 0, rows[part]
  assert any(p.startswith("eval") for p in rows)
  assert float(rows["step"]["seconds"]) >= float(rows["step"]["bound"])
  # the forecast: every part and the step, above the bound (per-op floors and collective latencies on top)
  for part in ("sampling", "transfer", "score", "update", "step"):
    assert float(rows[part]["forecast"]) > 0, rows[part]
  assert float(rows["step"]["forecast"]) >= float(rows["step"]["bound"])
