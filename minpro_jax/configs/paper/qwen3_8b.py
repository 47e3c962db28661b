# Qwen3-8B-Base on DAPO-Math-17K, as in the MinPRO paper (TPU/GPU). Method and delay are the config argument:
#
#   python -m minpro_jax.train --config=minpro_jax/configs/paper/qwen3_8b.py:minpro,2 --config.model.path=/ckpt/Qwen3-8B-Base
#   python -m minpro_jax.train --config=minpro_jax/configs/paper/qwen3_8b.py:grpo,8      # any of minpro|grpo|gspo|gspo_token|cispo|m2po
#                                                                       # with delay 0|2|4|8|16
# Multi-host TPU: run the same command on every worker (launch/tpu_vm.sh). Values not known from the paper are
# marked ASSUMPTION in minpro_jax/configs/paper/common.py. Not runnable on the 2-core CPU machines of this project.
"""Qwen3-8B-Base paper-scale config."""

from minpro_jax.configs.paper import common as _common


def get_config(arg=None):
  c = _common.paper_config("qwen3-8b", "checkpoints/Qwen3-8B-Base", arg, mesh="fsdp=-1")
  return c
