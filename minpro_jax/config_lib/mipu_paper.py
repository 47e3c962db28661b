"""Shared settings of MIPU's paper configs (arXiv 2606.29526: Qwen3-1.7B/4B, an FP8 rollout engine).

The sources we could read (the abstract and the project page, `../shared/research/mipu.md` in the project notes)
state w_max = 2, the tolerance values c in {0, +-1e-4}, the models, the benchmarks and the run lengths; every
value marked ASSUMPTION is not stated there. The rest is the MinPRO paper configs' (`common.paper_config`).
"""

from minpro_jax.config_lib import paper as common
from minpro_jax.config_lib.mipu_variants import apply_variant

EVAL_SETS = (
    "math500=math500:data/math500.jsonl,aime24=aime:data/aime24.jsonl,olympiadbench=olympiadbench:"
    "data/olympiadbench.jsonl,minerva=minerva:data/minerva.jsonl,amc23=amc:data/amc23.jsonl"
)


def mipu_paper_config(preset: str, hf_path: str, arg: str | None, mesh: str = "fsdp=-1"):
  """The paper setting for `preset` with the variant `arg` (`minpro_jax.config_lib.mipu_variants.VARIANTS`, default
  mipu). Raises ValueError for an unknown variant."""
  variant = arg or "mipu"
  c = common.paper_config(preset, hf_path, "grpo,0", mesh=mesh)  # on-policy up to the sampler's precision
  apply_variant(c, variant)
  c.workdir = f"runs/mipu_{preset}_{variant}"
  c.total_steps = 800  # the 4B curves run to about step 800 (project page figure)
  c.num_updates_per_step = 4  # ASSUMPTION: mini-batches per iteration (the PPO ratio r = pi_theta / pi_k moves)
  c.data.max_prompt_tokens = 1024  # ASSUMPTION
  c.sampling.max_new_tokens = 8192  # ASSUMPTION: the maximum response length is not stated
  c.loss.eps_low, c.loss.eps_high = 0.2, 0.28  # ASSUMPTION: epsilon is not stated
  c.mipu.gap_tolerance = 1e-4  # the c whose curve tracks "Ours" (the main runs' c is not recovered)
  c.mipu.val_prompts = 64  # ASSUMPTION: the size of D_val is not stated (docs/mipu.md: how large it must be)
  c.mipu.val_group_size = 8  # ASSUMPTION
  c.eval.path = EVAL_SETS  # the paper's five benchmarks
  c.eval.n = 16  # ASSUMPTION: "avg@16 / pass@16" (AIME24 scores are multiples of 1/450, so perhaps not 16 there)
  c.eval.ks = (1, 16)
  return c
