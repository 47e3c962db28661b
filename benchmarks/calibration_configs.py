"""Run configs of the calibration table's workloads (benchmarks/calibration.py): public TPU measurements of work
this codebase compiles with its own model code, at the published shapes.

  python -m minpro_jax.aot --budget --config=benchmarks/calibration_configs.py:<entry> --topology=... ...

Entries (the argument):
  maxtext_llama3.1-8b   a pre-training step of Llama-3.1-8B, as MaxText's `llama3_1_8b_8192` recipes run it:
                        8,192-token rows, `per_device_batch_size` rows per chip (the argument's suffix: `:pdb=3`) in one
                        micro-batch, FSDP over every chip, fp32 weights and bf16 compute, the q/k/v/out projections
                        offloaded to the host (MaxText's "custom" remat policy; ours: `offload`), splash attention
                        (blocks of 1,024: MaxText's 2,048 exceed XLA:TPU's default 32 MiB of scoped VMEM in the
                        backward kernel, which MaxText raises with its DENSE_VMEM_LIMIT flag), AdamW
  jetstream_llama3-8b   JetStream-PyTorch's Llama-3-8B bf16 serving benchmark: 1,024-token prompts, 1,024 new tokens
                        per request, a batch of 128 decode rows, 8-way tensor parallel on a v5e-8 (`:batch=128`)
  jetstream_llama2-7b   the same for Llama-2-7B (multi-head attention: 32 KV heads), a batch of 96 (`:batch=96`)

Architectures are the Hugging Face config.json figures (Meta-Llama-3-8B / Llama-3.1-8B / Llama-2-7b) on the Llama
architecture of `minpro_jax.models` (`architecture="llama"`); weights are never read (the budget compiles abstract
values). The RL-specific parts of the learner (the MinPRO loss on per-token log-probs, the non-finite guard) stay:
the published runs are next-token cross-entropy, a difference the table names.
"""

from ml_collections import ConfigDict

from minpro_jax.config_lib.defaults import base_config

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, qk_norm=False,
                 tie_embeddings=False, architecture="llama", max_position_embeddings=8192)  # fmt: skip
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                 num_kv_heads=32, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-5, qk_norm=False,
                 tie_embeddings=False, architecture="llama", max_position_embeddings=4096)  # fmt: skip
SEQ = 8192  # MaxText's max_target_length of the llama3_1_8b_8192 recipes
PROMPT, NEW = 1024, 1024  # JetStream's max input and output lengths


def _model(c, arch: dict) -> None:
  """`arch` on the Llama architecture of a scratch model whose vocabulary is the tokenizer's size (no files read)."""
  arch = dict(arch)
  c.tokenizer.kind, c.tokenizer.vocab_size = "train_spm", arch.pop("vocab_size")
  c.model.source, c.model.preset = "scratch", "tiny-llama"
  c.model.overrides = ConfigDict(arch)


def _args(arg: str) -> tuple[str, dict[str, int]]:
  name, _, rest = (arg or "").partition(":")
  return name, {k: int(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}


def get_config(arg=None):
  name, kw = _args(arg)
  c = base_config()
  c.mesh.shape = "fsdp=-1"
  c.learner.row_tokens = 0  # one sequence a row, as the published runs
  c.group_size = 1
  if name == "maxtext_llama3.1-8b":
    _model(c, {**LLAMA3_8B, "max_position_embeddings": 131072})
    c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
    c.model.remat, c.model.scan_layers = "offload", True
    c.model.attention_impl, c.model.attn_block_size = "splash", 1024
    chips = kw.get("chips", 8)
    c.prompts_per_step = kw.get("pdb", 3) * chips  # the global batch: one mini-batch, one micro-batch
    c.num_updates_per_step, c.micro_batch_size = 1, c.prompts_per_step
    c.data.max_prompt_tokens, c.sampling.max_new_tokens = 1, SEQ - 1  # rows of SEQ tokens (--lengths=const:8191)
    c.optimizer.warmup_steps = 0
    return c
  if name in ("jetstream_llama3-8b", "jetstream_llama2-7b"):
    _model(c, LLAMA3_8B if name == "jetstream_llama3-8b" else LLAMA2_7B)
    c.model.param_dtype, c.model.dtype, c.sampling.precision = "bfloat16", "bfloat16", "bf16"
    c.model.scan_layers = True
    batch = kw.get("batch", 128)
    c.prompts_per_step = kw.get("requests", 4 * batch)  # requests of one call: four waves of the batch
    c.num_updates_per_step, c.micro_batch_size = 1, 1
    c.data.max_prompt_tokens, c.sampling.max_new_tokens = PROMPT, NEW
    c.sampling.kv_cache, c.sampling.page_size = "paged", 128
    c.sampling.mesh, c.sampling.decode_rows, c.sampling.continuous = "data=1,tensor=8", batch, True
    return c
  raise ValueError(f"calibration config {arg!r}: name one of maxtext_llama3.1-8b, jetstream_llama3-8b, "
                   "jetstream_llama2-7b")  # fmt: skip
