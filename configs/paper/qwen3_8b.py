# Qwen3-8B-Base on DAPO-Math-17K, as in the MinPRO paper (TPU/GPU). Method and delay are the config argument:
#
#   python -m minpro_jax.train --config=configs/paper/qwen3_8b.py:minpro,2 --config.model.path=/ckpt/Qwen3-8B-Base
#   python -m minpro_jax.train --config=configs/paper/qwen3_8b.py:grpo,8      # any of minpro|grpo|gspo|gspo_token|cispo|m2po
#                                                                       # with delay 0|2|4|8|16
# Sized for v5p-64 (32 chips, mesh fsdp=-1): micro_batch_size=32 puts one sequence on each chip (the update then
# needs 75.1 GiB per chip with remat keeping the projections' outputs, 22.6 with remat "block", and is compute-bound
# at 1.4x its bound: benchmarks/README.md, "Packed learner rows"; at 16 the batch would not split over 32 chips and every matmul
# output would be all-reduced). On another slice pass --config.micro_batch_size=<a multiple of its chips that
# divides the mini-batch of 256>: the trainer refuses a micro-batch that does not split over the chips.
# Multi-host TPU: run the same command on every worker (launch/tpu_vm.sh). Values not known from the paper are
# marked ASSUMPTION in minpro_jax/config_lib/paper.py. Not runnable on the 2-core CPU machines of this project.
"""Qwen3-8B-Base paper-scale config."""

from minpro_jax.config_lib import paper as _common

SLICE = "v5p-64"  # the TPU slice this config is sized for (micro_batch_size a multiple of its chips)


def get_config(arg=None):
  c = _common.paper_config("qwen3-8b", "checkpoints/Qwen3-8B-Base", arg, mesh="fsdp=-1", micro_batch_size=32)
  # the backward recomputes only the elementwise ops (remat "block" recomputes the whole forward, 4/3 of the FLOPs):
  # 75.1 GiB per chip on v5p-64, 79 % of its HBM; on a slice with less HBM per sequence pass --config.model.remat=block
  c.model.remat = "dots_with_no_batch_dims_saveable"
  # the sampler on its own layout (tensor=8: each chip one of Qwen3-8B's 8 KV heads and 1/8 of the weights, -1 data
  # groups of as many rows as fit) with the paged KV cache (pages of 128 read in place by jax's Pallas paged
  # attention): on v5p-64 an estimated 481 s a step, 1.33x its bound, against ~5.2x for the dense cache
  # (benchmarks/README.md, "The paged sampler in the budget"); --config.sampling.kv_cache=dense for the A/B. On a
  # slice of fewer than 8 chips pass --config.sampling.mesh=auto (v5p-8: tensor=4, 60.1 GB per chip)
  c.sampling.kv_cache = "paged"
  c.sampling.mesh = "data=-1,tensor=8"
  c.sampling.decode_rows = "auto"
  return c
