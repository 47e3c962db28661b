"""Compile-only sweeps (`python -m minpro_jax.aot`): slices, meshes, the run's programs, memory, collectives."""

import json
import os

import pytest

from minpro_jax.aot import analysis
from minpro_jax.aot.analysis import add_resident
from minpro_jax.aot.programs import check_mesh_fits_model, run_shapes
from minpro_jax.aot.sweep import fingerprint, parse_mesh, sharding_table, sweep
from minpro_jax.aot.topologies import parse_slice
from minpro_jax.config_lib import set_fields
from minpro_jax.config_lib.defaults import get_config
from minpro_jax.errors import ConfigError
from minpro_jax.models.config import get_preset
from tests.tpu_helpers import run_with_libtpu

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "aot_shardings_cpu8.txt")
UPDATE_GOLDEN = os.environ.get("MINPRO_UPDATE_GOLDEN") == "1"


def small_config(**fields):
  """The default (tiny) config at small shapes: 8 prompts x 2 responses in one micro-batch, 16 + 8 tokens."""
  c = get_config()
  c.prompts_per_step, c.group_size, c.num_updates_per_step, c.micro_batch_size = 8, 2, 1, 16
  c.sampling.max_new_tokens, c.data.max_prompt_tokens = 8, 16
  return set_fields(c, fields)


CPU8 = parse_slice("cpu:8")


def _row(rows, mesh, program):
  return next(r for r in rows if r["mesh"] == mesh and r["program"] == program)


@pytest.fixture(scope="module")
def tiny_rows():
  return sweep(small_config(), CPU8, ["data=8", "fsdp=8", "data=2,fsdp=4"], programs=["update", "score", "decode"])


def test_the_tiny_config_compiles_on_every_mesh_with_positive_memory(tiny_rows):
  assert {(r["mesh"], r["program"]) for r in tiny_rows} == {
      (m, p) for m in ("data=8", "fsdp=8", "data=2,fsdp=4") for p in ("update", "score", "decode")
  }
  for r in tiny_rows:
    assert "error" not in r, r
    for field in ("argument_bytes", "output_bytes", "temp_bytes", "total_bytes"):
      assert r[field] > 0, (field, r)
    assert r["fits"] is None and r["hbm_fraction"] is None  # CPU devices: no HBM to fit
    assert r["flops"] > 0 and r["chips"] == 8 and r["remat"] == "none"
  # fsdp shards the parameters and the AdamW moments 8 ways; data replicates them
  assert (
      _row(tiny_rows, "fsdp=8", "update")["argument_bytes"] < _row(tiny_rows, "data=8", "update")["argument_bytes"] / 4
  )


def test_collectives_are_what_the_mesh_implies(tiny_rows):
  """A pure data mesh gathers no parameters (only the gradient is all-reduced); fsdp all-gathers the parameter
  shards for the forward and backward and reduces the gradients."""
  data, fsdp = _row(tiny_rows, "data=8", "update")["collectives"], _row(tiny_rows, "fsdp=8", "update")["collectives"]
  assert data["all-gather"]["count"] == 0
  assert data["all-reduce"]["count"] > 0
  assert fsdp["all-gather"]["count"] > 0 and fsdp["all-gather"]["bytes"] > 0
  assert fsdp["reduce-scatter"]["count"] + fsdp["all-reduce"]["count"] > 0


def test_temporaries_grow_with_the_batch():
  rows = {
      n: sweep(small_config(prompts_per_step=n, micro_batch_size=2 * n), CPU8, ["fsdp=8"], programs=["score"])[0][
          "temp_bytes"
      ]
      for n in (8, 32)
  }
  assert rows[32] > rows[8] > 0


def test_remat_choices_are_compiled_side_by_side():
  rows = sweep(small_config(), CPU8, ["fsdp=8"], ["none", "block"], programs=["update"])
  assert [r["remat"] for r in rows] == ["none", "block"]
  assert rows[1]["flops"] == pytest.approx(rows[0]["flops"] * 4 / 3)  # block recomputes the forward


def test_mipu_rollback_counts_its_snapshot_of_the_state():
  """With mipu.rollback the update row's total holds a second copy of the donated state (parameters and moments)."""
  plain = sweep(small_config(), CPU8, ["fsdp=8"], programs=["update"])[0]
  mipu = sweep(small_config(**{"mipu.rollback": True}), CPU8, ["fsdp=8"], programs=["update"])[0]
  assert (
      "mipu_snapshot_bytes" not in plain
      and fingerprint(small_config(**{"mipu.rollback": True})) != plain["fingerprint"]
  )
  assert mipu["mipu_snapshot_bytes"] == plain["alias_bytes"] > 0
  assert mipu["total_bytes"] == plain["total_bytes"] + plain["alias_bytes"]
  row = {"total_bytes": 10}
  add_resident(row, "x_bytes", 5, hbm_bytes=12)
  assert row == {"total_bytes": 15, "x_bytes": 5, "hbm_fraction": 1.25, "fits": False}


def test_done_rows_are_not_compiled_again():
  c = small_config()
  first = sweep(c, CPU8, ["fsdp=8"], programs=["score"])
  assert sweep(c, CPU8, ["fsdp=8"], programs=["score"], done=first) == []
  assert len(sweep(c, CPU8, ["fsdp=8"], programs=["score"], done=first, sampler_rows=32)) == 1  # another key


def test_fingerprint_follows_the_fields_that_shape_programs(monkeypatch):
  from minpro_jax.config_lib import defaults

  fp = fingerprint(small_config())
  assert fingerprint(small_config(workdir="/elsewhere", seed=7, total_steps=3)) == fp  # bookkeeping
  assert fingerprint(set_fields(small_config(), {"data.path": "other.jsonl", "eval.every": 3})) == fp
  assert fingerprint(small_config(micro_batch_size=4)) != fp
  assert fingerprint(set_fields(small_config(), {"data.max_prompt_tokens": 32})) != fp
  assert fingerprint(set_fields(small_config(), {"loss.tis_cap": 9.0})) != fp

  def with_new_field(make):  # a field added to the config later, at its default
    def made():
      c = make()
      with c.unlocked():
        c.loss.new_knob = 0.5
      return c

    return made

  grown = with_new_field(small_config)()
  assert fingerprint(grown) != fp  # unknown to the defaults: counted
  monkeypatch.setattr(defaults, "base_config", with_new_field(defaults.base_config))
  assert fingerprint(grown) == fp  # at the default of the grown defaults: not counted
  with grown.unlocked():
    grown.loss.new_knob = 0.25
  assert fingerprint(grown) != fp


def _golden_text() -> str:
  """Every input and output sharding of update and decode of the small config on cpu:8, data=2 x fsdp=4."""
  import jax

  from minpro_jax.aot.programs import RunPrograms, model_config
  from minpro_jax.runtime.sharding import make_mesh

  c = small_config()
  mesh = make_mesh({"data": 2, "fsdp": 4}, devices=jax.devices()[:8])
  progs = RunPrograms(c, model_config(c)[0], mesh, run_shapes(c))
  lines = []
  for prog in progs.programs(["update", "score", "prefill", "decode"]):
    lowered = prog.lower()
    compiled = lowered.compile()
    progs.remember(prog.name, lowered, compiled)
    for side, rows in sharding_table(lowered, compiled).items():
      lines += [f"{prog.name} {side[:-1]} {path} {shape} {spec}" for path, shape, spec in rows]
  return "\n".join(lines) + "\n"


def test_shardings_match_the_golden_file():
  """A change of any program's input or output layout shows up here (and in review as a diff of the golden
  file). Regenerate after an intended change: MINPRO_UPDATE_GOLDEN=1 pytest tests/test_aot.py -k golden."""
  got = _golden_text()
  if UPDATE_GOLDEN:
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
      f.write(got)
  with open(GOLDEN) as f:
    want = f.read()
  assert got.splitlines() == want.splitlines()


def test_collectives_parser_counts_ops_and_result_bytes():
  hlo = "\n".join(
      [
          "  %all-gather.1 = bf16[64,384]{1,0:T(8,128)(2,1)} all-gather(%p), channel_id=2, dimensions={0}",
          "  %ag-start = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%q), dimensions={0}",
          "  %ag-done = f32[32,16]{1,0} all-gather-done(%ag-start)",
          "  %all-reduce.1 = (f32[10]{0}, s32[4]{0}) all-reduce(%a, %b), to_apply=%sum",
          "  %rs = f32[4,4]{1,0} reduce-scatter(%c), dimensions={0}",
          "  %a2a = bf16[4,1,128,16]{2,3,1,0} all-to-all(%d), dimensions={0}",
          "  ROOT %cp = u32[]{:T(128)} collective-permute-start(%e), source_target_pairs={{0,1}}",
          "  %fusion = f32[8]{0} fusion(%all-gather.1), kind=kLoop",
      ]
  )
  got = analysis.collectives(hlo)
  assert got["all-gather"] == {"count": 2, "bytes": 64 * 384 * 2 + 32 * 16 * 4}
  assert got["all-reduce"] == {"count": 1, "bytes": 10 * 4 + 4 * 4}
  assert got["reduce-scatter"] == {"count": 1, "bytes": 64}
  assert got["all-to-all"] == {"count": 1, "bytes": 4 * 128 * 16 * 2}
  assert got["collective-permute"] == {"count": 1, "bytes": 4}


def test_model_flops_by_hand():
  """tiny: d=64, hd=16, 4 q / 2 kv heads, ff=128, 2 layers, V=512. N_matmul = 2 * (64*16*12 + 3*64*128) + 64*512
  = 106,496; attention 4 * 2 * 4 * 16 = 512 FLOPs per token per attended position."""
  cfg = get_preset("tiny")
  n, att = 106_496, 512
  kw = dict(rows=2, prompt_len=3, response_len=5)
  assert analysis.model_flops(cfg, "score", remat="none", **kw) == 16 * (2 * n + att * 4.5)
  assert analysis.model_flops(cfg, "update", remat="none", **kw) == 3 * 16 * (2 * n + att * 4.5)
  assert analysis.model_flops(cfg, "update", remat="block", **kw) == 4 * 16 * (2 * n + att * 4.5)
  assert analysis.model_flops(cfg, "prefill", remat="none", **kw) == 6 * (2 * n + att * 2)
  assert analysis.model_flops(cfg, "decode", remat="none", **kw) == 10 * (2 * n + att * 8)


def test_slice_names():
  s = parse_slice("v5p-64")
  assert (s.num_chips, s.topology, s.chips_per_host, s.num_hosts) == (32, "v5p:2x4x4", (2, 2, 1), 8)
  s = parse_slice("v6e-16")
  assert (s.num_chips, s.topology, s.num_hosts, s.chip.hbm_bytes) == (16, "v6e:4x4", 2, 32 * 2**30)
  s = parse_slice("v5e-4")
  assert (s.num_chips, s.topology, s.chips_per_host, s.num_hosts) == (4, "v5e:2x2", (2, 2, 1), 1)
  assert parse_slice("v4-8").topology == "v4:2x2x1"
  assert parse_slice("cpu:8").num_chips == 8


@pytest.mark.parametrize(
    "name, message",
    [("v7x-8", "not a slice name"), ("v5p-12", "no standard v5p slice"), ("cpu:0", "cpu:N takes N >= 1"), ("tpu", "")],
)
def test_unknown_slices_name_the_flag(name, message):
  with pytest.raises(ConfigError, match=f"--topology={name!r}|--topology={name}") as e:
    parse_slice(name)
  assert message in str(e.value)


def test_meshes_that_do_not_divide_the_slice_or_the_heads_name_the_flag():
  assert parse_mesh("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4}
  for spec in ("data=3", "data=3,fsdp=-1", "data=-1,fsdp=-1", "foo=8", "data=0,fsdp=-1"):
    with pytest.raises(ConfigError, match="--mesh"):
      parse_mesh(spec, 8)
  with pytest.raises(ConfigError, match="--mesh: tensor=8 does not divide the model's 4 attention heads"):
    check_mesh_fits_model({"tensor": 8}, get_preset("tiny"))
  with pytest.raises(ConfigError, match="expert=3 does not divide the model's 8 experts"):
    check_mesh_fits_model({"expert": 3}, get_preset("tiny-moe"))


def test_a_program_that_does_not_fit_is_a_row_not_a_crash():
  err = RuntimeError(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
      "Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G."
  )
  row = analysis.does_not_fit(err)
  assert row["fits"] is False and row["total_bytes"] == int(120.5 * 2**30)
  err = RuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
      "(156.05G) exceeds available HBM (95.74G)."
  )
  row = analysis.does_not_fit(err)
  assert row["fits"] is False and row["temp_bytes"] == int(156.05 * 2**30) and "total_bytes" not in row
  assert analysis.does_not_fit(ValueError("shapes do not match")) is None


def test_the_command_line_reports_and_resumes(tmp_path, capsys):
  from minpro_jax.aot.__main__ import main

  out = tmp_path / "r.json"
  args = [
      "--topology=cpu:8",
      "--mesh=fsdp=-1",
      "--programs=score",
      f"--out={out}",
      "--config.prompts_per_step=4",
      "--config.group_size=2",
      "--config.num_updates_per_step=1",
      "--config.sampling.max_new_tokens=8",
  ]
  assert main(args) == 0
  table = capsys.readouterr().out
  assert "| fsdp=8 | none | score | 8x72 (micro-batch 8) |" in table
  rep = json.loads(out.read_text())
  assert rep["slice"] == "cpu:8" and len(rep["rows"]) == 1 and rep["machine"]["jax"]
  mtime = out.stat().st_mtime_ns
  assert main(args) == 0  # resumed: nothing compiled, nothing rewritten
  assert out.stat().st_mtime_ns == mtime and "| fsdp=8 | none | score |" in capsys.readouterr().out


def test_the_command_line_sweeps_rule_sets(tmp_path, capsys):
  """`--rules` (repeated) compiles each rule set on each mesh: with the weights whole on every device (their
  fsdp split ruled out) a chip holds more of the score program's arguments than with the default split (issue 56)."""
  from minpro_jax.aot.__main__ import main

  out = tmp_path / "r.json"
  args = ["--topology=cpu:8", "--mesh=fsdp=8", "--programs=score", "--config.prompts_per_step=4", f"--out={out}"]
  args += ["--config.group_size=2", "--config.num_updates_per_step=1", "--config.sampling.max_new_tokens=8"]
  whole = "default:embed=,mlp=,vocab=,q_heads=,kv_heads="
  assert main([*args, "--rules=default", f"--rules={whole}"]) == 0
  table = capsys.readouterr().out
  assert "| fsdp=8 | none | score |" in table and f"| fsdp=8 [{whole}] | none | score |" in table
  rows = {r["rules"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows[whole]["argument_bytes"] > 2 * rows["default"]["argument_bytes"]
  assert main([*args, "--rules=default:mlps=fsdp"]) == 2
  assert "config.mesh.rules: 'mlps' is no logical axis" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology=v9-8"], "--topology='v9-8': not a slice name"),
        (["--topology=cpu:0"], "--topology=cpu:0: cpu:N takes N >= 1"),
        (["--topology=cpu:8", "--mesh=data=3"], "--mesh=data=3"),
        (["--topology=cpu:8", "--programs=train"], "--programs=train: choose from update,score,prefill,decode,sample"),
        (["--topology=cpu:8", "--config.num_updates_per_step=3"], "config.num_updates_per_step"),
        (["--topology=cpu:8", "--config.nonsense=1"], "config.nonsense"),
        (["--topology=cpu:8", "--remat=sometimes"], "--remat=sometimes"),
    ],
)
def test_command_line_mistakes_exit_2_naming_the_field(args, message, capsys, monkeypatch):
  from minpro_jax.aot.__main__ import main

  for k in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "LIBTPU_INIT_ARGS", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
    monkeypatch.setenv(k, "")  # main sets them for a TPU topology: undone after the test, so the worker's later
    monkeypatch.delenv(k)  # subprocesses (which load libtpu) do not inherit e.g. TPU_ACCELERATOR_TYPE=v9-8
  assert main(args) == 2
  assert message in capsys.readouterr().err


def test_help_lists_budget_and_config(capsys):
  from minpro_jax.aot.__main__ import main

  with pytest.raises(SystemExit) as e:
    main(["--help"])
  out = capsys.readouterr().out
  assert e.value.code == 0 and "--budget" in out and "--config FILE[:ARG]" in out, out


def test_an_absent_checkpoint_falls_back_on_the_named_preset():
  from minpro_jax.aot.programs import model_config
  from minpro_jax.config_lib.files import load_module

  qwen3_8b = load_module("configs/paper/qwen3_8b.py")

  cfg, where = model_config(qwen3_8b.get_config())
  assert (cfg.hidden_size, cfg.num_layers, cfg.remat, cfg.dtype) == (
      4096,
      36,
      "dots_with_no_batch_dims_saveable",
      "bfloat16",
  )
  assert where.startswith("preset qwen3-8b")
  c = small_config(**{"model.source": "hf", "model.path": "/nonexistent"})
  with pytest.raises(ConfigError, match="config.model.path: '/nonexistent' has no config.json"):
    model_config(c)


_TPU = """
import json, subprocess, sys
for topo in ("v5e-4", "v5p-8"):
  out = f"/tmp/minpro_aot_test_{topo}.json"
  cmd = [sys.executable, "-m", "minpro_jax.aot", f"--topology={topo}", "--mesh=fsdp=-1", "--programs=update,decode",
         f"--out={out}", "--fresh"]
  assert subprocess.run(cmd, capture_output=True).returncode == 0
  for r in json.load(open(out))["rows"]:
    print(f"RESULT topo={topo} program={r['program']} fits={r['fits']} total={r['total_bytes']} hbm={r['hbm_bytes']}")
"""


@pytest.mark.slow
@pytest.mark.xdist_group("aot_tpu")  # its own group: libtpu compiles, the longest test of the file
def test_the_tiny_config_fits_v5e_4_and_v5p_8():
  rows = run_with_libtpu(_TPU, timeout=560)
  assert {(r["topo"], r["program"]) for r in rows} == {(t, p) for t in ("v5e-4", "v5p-8") for p in ("update", "decode")}
  for r in rows:
    assert r["fits"] == "True" and 0 < int(r["total"]) < int(r["hbm"]), r


def test_the_environment_quiets_libtpu_without_hiding_the_users_settings(monkeypatch):
  from minpro_jax.aot.environment import prepare_environment

  for k in ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "LIBTPU_INIT_ARGS"):
    monkeypatch.delenv(k, raising=False)
  prepare_environment("v5e-4")
  assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost" and os.environ["TPU_ACCELERATOR_TYPE"] == "v5litepod-4"
  assert os.environ["LIBTPU_INIT_ARGS"] == "--install_signal_handlers=false"
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_foo=1")
  prepare_environment("v5e-4")
  assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-8"
  assert os.environ["LIBTPU_INIT_ARGS"] == "--xla_foo=1 --install_signal_handlers=false"


# libtpu loaded as the command loads it, then SIGTERM: one line on stderr, no load-time noise, no native stack
_TPU_SIGTERM = """
import os, signal, subprocess, sys, time
child = '''
import sys, time
from minpro_jax.aot.environment import exit_on_signal, prepare_environment
prepare_environment("v5e-4")
exit_on_signal("KEPT")
from minpro_jax.aot.topologies import parse_slice
print(len(parse_slice("v5e-4").devices()), flush=True)
time.sleep(120)
'''
p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
n = p.stdout.readline().strip()
p.send_signal(signal.SIGTERM)
out, err = p.communicate(timeout=60)
print(f"RESULT devices={n} rc={p.returncode} err={repr(err).replace(' ', '_')}")
"""


@pytest.mark.xdist_group("aot_tpu")
def test_libtpu_loads_quietly_and_a_sigterm_says_what_is_kept():
  (r,) = run_with_libtpu(_TPU_SIGTERM, timeout=240)
  assert r == {"devices": "4", "rc": "143", "err": "'error:_stopped_by_signal_15;_KEPT\\n'"}, r


@pytest.mark.slow  # ~20 s at load 10
def test_a_sigterm_mid_compile_keeps_the_rows_already_compiled(tmp_path):
  import signal
  import subprocess
  import sys

  out = tmp_path / "r.json"
  cmd = [sys.executable, "-m", "minpro_jax.aot", "--topology=cpu:1", "--programs=score,update", f"--out={out}"]
  p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
  first = p.stderr.readline()  # the score row; the update program is compiling now
  p.send_signal(signal.SIGTERM)
  _, err = p.communicate(timeout=120)
  assert first.startswith("# fsdp=1 none score: total") and p.returncode == 128 + signal.SIGTERM, first + err
  assert (
      err == f"error: stopped by signal 15; the rows compiled so far are in --out={out}: rerun the same command "
      "to resume from them\n"
  )
  assert [r["program"] for r in json.loads(out.read_text())["rows"]] == ["score"]
