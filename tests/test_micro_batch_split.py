"""A learner micro-batch must split over the mesh's batch axes (data x fsdp x expert): the config check refuses one
that does not (`run_config.check_micro_batch_split`), and the paper configs split on the slices they are sized for."""

import glob
import os

import pytest
from train_helpers import make_config, tiny_overrides

from minpro_jax.aot.topologies import parse_slice
from minpro_jax.config_lib.files import REPO, load_module
from minpro_jax.run.run_config import (
    ConfigError,
    check_micro_batch_split,
    parse_mesh_shape,
    resolve_mesh_shape,
    validate_config,
)
from minpro_jax.runtime.sharding import batch_split


def test_batch_split_is_the_product_of_the_batch_rule_axes():
  assert batch_split({}) == (("data", "fsdp", "expert"), 1)
  assert batch_split({"data": 2, "fsdp": 4, "tensor": 2}) == (("data", "fsdp", "expert"), 8)
  assert batch_split({"tensor": 4, "expert": 2}) == (("data", "fsdp", "expert"), 2)
  assert batch_split({"data": 2, "fsdp": 4}, rules=(("batch", "data"),)) == (("data",), 2)


def test_a_micro_batch_that_does_not_split_names_the_field_both_figures_and_the_fix(tmp_path):
  c = make_config(tiny_overrides(tmp_path, **{"mesh.shape": "fsdp=-1"}))  # mini-batch 4, micro-batch 2
  with pytest.raises(ConfigError) as e:
    validate_config(c, num_devices=4)
  assert str(e.value) == (
      "config.micro_batch_size: the learner's micro-batch of 2 samples does not split over the mesh's batch axes "
      "(mesh.shape='fsdp=-1' on 4 devices: data x fsdp x expert = 4), so every device would hold whole rows and "
      "all-reduce every matmul output; set micro_batch_size to a multiple of 4 that divides the mini-batch of 4 "
      "(e.g. 4)"
  )


def test_a_micro_batch_that_splits_passes(tmp_path):
  ov = tiny_overrides(tmp_path)
  validate_config(make_config({**ov, "mesh.shape": "fsdp=-1", "micro_batch_size": 4}), num_devices=4)
  validate_config(make_config({**ov, "mesh.shape": "fsdp=2,tensor=2"}), num_devices=4)  # tensor is not a batch axis
  validate_config(make_config(ov), num_devices=1)  # no mesh: one device


def test_the_mesh_over_every_process_is_checked(tmp_path):
  """In a multi-process run the mesh spans every process's devices (`jax.devices()` is global): 2 hosts x 4 chips
  with fsdp=-1 is a batch split of 8, which a micro-batch of 4 (one host's chips) does not meet."""
  c = make_config(tiny_overrides(tmp_path, prompts_per_step=8, **{"mesh.shape": "fsdp=-1"}))
  c.micro_batch_size = 4  # mini-batch 8
  check_micro_batch_split(c, {"fsdp": 4}, 4)
  with pytest.raises(ConfigError, match=r"on 8 devices: data x fsdp x expert = 8\).* \(e\.g\. 8\)$"):
    check_micro_batch_split(c, resolve_mesh_shape(parse_mesh_shape("fsdp=-1"), 8), 8)


def test_no_micro_batch_of_the_mini_batch_splits_then_the_mesh_is_the_fix(tmp_path):
  c = make_config(tiny_overrides(tmp_path, **{"mesh.shape": "data=2,fsdp=4"}))  # mini-batch 4 on a split of 8
  with pytest.raises(ConfigError, match=r"no micro-batch of the mini-batch of 4 samples does: choose a mesh whose"):
    validate_config(c, num_devices=8)


def test_mipu_validation_batch_must_split_too(tmp_path):
  ov = tiny_overrides(tmp_path, **{"mesh.shape": "fsdp=-1", "micro_batch_size": 4, "mipu.rollback": True})
  c = make_config({**ov, "mipu.val_prompts": 1, "mipu.val_group_size": 2})  # 2 validation samples on 4 devices
  with pytest.raises(ConfigError, match=r"^config.mipu.val_prompts: MIPU's validation batch of .* = 2 samples"):
    check_micro_batch_split(c, {"fsdp": 4}, 4)
  c.mipu.val_prompts = 2
  check_micro_batch_split(c, {"fsdp": 4}, 4)


PAPER_CONFIGS = sorted(  # every file of configs/paper/ (the shared settings are minpro_jax/config_lib/paper.py)
    os.path.basename(p)[: -len(".py")] for p in glob.glob(os.path.join(REPO, "configs", "paper", "*.py"))
)


def paper_config(name: str):
  return load_module(os.path.join(REPO, "configs", "paper", f"{name}.py"))


def test_every_paper_config_names_its_slice():
  assert sorted(PAPER_CONFIGS) == ["mipu_qwen3_1p7b", "mipu_qwen3_4b", "qwen3_14b", "qwen3_30b_a3b", "qwen3_8b"]
  for name in PAPER_CONFIGS:
    assert parse_slice(paper_config(name).SLICE).is_tpu


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_configs_split_on_their_slice(name):
  mod = paper_config(name)
  chips = parse_slice(mod.SLICE).num_chips
  for arg in ("mipu", "grpo") if name.startswith("mipu") else ("minpro,2", "grpo,0"):
    c = mod.get_config(arg)
    check_micro_batch_split(c, resolve_mesh_shape(parse_mesh_shape(c.mesh.shape), chips), chips)


def test_qwen3_8b_at_the_old_micro_batch_does_not_split_on_v5p_64():
  """The issue's case: micro-batches of 16 on 32 chips (the batch stayed whole, 2.1 TiB of all-reduce per chip)."""
  c = paper_config("qwen3_8b").get_config()
  assert parse_slice("v5p-64").num_chips == 32 and c.micro_batch_size == 32
  c.micro_batch_size = 16
  with pytest.raises(ConfigError, match=r"micro-batch of 16 samples .* = 32\).* \(e\.g\. 32\)$"):
    check_micro_batch_split(c, {"fsdp": 32}, 32)
