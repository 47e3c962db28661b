"""Shared settings of the paper-scale configs (Qwen3 on DAPO-Math-17K, TPU/GPU).

Every value marked ASSUMPTION is not given in the sources we could read (the MinPRO paper's full text and
hyper-parameter table were not available to us); they follow common verl/DAPO
recipes and the CPPO re-run of MinPRO (lr 1e-6, no KL, no entropy bonus).
"""

from ml_collections import ConfigDict

from minpro_jax.config_lib.defaults import base_config

DELAYS = (0, 2, 4, 8, 16)


def parse_arg(arg: str | None) -> tuple[str, int]:
  """ "minpro,2" -> ("minpro", 2). Default: MinPRO with delay 2 (the paper's main setting). The method is checked
  with the rest of the config (`run_config.validate_config` names `config.loss.method` and the registry's choices):
  this package imports no JAX, so not the objectives' registry.

  Raises:
    ValueError: a delay that is none of the paper's `DELAYS`.
  """
  method, delay = "minpro", 2
  if arg:
    parts = [p.strip() for p in arg.split(",") if p.strip()]
    if parts:
      method = parts[0]
    if len(parts) > 1:
      delay = int(parts[1])
  if delay not in DELAYS:
    raise ValueError(f"config arg delay {delay}; the paper's settings are {DELAYS}")
  return method, delay


def paper_config(preset: str, hf_path: str, arg: str | None, mesh: str, micro_batch_size: int = 16):
  """The MinPRO paper setting for `preset`; `micro_batch_size` fits the config's slice (its `SLICE`): a multiple of
  the chips, so each micro-batch splits over them (`run_config.check_micro_batch_split`)."""
  method, delay = parse_arg(arg)
  c = base_config()
  c.workdir = f"runs/{preset}_{method}_d{delay}"
  c.total_steps = 300  # ASSUMPTION: global steps
  c.prompts_per_step = 256  # ASSUMPTION: DAPO-style 512 x 16 is common; 256 prompts x G=16
  c.group_size = 16  # ASSUMPTION: rollouts per prompt (8 or 16 in related work)
  c.num_updates_per_step = 16  # from the paper's staleness 32..47 at delay 2 (= d*16 .. d*16+15)
  c.micro_batch_size = micro_batch_size  # memory knob, not an algorithm setting; a multiple of the chips
  c.delay = delay

  c.model.source = "hf"
  c.model.overrides = ConfigDict()  # the architecture is the checkpoint's own
  c.model.path = hf_path  # local folder with config.json + safetensors (Qwen/Qwen3-*-Base)
  c.model.preset = preset  # the same architecture, for compile-only runs without the checkpoint (minpro_jax.aot)
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = "block"
  c.model.attention_impl = "auto"  # blockwise at the papers' lengths (O(T) attention memory)
  c.model.scan_layers = True
  c.tokenizer.kind = "model"

  c.data.source = "file"
  c.data.path = (
      "data/dapo-math-17k.parquet"  # put DAPO-Math-17K here (parquet needs pyarrow) or pass --config.data.path
  )
  c.data.format = "dapo"
  c.data.template = "chat"
  c.data.max_prompt_tokens = 2048
  c.data.num_epochs = 100
  c.reward.mode = "integer"  # DAPO-Math-17K answers are integers
  c.eval.reward_mode = "math"  # the benchmarks have expressions (MATH-500, OlympiadBench, Minerva)

  c.sampling.temperature = 1.0  # ASSUMPTION
  c.sampling.top_p = 1.0  # ASSUMPTION
  c.sampling.max_new_tokens = 20480  # response length up to 20480 (paper)
  c.sampling.precision = "bf16"
  # the KV cache the paper settings' step budgets were measured with (benchmarks/budget_paper.py: dense before,
  # --config.sampling.kv_cache=paged with pages of 128 after): pinned, not the default "auto" (paged) with pages of 16
  c.sampling.kv_cache = "dense"
  c.sampling.page_size = 128

  c.loss.method = method
  c.loss.logprob_chunk_size = 1024
  if method in ("minpro", "cispo"):
    c.loss.eps_high = 0.28  # ASSUMPTION: DAPO's clip-higher; no lower bound (CISPO lineage)
  if method == "grpo":
    c.loss.eps_low, c.loss.eps_high = 0.2, 0.28

  c.optimizer.learning_rate = 1e-6  # ASSUMPTION (CPPO re-run, M2PO scripts)
  c.optimizer.warmup_steps = 10  # ASSUMPTION
  c.optimizer.weight_decay = 0.1  # ASSUMPTION
  c.optimizer.max_grad_norm = 1.0

  c.sft.enabled = False
  c.eval.every = 10
  c.eval.num_problems = 1000
  c.eval.n = 16  # ASSUMPTION: avg@16 (CPPO); pass@k reported up to n
  c.eval.ks = (1, 2, 4, 8, 16)
  c.eval.temperature = 0.7  # ASSUMPTION (CPPO: 0.7 / top-p 0.95)
  c.eval.top_p = 0.95
  c.eval.path = (
      "aime24=aime:data/aime24.jsonl,aime25=aime:data/aime25.jsonl,amc23=amc:data/amc23.jsonl,"
      "math500=math500:data/math500.jsonl,minerva=minerva:data/minerva.jsonl,"
      "olympiadbench=olympiadbench:data/olympiadbench.jsonl,gsm8k=gsm8k:data/gsm8k.jsonl"
  )
  c.checkpoint.every = 5
  c.log.mismatch_every = 10  # the score pass (a forward over every row) only for TIS/MIS or every 10th step's metrics
  c.checkpoint.keep = 3
  c.mesh.shape = mesh
  # packed learner rows of the longest sample (the smallest budget allowed), following the lengths when a config or
  # the command line changes them: responses average ~40 % of it at the papers' lengths, so first fit puts two or
  # three samples in most rows and the update runs ~45 % of the micro-batches it runs unpacked (benchmarks/README.md,
  # "Packed learner rows"); wider rows would pack no better and cost attention over the whole row
  c.learner.row_tokens = c.data.get_ref("max_prompt_tokens") + c.sampling.get_ref("max_new_tokens")
  return c
