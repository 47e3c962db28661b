# Qwen3-14B-Base on DAPO-Math-17K, as in the MinPRO paper (TPU/GPU). Method and delay are the config argument:
#
#   python -m minpro_jax.train --config=configs/paper/qwen3_14b.py:minpro,2 --config.model.path=/ckpt/Qwen3-14B-Base
#   python -m minpro_jax.train --config=configs/paper/qwen3_14b.py:grpo,8      # any of minpro|grpo|gspo|gspo_token|cispo|m2po
#                                                                       # with delay 0|2|4|8|16
# Sized for v5p-16 (8 chips, mesh fsdp=-1): micro_batch_size=16 puts two sequences on each chip (the update: 88.2
# GiB per chip, benchmarks/results/aot/qwen3_14b_v5p-16_learner.json). On another slice pass
# --config.micro_batch_size=<a multiple of its chips that divides the mini-batch of 256>: the trainer refuses a
# micro-batch that does not split over the chips.
# Multi-host TPU: run the same command on every worker (launch/tpu_vm.sh). Values not known from the paper are
# marked ASSUMPTION in minpro_jax/config_lib/paper.py. Not runnable on the 2-core CPU machines of this project.
"""Qwen3-14B-Base paper-scale config."""

from minpro_jax.config_lib import paper as _common

SLICE = "v5p-16"  # the TPU slice this config is sized for (micro_batch_size a multiple of its chips)


def get_config(arg=None):
  c = _common.paper_config("qwen3-14b", "checkpoints/Qwen3-14B-Base", arg, mesh="fsdp=-1", micro_batch_size=16)
  return c
