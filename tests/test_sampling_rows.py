"""`sampling.decode_rows = "auto"` (minpro_jax/sampling/rows.py): the memory model against hand arithmetic, the
sampler's per-device bytes on its layout, and the config field's int / "auto" forms."""

import math

import jax
import pytest

from minpro_jax.config_lib import defaults
from minpro_jax.errors import ConfigError, UserError
from minpro_jax.models.config import ModelConfig
from minpro_jax.run import run_config, sampler_setup
from minpro_jax.runtime.inference_mesh import INFERENCE_RULES, inference_mesh
from minpro_jax.sampling.rows import (
    CACHE_COPIES,
    CPU_ROWS,
    auto_decode_rows,
    device_hbm_bytes,
    resolve_decode_rows,
    sampler_memory,
)
from minpro_jax.sampling.sampler import DEFAULT_BATCH_BUCKETS

GIB = 2**30
CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


def test_auto_rows_by_hand():
  kw = dict(batch_buckets=DEFAULT_BATCH_BUCKETS, headroom=0.1)
  # 100 GiB, 90 usable, 10 resident -> 80 GiB / 3 GiB = 26 rows per group, x 4 groups = 104 -> bucket 64
  assert (
      auto_decode_rows(hbm_bytes=100 * GIB, resident_bytes=10 * GIB, kv_bytes_per_row=3 * GIB, data_groups=4, **kw)
      == 64
  )
  # 80 GiB / 0.05 GiB = 1600 per group, x 1 -> beyond the top bucket (512): a multiple of it, 1536
  assert (
      auto_decode_rows(hbm_bytes=100 * GIB, resident_bytes=10 * GIB, kv_bytes_per_row=GIB / 20, data_groups=1, **kw)
      == 1536
  )
  # exactly one row per group, one group -> 1
  assert (
      auto_decode_rows(hbm_bytes=10 * GIB, resident_bytes=6 * GIB, kv_bytes_per_row=3 * GIB, data_groups=1, **kw) == 1
  )
  # 9 - 6 = 3 rows per group x 2 groups = 6 -> bucket 4; no headroom: 4 GiB / 1 GiB = 4 per group x 2 = 8
  assert auto_decode_rows(hbm_bytes=10 * GIB, resident_bytes=6 * GIB, kv_bytes_per_row=GIB, data_groups=2, **kw) == 4
  kw["headroom"] = 0.0
  assert auto_decode_rows(hbm_bytes=10 * GIB, resident_bytes=6 * GIB, kv_bytes_per_row=GIB, data_groups=2, **kw) == 8


def test_auto_rows_refuses_when_nothing_fits():
  kw = dict(batch_buckets=DEFAULT_BATCH_BUCKETS, data_groups=8)
  with pytest.raises(ConfigError, match=r"^config\.sampling\.decode_rows: 'auto' fits no decode row"):
    auto_decode_rows(hbm_bytes=95 * GIB, resident_bytes=84 * GIB, kv_bytes_per_row=3 * GIB, **kw)  # 1.5 GiB left
  with pytest.raises(ConfigError, match=r"^config\.sampling\.decode_rows:"):
    auto_decode_rows(hbm_bytes=16 * GIB, resident_bytes=20 * GIB, kv_bytes_per_row=GIB, **kw)  # weights alone too big


def test_sampler_memory_by_hand():
  slots = 24
  kv = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * slots * 4  # K and V, fp32
  seg = slots * 4  # int32 segment ids
  one = sampler_memory(CFG, "fp32", slots)
  params = 2 * 64 * 32 + CFG.num_layers * (  # embedding, LM head (untied)
      32 * 8 * (4 + 2 + 2 + 4) + 3 * 32 * 64
  )  # q, k, v, o and the MLP
  assert one["kv_bytes_per_row"] == kv + seg and one["data_groups"] == 1
  assert params * 4 <= one["weight_bytes"] < params * 4 + 1024  # plus the norms' few scales
  half = sampler_memory(CFG, "bf16", slots)
  assert half["kv_bytes_per_row"] == kv // 2 + seg  # bf16 K / V
  mesh = inference_mesh({"data": 4, "tensor": 2}, jax.devices()[:8])
  laid = sampler_memory(CFG, "fp32", slots, mesh, INFERENCE_RULES)
  # KV heads (2) split over tensor (2), rows over data (4); weights split over tensor, replicated over data
  assert laid["kv_bytes_per_row"] == kv // 2 + seg and laid["data_groups"] == 4
  assert one["weight_bytes"] / 2 <= laid["weight_bytes"] < one["weight_bytes"] / 2 + 1024


def test_resolve_decode_rows():
  kw = dict(precision="fp32", slots=24)
  assert resolve_decode_rows(16, CFG, hbm_bytes=GIB, **kw) == 16  # an int stays
  assert resolve_decode_rows("auto", CFG, hbm_bytes=None, **kw) == CPU_ROWS == 64  # no HBM figure (CPU)
  mem = sampler_memory(CFG, "fp32", 24)
  hbm = (mem["weight_bytes"] + 1000 + 37.5 * mem["kv_bytes_per_row"]) / 0.9  # 37 rows held once -> bucket 32
  assert CACHE_COPIES == 1
  assert resolve_decode_rows("auto", CFG, hbm_bytes=hbm, other_resident_bytes=1000, **kw) == 32
  assert device_hbm_bytes(jax.devices("cpu")[:1]) is None


def test_the_config_field_takes_an_int_or_auto():
  from minpro_jax.config_lib.parse import parse_config

  base = ["t", "--config=configs/default.py"]
  assert parse_config([*base, "--config.sampling.decode_rows=auto"]).sampling.decode_rows == "auto"
  assert parse_config([*base, "--config.sampling.decode_rows=128"]).sampling.decode_rows == 128
  c = defaults.get_config()
  assert c.sampling.decode_rows == 64
  c.sampling.decode_rows = "auto"
  assert sampler_setup.sampler_decode_rows(c) == "auto"
  c.sampling.decode_rows = "many"
  with pytest.raises(ConfigError, match=r"^config\.sampling\.decode_rows: must be an int >= 1 .* or 'auto'"):
    run_config.validate_shapes_config(c)
  assert issubclass(ConfigError, UserError)


def test_auto_rows_fill_a_v5p_chip_beside_qwen3_8b():
  """The paper setting (Qwen3-8B, bf16, 2,048 + 20,480 slots) on a v5p-64 with the sampler's auto layout
  (data=8 x tensor=4) and the learner's fp32 parameters + AdamW moments fsdp-sharded over 32 chips."""
  from minpro_jax.models.config import get_preset

  cfg = get_preset("qwen3-8b")
  slots = 2048 + 20480
  mem = sampler_memory(cfg, "bf16", slots)  # one device: the whole model
  kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
  assert mem["kv_bytes_per_row"] == kv_token * slots + 4 * slots
  learner = 3 * 4 * mem["weight_bytes"] / 2 / 32  # fp32 params and two moments, over 32 chips
  kw = dict(hbm_bytes=95 * GIB, resident_bytes=mem["weight_bytes"] / 4 + learner, batch_buckets=DEFAULT_BATCH_BUCKETS)
  kv = math.ceil(mem["kv_bytes_per_row"] / 4)  # KV heads over tensor=4
  # (85.5 GiB - 4.1 GB - 3.1 GB) / 0.83 GB = 101 rows per group, x 8 = 808 -> 512 (one cache)
  assert auto_decode_rows(kv_bytes_per_row=kv, data_groups=8, **kw) == 512
  # the compiled loop holds the cache once (CACHE_COPIES; twice, before it wrote it in place, gave 256)
  assert auto_decode_rows(kv_bytes_per_row=CACHE_COPIES * kv, data_groups=8, **kw) == 512


def test_the_trainer_resolves_auto_to_an_int(tmp_path):
  """On CPU (no HBM figure) the trainer's samplers get `CPU_ROWS` for "auto"."""
  from train_helpers import make_config, tiny_overrides

  from minpro_jax.run.trainer import Trainer

  tr = Trainer.from_config(make_config(tiny_overrides(tmp_path, **{"sampling.decode_rows": "auto"})))
  assert tr.sampler.engine.options.decode_rows == CPU_ROWS == tr.sampler_kw["engine"].decode_rows


_TPU_LAYOUT = """
from minpro_jax.aot.programs import RunPrograms, model_config, run_shapes
from minpro_jax.aot.environment import run_config_of
from minpro_jax.aot.topologies import parse_slice
from minpro_jax.runtime.sharding import make_mesh
sl = parse_slice("v5p-64")
_, c = run_config_of(["--config=configs/paper/qwen3_8b.py", "--config.sampling.mesh=auto",
                      "--config.sampling.decode_rows=auto"])
progs = RunPrograms(c, model_config(c)[0], make_mesh({"fsdp": 32}, devices=sl.devices()), run_shapes(c),
                    hbm_bytes=sl.chip.hbm_bytes)
s = progs.trainer_sampler
print(f"RESULT data={s.mesh.shape['data']} tensor={s.mesh.shape['tensor']} rows={s.engine.options.decode_rows}")
"""


def test_auto_layout_and_rows_of_the_paper_setting_on_v5p_64():
  """A compile-only TPU slice's "auto" mesh keeps tensor groups on one host (4 chips), not this process's devices,
  and "auto" rows fill each chip, the cache counted once (`test_auto_rows_fill_a_v5p_chip_beside_qwen3_8b`)."""
  from tests.tpu_helpers import run_with_libtpu

  (r,) = run_with_libtpu(_TPU_LAYOUT, timeout=300)
  assert (r["data"], r["tensor"], r["rows"]) == ("8", "4", "512")


def test_the_budget_rows_name_the_sampler_layout_and_rows():
  from minpro_jax.aot.budget import Budget
  from minpro_jax.aot.topologies import parse_slice
  from minpro_jax.config_lib import set_fields

  c = defaults.get_config()
  c.prompts_per_step, c.group_size, c.num_updates_per_step, c.micro_batch_size = 8, 2, 1, 16
  c.sampling.max_new_tokens, c.data.max_prompt_tokens = 8, 16
  kw = dict(lengths="const:4", prompt_len=6, parts=("sampling",))
  c = set_fields(c, {"sampling.mesh": "data=4,tensor=2", "sampling.decode_rows": "auto"})
  row = Budget(c, parse_slice("cpu:8"), "fsdp=8", **kw).run()[0]
  assert (row["sampler_layout"], row["decode_rows"]) == ("data=4,tensor=2 (sampler rules)", CPU_ROWS)
  c = set_fields(c, {"sampling.mesh": "", "sampling.decode_rows": 8})
  row = Budget(c, parse_slice("cpu:8"), "fsdp=8", **kw).run()[0]
  assert (row["sampler_layout"], row["decode_rows"]) == ("fsdp=8 (learner rules)", 8)
