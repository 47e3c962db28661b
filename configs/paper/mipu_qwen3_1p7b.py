# Qwen3-1.7B on DAPO-Math-17K with an FP8 sampler, as in the MIPU paper (TPU/GPU). The variant is the config argument:
#
#   python -m minpro_jax.train --config=configs/paper/mipu_qwen3_1p7b.py:mipu --config.model.path=/ckpt/Qwen3-1.7B
#   ... :grpo | tis | mis | mis_sequence | mis_geometric | lr_decay | step2 | mipu | random
#
# Sized for v5p-8 (4 chips, mesh fsdp=-1): micro_batch_size=16, four sequences per chip; on another slice pass
# --config.micro_batch_size=<a multiple of its chips>: the trainer refuses a micro-batch that does not split.
# Values not known from the paper are marked ASSUMPTION in minpro_jax/config_lib/mipu_paper.py.
"""Qwen3-1.7B MIPU paper-scale config."""

from minpro_jax.config_lib.mipu_paper import mipu_paper_config

SLICE = "v5p-8"  # the TPU slice this config is sized for (micro_batch_size a multiple of its chips)


def get_config(arg=None):
  return mipu_paper_config("qwen3-1.7b", "checkpoints/Qwen3-1.7B", arg)
