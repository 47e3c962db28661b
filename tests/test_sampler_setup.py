"""`config.sampling.kv_cache` / `page_size` / `num_pages`: checked by `validate_config`, turned into the trainer's
`Sampler(engine=engines.Paged(kv=...))` by `sampler_setup.sampler_kwargs`, with the same trainer steps as the dense cache; and the
aot tool compiles the paged sampler for a TPU slice."""

import logging
import pathlib
import types

import jax
import numpy as np
import pytest
from tpu_helpers import run_with_libtpu
from train_helpers import TIMING_PREFIXES, coin_grade, global_steps, make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.models import get_preset, init_model
from minpro_jax.run import run_config, sampler_setup
from minpro_jax.run.sampler_setup import decode_rows, paged_kernel, row_slots, sampler_kwargs
from minpro_jax.sampling import PagedKV, Sampler, engines
from minpro_jax.sampling.rows import resolve_decode_rows


@pytest.mark.parametrize(
    "overrides, field, text",
    [
        ({"sampling.kv_cache": "pages"}, "sampling.kv_cache", "choose one of ('auto', 'dense', 'paged')"),
        ({"sampling.kv_cache": "paged", "sampling.continuous": False}, "sampling.kv_cache", "sampling.continuous=True"),
        ({"sampling.page_size": 0}, "sampling.page_size", "int >= 1"),
        ({"sampling.num_pages": -1}, "sampling.num_pages", "0 = auto"),
        # data.max_prompt_tokens 32 + max_new_tokens 6 - 1 = 37 tokens need 5 pages of 8
        (
            {"sampling.kv_cache": "paged", "sampling.page_size": 8, "sampling.num_pages": 4},
            "sampling.num_pages",
            "5 pages",
        ),
    ],
)
def test_bad_kv_cache_fields_name_the_field_and_the_fix(tmp_path, overrides, field, text):
  with pytest.raises(ConfigError, match=f"^config.{field}:") as e:
    run_config.validate_shapes_config(make_config(tiny_overrides(tmp_path, **overrides)))
  assert text in str(e.value)


@pytest.mark.parametrize(
    "kv_cache, continuous, want",
    [("auto", True, "paged"), ("auto", False, "dense"), ("dense", True, "dense"), ("dense", False, "dense")]
    + [("paged", True, "paged"), ("paged", False, "paged")],  # paged + static: sampler_paged_kv refuses it (above)
)
def test_the_resolution_table_of_kv_cache(kv_cache, continuous, want):
  assert sampler_setup.resolve_kv_cache(kv_cache, continuous) == want


def test_the_default_is_auto_paged_with_pages_of_16_on_the_continuous_sampler(tmp_path):
  """The default config's cache is "auto": paged (pages of 16, the pool of the dense cache's memory) with the
  continuous sampler, dense with the static one; a config from before the fields ran dense."""
  c = make_config(tiny_overrides(tmp_path))
  assert (c.sampling.kv_cache, c.sampling.page_size, c.sampling.num_pages, c.sampling.continuous) == (
      "auto",
      16,
      0,
      True,
  )
  assert sampler_setup.sampler_kv_cache(c) == "paged"
  assert sampler_setup.sampler_paged_kv(c) == PagedKV(page_size=16, num_pages=None)
  c.sampling.continuous = False
  run_config.validate_shapes_config(c)  # auto with the static sampler is no error
  assert sampler_setup.sampler_kv_cache(c) == "dense" and sampler_setup.sampler_paged_kv(c) is None
  c.sampling.continuous, c.sampling.kv_cache = True, "dense"
  assert sampler_setup.sampler_paged_kv(c) is None


def test_the_fields_give_the_samplers_paged_kv(tmp_path):
  c = make_config(tiny_overrides(tmp_path, **{"sampling.kv_cache": "paged", "sampling.page_size": 8}))
  assert sampler_setup.sampler_paged_kv(c) == PagedKV(page_size=8, num_pages=None)  # 0 = auto
  c.sampling.num_pages = 5
  assert sampler_setup.sampler_paged_kv(c) == PagedKV(page_size=8, num_pages=5)


def test_a_page_longer_than_a_response_is_warned_about(tmp_path, caplog):
  c = make_config(tiny_overrides(tmp_path, **{"sampling.kv_cache": "paged"}))
  tokens = c.data.max_prompt_tokens + c.sampling.max_new_tokens - 1
  with caplog.at_level(logging.WARNING, logger="minpro_jax.run.run_config"):
    c.sampling.page_size = tokens  # one page holds a whole response: nothing to say
    sampler_setup.sampler_paged_kv(c)
    assert not caplog.records
    c.sampling.page_size = 100_000
    assert sampler_setup.sampler_paged_kv(c) == PagedKV(page_size=100_000, num_pages=None)
  assert "page_size=100000 is longer than a whole response" in caplog.text
  assert f"{100_000 - tokens} unused slots" in caplog.text


def test_the_paper_configs_and_the_study_grids_pin_their_cache():
  """The study grids' committed results (and the paper configs' step budgets) ran with the dense cache: they pin
  it, so the default's flip to "auto" does not change what they run; the Qwen3-8B paper config runs the paged
  cache on its own sampler layout, the setting its budget entry measures."""
  from minpro_jax.config_lib import files

  configs = pathlib.Path(__file__).parent.parent / "configs"
  papers = sorted((configs / "paper").glob("*.py"))
  assert len(papers) >= 5
  for path in papers:
    c = files.load_module(str(path)).get_config()
    if path.stem == "qwen3_8b":
      assert (c.sampling.kv_cache, c.sampling.page_size, c.sampling.mesh) == ("paged", 128, "data=-1,tensor=8")
      assert sampler_setup.sampler_paged_kv(c) == PagedKV(128) and c.sampling.decode_rows == "auto"
      continue
    assert (c.sampling.kv_cache, c.sampling.page_size) == ("dense", 128), path
    assert sampler_setup.sampler_paged_kv(c) is None


def test_row_slots_and_auto_rows_of_a_paged_pool(tmp_path):
  """A row reserves whole pages of prompt + max_new_tokens - 1 tokens; "auto" rows with a fixed pool are what it
  holds at full length, rounded down to a batch bucket; with num_pages 0, those of the HBM as the dense cache."""
  c = make_config(tiny_overrides(tmp_path, **{"sampling.kv_cache": "paged", "sampling.page_size": 8}))
  cfg = get_preset("tiny")
  assert row_slots(c, None, 32) == 38 and row_slots(c, PagedKV(8), 32) == 40  # 37 tokens: 5 pages of 8
  c.sampling.decode_rows = "auto"
  by_pool = lambda n: decode_rows(c, cfg, paged_kv=PagedKV(8, n), prompt_len=32, hbm_bytes=None)  # noqa: E731
  assert [by_pool(n) for n in (5, 9, 10, 159, 160, 5 * 1100)] == [1, 1, 2, 16, 32, 1024]
  hbm = 2**30
  got = decode_rows(c, cfg, paged_kv=PagedKV(8), prompt_len=32, hbm_bytes=hbm)
  assert got == resolve_decode_rows("auto", cfg, precision="fp32", slots=40, hbm_bytes=hbm) > 64
  assert decode_rows(c, cfg, paged_kv=PagedKV(8), prompt_len=32, hbm_bytes=None) == 64  # CPU
  c.sampling.decode_rows = 12
  assert by_pool(5) == 12  # an int is taken as it is


def test_a_fixed_pool_too_small_for_its_row_groups_is_a_config_error(tmp_path):
  """sampling.num_pages splits over the sampler's data groups (data=2 x tensor=2 on cpu:4): each must hold one
  row at full length, checked when the sampler is built, not by a request that waits forever."""
  from minpro_jax.run.sampler_setup import _check_group_pool
  from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
  from minpro_jax.runtime.sharding import make_mesh

  c = make_config(tiny_overrides(tmp_path))
  need = row_slots(c, PagedKV(16), c.data.max_prompt_tokens) // 16
  mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
  _check_group_pool(c, PagedKV(16, 2 * need), 8, mesh, INFERENCE_RULES)
  _check_group_pool(c, PagedKV(16, 2 * need - 1), 8, None, None)  # no mesh: one group
  _check_group_pool(c, PagedKV(16, 2 * need - 1), 7, mesh, INFERENCE_RULES)  # 7 rows do not split in two
  with pytest.raises(ConfigError, match=rf"^config.sampling.num_pages: {2 * need - 1} pages split .* 2 row groups"):
    _check_group_pool(c, PagedKV(16, 2 * need - 1), 8, mesh, INFERENCE_RULES)


def test_one_default_page_size():
  """The paged cache's page size has one default: the config's is the library's (`PagedKV`)."""
  from minpro_jax.config_lib.defaults import get_config

  assert PagedKV().page_size == get_config().sampling.page_size == engines.Paged().kv.page_size == 16


def test_sampler_kwargs_build_a_paged_sampler(tmp_path, caplog):
  caplog.set_level(logging.INFO, logger="minpro_jax.run.sampler_setup")
  model = init_model(get_preset("tiny"), seed=0)
  tok = types.SimpleNamespace(pad_id=-1)
  ov = {"sampling.kv_cache": "paged", "sampling.page_size": 16, "sampling.num_pages": 40}
  kw = sampler_kwargs(make_config(tiny_overrides(tmp_path, **ov)), model, tok, None)
  want = PagedKV(page_size=16, num_pages=40, kernel="xla")  # head_dim 32: not Pallas, so no block sizes
  assert kw["engine"] == engines.Paged(decode_rows=64, kv=want)
  sampler = Sampler(model.config, **kw)
  assert sampler.engine.name == "paged" and sampler.engine.kv == want
  dense = make_config(tiny_overrides(tmp_path, **{"sampling.kv_cache": "dense"}))
  assert sampler_kwargs(dense, model, tok, None)["engine"] == engines.Continuous(decode_rows=64)
  auto = sampler_kwargs(make_config(tiny_overrides(tmp_path)), model, tok, None)  # the default: paged, pages of 16
  assert auto["engine"] == engines.Paged(decode_rows=64, kv=PagedKV(page_size=16, kernel="xla"))
  static = make_config(tiny_overrides(tmp_path, **{"sampling.continuous": False}))
  assert sampler_kwargs(static, model, tok, None)["engine"] == engines.Static()
  named = make_config(tiny_overrides(tmp_path, **{"sampling.engine": "host_refill", "sampling.decode_rows": 8}))
  assert sampler_kwargs(named, model, tok, None)["engine"] == engines.HostRefill(decode_rows=8)
  sampler_kwargs(make_config(tiny_overrides(tmp_path, **{"sampling.decode_rows": 100})), model, tok, None)
  lines = [r.getMessage() for r in caplog.records if r.name == "minpro_jax.run.sampler_setup"]
  assert lines == [  # the run's log names the engine, what each cache resolved to, and rows rounded up to a bucket
      "sampler: paged, kv_cache=paged (pages of 16, pool 40, kernel xla), 64 decode rows",
      "sampler: continuous, kv_cache=dense, 64 decode rows",
      "sampler: paged, kv_cache=auto -> paged (pages of 16, pool auto, kernel xla), 64 decode rows",
      "sampler: static, kv_cache=auto -> dense, 64 decode rows",
      "sampler: host_refill, kv_cache=auto -> dense, 8 decode rows",
      "sampler: paged, kv_cache=auto -> paged (pages of 16, pool auto, kernel xla), 100 decode rows (runs as "
      "128: decode rows round up to a batch bucket)",
  ]


def test_auto_kernel_only_for_heads_the_pallas_kernel_tiles():
  kv = PagedKV(16)
  assert paged_kernel(kv, get_preset("tiny")) == PagedKV(16, kernel="xla")  # head_dim 32
  assert paged_kernel(PagedKV(16, kernel="xla"), get_preset("tiny", head_dim=128)) == PagedKV(16, kernel="xla")
  assert paged_kernel(kv, get_preset("tiny", head_dim=128)) == kv  # "auto": Pallas on TPU
  assert paged_kernel(PagedKV(16, kernel="pallas"), get_preset("tiny")).kernel == "pallas"  # explicit: kept
  assert paged_kernel(None, get_preset("tiny")) is None


def _steps(trainer, params, loader_state):
  """Global steps 0 and 1 from `params`: ([(each step's batch, its metrics without the wall-clock ones)], state)."""
  steps, state = global_steps(trainer, params, loader_state, num_steps=2)
  return [(b, {k: v for k, v in m.items() if not k.startswith(TIMING_PREFIXES)}) for b, m in steps], state


def _assert_close(got, want, name: str) -> None:
  """Metrics equal up to fp32 rounding (behavior log-probs differ by ~1e-7 between the two caches' matmuls)."""
  if isinstance(want, (list, tuple)):
    assert len(got) == len(want), name
    for g, w in zip(got, want):
      _assert_close(g, w, name)
  elif isinstance(want, (int, float, np.number)) and not isinstance(want, bool):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
  else:
    assert got == want, name


def test_a_trainer_step_with_paged_kv_equals_dense(tmp_path, monkeypatch):
  """One trainer (its learner programs compiled once) sampling with the dense cache, then with the sampler
  `sampler_kwargs` builds for kv_cache=paged (pages of 8 tokens, a pool of 12 so requests wait): the same
  tokens, rewards, losses and parameters."""
  from flax import nnx

  from minpro_jax.run.trainer import Trainer

  monkeypatch.setattr("minpro_jax.run.trainer.grade_split", coin_grade)
  trainer = Trainer.from_config(make_config(tiny_overrides(tmp_path, delay=1, **{"sft.enabled": False})))
  params, loader_state = nnx.split(trainer.model)[1], trainer.loader.get_state()
  dense, dense_state = _steps(trainer, params, loader_state)
  paged_c = make_config(
      tiny_overrides(
          tmp_path,
          delay=1,
          **{"sampling.kv_cache": "paged", "sampling.page_size": 8, "sampling.num_pages": 12, "sft.enabled": False},
      )
  )
  trainer.sampler = trainer.eval_sampler = Sampler(
      trainer.model.config, **sampler_kwargs(paged_c, trainer.model, trainer.tokenizer, trainer.mesh)
  )
  assert trainer.sampler.engine.kv == PagedKV(8, 12, kernel="xla")
  paged, paged_state = _steps(trainer, params, loader_state)
  trainer.close()
  assert dense[1][1]["learn/loss"] != 0  # a real update is compared
  for (db, dm), (pb, pm) in zip(dense, paged):
    for f in ("tokens", "response_mask", "rewards", "advantages", "response_lengths"):
      np.testing.assert_array_equal(np.asarray(getattr(pb, f)), np.asarray(getattr(db, f)), err_msg=f)
    np.testing.assert_allclose(np.asarray(pb.behavior_logp), np.asarray(db.behavior_logp), atol=1e-5, rtol=0)
    assert pm.keys() == dm.keys()
    for k in dm:
      _assert_close(pm[k], dm[k], k)
  for a, b in zip(jax.tree.leaves(paged_state.params), jax.tree.leaves(dense_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_the_aot_tool_compiles_the_paged_sampler_for_tpu():
  """`--programs=sample` with kv_cache=paged lowers the trainer's paged call (the paged engine's `program`) and compiles it
  for a v5p-8: with head_dim 128 the Pallas kernel (PagedKV kernel "auto" on TPU devices); with head_dim 16, not
  whole vregs, the plain-JAX attention (`sampler_setup.paged_kernel`)."""
  code = """
import pathlib, sys
sys.path.insert(0, "tests")
from minpro_jax.aot.programs import RunPrograms, model_config, run_shapes
from minpro_jax.aot.sweep import sweep
from minpro_jax.aot.topologies import parse_slice
from minpro_jax.runtime.sharding import make_mesh
from train_helpers import make_config, tiny_overrides
sl = parse_slice("v5p-8")
for hd in (16, 128):
  c = make_config(tiny_overrides(pathlib.Path("/tmp"), **{"sampling.kv_cache": "paged", "sampling.page_size": 16}),
                  model={"head_dim": hd})
  progs = RunPrograms(c, model_config(c)[0], make_mesh({"fsdp": 4}, devices=sl.devices()), run_shapes(c))
  kv = progs.trainer_sampler.engine.kv
  (row,) = sweep(c, sl, ["fsdp=-1"], programs=["sample"])
  print("RESULT", f"hd={hd}", f"kernel={kv.kernel}", f"kernel_used={progs.trainer_sampler.engine.kv.kernel_fields(progs.sampler.mesh)['kernel']}",
        f"fits={row.get('fits')}", f"error={row.get('error', '').replace(' ', '_')[:80]}",
        f"shapes={row['shapes'].replace(' ', '_')}")
"""
  rows = run_with_libtpu(code)
  shapes = "8_requests_on_8_rows,_paged_KV"
  assert rows == [
      {"hd": "16", "kernel": "xla", "kernel_used": "xla", "fits": "True", "error": "", "shapes": shapes},
      {"hd": "128", "kernel": "auto", "kernel_used": "pallas", "fits": "True", "error": "", "shapes": shapes},
  ]


def test_the_sampler_rules_of_the_config(tmp_path):
  """`sampling.rules`: empty follows the sampler's layout (the learner's `mesh.rules` on the learner's mesh, the
  inference rules on its own); overrides apply on that layout's rules; a rule set's name replaces them."""
  from minpro_jax.runtime.inference_mesh import INFERENCE_RULES
  from minpro_jax.runtime.sharding import DEFAULT_RULES

  def rules(layout, **fields):
    return dict(sampler_setup.sampler_rules_of(make_config(tiny_overrides(tmp_path, **fields)), layout))

  assert rules(None) == dict(DEFAULT_RULES) and rules(INFERENCE_RULES) == dict(INFERENCE_RULES)
  assert rules(None, **{"mesh.rules": "mlp=fsdp"})["mlp"] == "fsdp"  # the learner's rules, on its mesh
  assert rules(None, **{"sampling.rules": "vocab="})["vocab"] is None
  own = rules(INFERENCE_RULES, **{"sampling.rules": "vocab=", "mesh.rules": "mlp=fsdp"})
  assert own["vocab"] is None and own["mlp"] == "tensor" and own["batch"] == "data"  # on the inference rules
  assert rules(INFERENCE_RULES, **{"sampling.rules": "default"}) == dict(DEFAULT_RULES)


@pytest.mark.parametrize(
    "overrides, field, gb",
    [
        ({"sampling.kv_cache": "paged", "sampling.num_pages": 10**9}, "sampling.num_pages", "8.2 TB"),
        ({"sampling.kv_cache": "paged", "sampling.page_size": 10**9}, "sampling.page_size", "32.8 TB"),
        ({"sampling.kv_cache": "dense", "sampling.decode_rows": 10**8}, "sampling.decode_rows", "1.9 TB"),
        ({"sampling.kv_cache": "dense", "sampling.decode_rows": 1, "sampling.max_new_tokens": 10**9}, None, None),
    ],
)
def test_sizes_known_at_config_time_are_checked_against_the_runs_memory(tmp_path, overrides, field, gb):
  """A sampling size whose KV buffer alone exceeds the run's memory is one error naming the field, at setup. The
  tiny model: 2 layers x K and V x 2 heads x 16 x 4 bytes = 512 bytes per token; rows 64, 32 + 6 tokens."""
  from minpro_jax.run.memory_check import check_sizes_fit, kv_bytes_per_token

  c = make_config(tiny_overrides(tmp_path, **overrides))
  cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32")
  assert kv_bytes_per_token(cfg) == 2 * 2 * 2 * 16 * 4 == 512
  if field is None:  # one row of 1e9 + 32 tokens: the dense cache's length names sampling.max_new_tokens
    field, gb = "sampling.max_new_tokens", "512.0 GB"
  with pytest.raises(ConfigError, match=rf"^config\.{field}: .* needs {gb}, more than the 8\.0 GB of X; "):
    check_sizes_fit(c, cfg, 8 * 10**9, "X")
  check_sizes_fit(make_config(tiny_overrides(tmp_path)), cfg, 8 * 10**9, "X")  # the defaults: nothing near
  check_sizes_fit(c, cfg, None, "")  # memory unknown: nothing checked


def test_a_page_pool_larger_than_the_machine_stops_before_sft(tmp_path):
  from minpro_jax.run.run_setup import setup_run
  from minpro_jax.runtime.host_memory import run_memory_bytes

  memory, where = run_memory_bytes(jax.devices())
  assert memory > 2**30 and where == "this machine's memory"
  ov = tiny_overrides(tmp_path, **{"sampling.kv_cache": "paged", "sampling.num_pages": 10**12})
  with pytest.raises(ConfigError, match=r"^config\.sampling\.num_pages: the KV page pool of 1000000000000 pages"):
    setup_run(make_config(ov))
  assert not list((tmp_path / "cache").glob("sft-*"))  # the warm start never ran
