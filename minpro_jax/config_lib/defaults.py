"""The defaults of every config field (ml_collections): the embedded default experiment, a tiny Qwen3-style model
trained from scratch on reasoning-gym arithmetic. `configs/default.py` runs it; every other config builds on it."""

from ml_collections import ConfigDict, config_dict

_unset = config_dict.placeholder  # a typed field that is None until set: "the method's default"

# config.loss fields added by issue 57 (DPPO, CPPO, decoupled PPO, the negative veto), all unset by default: what the
# resume check and the study runner take an older run's absent field for
ISSUE_57_LOSS_FIELDS = (
    "tv_low",
    "tv_high",
    "ratio_cap",
    "tv_delta",
    "tv_position_weight_min",
    "tv_prefix_budget",
    "proximal",
    "behavior_weight_cap",
    "negative_veto",
)


def base_config() -> ConfigDict:
  """Every field the trainer reads, with the defaults a new experiment starts from."""
  c = ConfigDict()
  c.workdir = "runs/default"
  c.seed = 0
  c.total_steps = 40  # global steps (sample -> grade -> buffer -> updates)
  c.prompts_per_step = 64  # B: prompts sampled per global step
  c.group_size = 8  # G: responses per prompt
  c.num_updates_per_step = 4  # n: optimizer updates (mini-batches) per pass over a released batch
  c.num_epochs = 1  # E: PPO epochs, passes over each released batch (E x n updates a step; minpro_jax/rl/epochs.py)
  c.micro_batch_size = 128  # samples per micro-batch of gradient accumulation
  c.delay = 2  # d: global steps between sampling a batch and learning from it

  # How staleness arises (docs/inflight.md). "delay": every batch is sampled whole by one version and learnt from
  # `delay` steps later (the delay buffer). "inflight": the sampler's pool runs on in segments of `inflight_every`
  # decode steps, the parameters move while responses are being generated (PipelineRL-style in-flight updates),
  # each token records the version that drew it; `delay` is then how many batches the sampler runs ahead.
  c.staleness = ConfigDict()
  c.staleness.mode = "delay"  # delay | inflight
  c.staleness.inflight_every = 16  # inflight: decode steps per segment (finished batches checked after each)
  c.staleness.inflight_kv = "keep"  # inflight: keep the live rows' KV from older versions | recompute it
  # inflight: the pool's KV cache in checkpoints ("save") | left out and recomputed for the live rows on resume
  # ("rebuild": ~190 GB less per v5p-64 host at the paper's scale; exact with inflight_kv="recompute" from step d on)
  c.staleness.inflight_checkpoint_kv = "save"

  # learner rows: 0 = one sample per row (prompt bucket + max_new_tokens); N = pack each mini-batch's samples into
  # rows of N tokens (>= data.max_prompt_tokens + sampling.max_new_tokens), first-fit decreasing (docs/learner.md)
  c.learner = ConfigDict()
  c.learner.row_tokens = 0
  c.learner.ess_step = False  # VCPO: each update's step x sqrt(ESS / B) of its sequence ratios (minpro_jax/rl/ess.py)

  c.model = ConfigDict()
  c.model.source = "scratch"  # scratch | hf | gguf
  c.model.path = ""  # HF folder (hf) or .gguf file (gguf; empty = bundled SmolLM2)
  c.model.preset = "tiny"
  c.model.overrides = ConfigDict(
      {"hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
  )
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"
  c.model.remat = "none"  # none | block | dots_saveable | dots_with_no_batch_dims_saveable
  c.model.scan_layers = False
  c.model.attention_impl = "auto"  # auto | xla | blockwise (auto: blockwise from 2,048 tokens on)
  c.model.attn_block_size = 512
  c.model.moe_impl = "ragged"  # ragged | dense (MoE models only: the expert dispatch, for every model.source)

  c.tokenizer = ConfigDict()
  c.tokenizer.kind = "train_spm"  # train_spm | path (HF folder / tokenizer.json / .model / .gguf) | model
  c.tokenizer.path = ""
  c.tokenizer.vocab_size = 384
  c.tokenizer.chat_format = _unset(str)  # unset = the tokenizer's own (qwen3 / smollm2 / plain)

  c.data = ConfigDict()
  c.data.source = "reasoning_gym"  # reasoning_gym | file | champ | tfds
  c.data.task = "chain_sum"
  c.data.task_config = ConfigDict({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
  c.data.size = 20000
  c.data.path = ""  # for source=file: JSONL/JSON/parquet in a published schema
  c.data.format = "auto"
  c.data.tfds_name = ""  # for source=tfds: a dataset built with python -m minpro_jax.data.build_tfds
  c.data.tfds_split = "train"
  c.data.tfds_data_dir = ""  # local folder or gs:// URL holding tfds_name/
  c.data.template = "plain"  # plain | chat
  c.data.max_prompt_tokens = 64
  c.data.num_epochs = 100

  c.sampling = ConfigDict()
  c.sampling.temperature = 1.0
  c.sampling.top_p = 1.0
  c.sampling.top_k = 0
  c.sampling.max_new_tokens = 16
  c.sampling.precision = "fp32"  # fp32 | bf16 | fp8 (simulated; MIPU's inference mismatch)
  # with precision=fp8 only (minpro_jax/models/quant.py): weight scales, FP8 format, activation scales
  c.sampling.fp8_weight_scale = "tensor"  # tensor | channel | block128 (128x128 tiles, DeepSeek-V3 / vLLM block FP8)
  c.sampling.fp8_format = "e4m3"  # e4m3 (max 448) | e5m2 (max 57344)
  c.sampling.fp8_activations = "token"  # token | tensor | none (dynamic scales)
  # DAPO's dynamic sampling: drop groups whose rewards are all equal, sample more prompts (at most this many rounds
  # of prompts_per_step per step) until the batch is full (docs/data.md#rewards-and-grading-rules)
  c.sampling.drop_equal_reward_groups = False
  c.sampling.max_sampling_rounds = 4
  c.sampling.record_routes = False  # MoE: record the experts of every response token (router replay metrics)
  # the decoding engine (minpro_jax/sampling/engines/, docs/sampler.md): "" = the one continuous and kv_cache choose
  # (static without continuous, else continuous on the dense cache or paged); or a registered engine's name
  # (static | continuous | host_refill | paged | your own), with continuous and kv_cache left at their defaults
  c.sampling.engine = ""
  c.sampling.continuous = True  # continuous batching + live-length attention (sampling/continuous.py); False: static
  # the continuous sampler's decode rows (rounded up to a batch bucket), or "auto": as many as the HBM holds beside
  # the resident weights at the configured lengths (sampling/rows.py; 64 on CPU)
  c.sampling.decode_rows = config_dict.FieldReference(64, field_type=object)
  # the sampler's own mesh over the learner's devices (runtime/inference_mesh.py): "" = the learner's mesh and rules;
  # "tensor=4", "data=4,tensor=2" (weights split over tensor, replicated over data), or "auto"
  c.sampling.mesh = ""
  # the sampler's logical-axis rules (runtime/rules.py): "" = the learner's rules on the learner's mesh, "inference"
  # on its own (sampling.mesh); a rule set's name or overrides, e.g. "inference:vocab=" (the vocabulary whole)
  c.sampling.rules = ""
  # the sampler's KV cache (docs/sampler.md#paged-kv): "dense" = prompt bucket + max_new_tokens slots per decode row;
  # "paged" = a pool of pages per layer, allocated as a row grows and freed when it stops (continuous sampler only,
  # sampling/paged_continuous.py); "auto" = paged with the continuous sampler, dense with the static one
  # (run/sampler_setup.resolve_kv_cache). Same responses either way.
  c.sampling.kv_cache = "auto"
  c.sampling.page_size = 16  # paged: tokens per page (16 the fastest on CPU, benchmarks/README.md; TPU: 64-256)
  c.sampling.num_pages = 0  # kv_cache=paged: pages per layer; 0 = auto (the dense cache's memory: no request waits)
  # devices of the sampler's own (runtime/device_split.py): 0 = every device, shared with the learner; a count or a
  # fraction in (0, 1) of the devices (the learner's mesh.shape spans the rest). With delay >= 1 and overlap, step
  # s is sampled while the learner applies step s's updates (minpro_jax/run/step_runner.py); the same samples and updates
  c.sampling.devices = config_dict.FieldReference(0, field_type=object)
  c.sampling.overlap = True  # False: one after the other on the split devices (what the overlapped run equals)

  c.reward = ConfigDict()
  c.reward.mode = "integer"  # integer | math
  c.reward.format_reward = 0.0
  c.reward.overlong_buffer = 0  # > 0: DAPO soft overlong penalty over the last this many tokens of the budget
  c.reward.overlong_factor = 1.0  # the penalty at max_new_tokens
  # DAPO's overlong filtering: truncated samples get no loss (docs/data.md#rewards-and-grading-rules)
  c.reward.mask_truncated = False
  c.advantage_mode = "grpo"  # grpo | drgrpo | rloo

  # Objective hyper-parameters: unset = the method's default (minpro_jax/rl/objectives.py); a field the method
  # does not take must stay unset.
  c.loss = ConfigDict()
  # any registered objective: minpro | grpo | gspo | gspo_token | cispo | m2po | dppo | cppo | decoupled_ppo
  c.loss.method = "minpro"
  c.loss.prefix_statistic = _unset(str)  # minpro: min | mean | geomean | prod | none (default min)
  c.loss.prefix_cap_at_one = _unset(bool)  # minpro: use min(f, 1) as the prefix factor
  c.loss.surrogate = _unset(str)  # minpro: reinforce (default) | ppo
  c.loss.eps_low = _unset(float)  # minpro/cispo: no lower bound; grpo, decoupled_ppo 0.2; gspo 3e-4
  c.loss.eps_high = _unset(float)  # 0.28; gspo 4e-4
  c.loss.dual_clip_c = _unset(float)  # grpo: dual clip c > 1 (default off)
  c.loss.m2_threshold = _unset(float)  # m2po: second-moment budget (default 0.04)
  c.loss.tv_low = _unset(float)  # dppo: Binary-TV threshold where pi falls below mu (default 0.15)
  c.loss.tv_high = _unset(float)  # dppo: Binary-TV threshold where pi rises above mu (default 0.15)
  c.loss.ratio_cap = _unset(float)  # dppo: cap on the detached ratio (default 10)
  c.loss.tv_delta = _unset(float)  # cppo: Binary-TV threshold delta (default 0.2)
  c.loss.tv_position_weight_min = _unset(float)  # cppo: the last token's position weight w_min (default 0.8)
  c.loss.tv_prefix_budget = _unset(float)  # cppo: per-token prefix budget delta_b (default 0.02)
  c.loss.proximal = _unset(str)  # decoupled_ppo: pi_prox from score (default) | interpolate (A-3PO)
  c.loss.behavior_weight_cap = _unset(float)  # decoupled_ppo: truncation of pi_prox / mu (default 2.0)
  c.loss.negative_veto = _unset(float)  # any: mu-GRPO's veto, a ratio > 1 that ends a negative response's loss
  c.loss.loss_agg_mode = _unset(str)  # token-mean; gspo seq-mean-token-mean
  c.loss.rollout_is = _unset(str)  # token | sequence: TIS against the sampler (MIPU step 1: token, cap 2)
  c.loss.tis_cap = 2.0
  c.loss.rollout_mis = _unset(str)  # token | sequence | geometric
  c.loss.rollout_mis_bounds = _unset(tuple)  # (low, high) kept ratio range of rollout_mis (default (0.5, 2.0))
  c.loss.entropy_coef = 0.0
  c.loss.kl_coef = 0.0
  c.loss.router_aux_coef = 0.0
  c.loss.router_replay = False  # MoE: the learner routes every response token to the sampler's experts
  c.loss.logprob_chunk_size = 256

  c.optimizer = ConfigDict()
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  c.optimizer.decay_steps = 0
  c.optimizer.final_lr_ratio = 0.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  c.optimizer.b2 = 0.999
  # LR decay on a response-length surge (arXiv 2602.01826, the LR-decay baseline of MIPU; minpro_jax/rl/lr_decay.py):
  # once a step's mean response length exceeds surge_ratio x the mean of the first baseline_steps steps (step T),
  # the rate is multiplied by decay_factor every int(period_factor * T) global steps, down to min_ratio of it.
  c.optimizer.lr_decay_on_length_surge = False
  c.optimizer.lr_decay_baseline_steps = 50
  c.optimizer.lr_decay_surge_ratio = 3.0
  c.optimizer.lr_decay_period_factor = 1.8
  c.optimizer.lr_decay_factor = 0.5
  c.optimizer.lr_decay_min_ratio = 0.1

  c.sft = ConfigDict()
  # None: on for a scratch model (it cannot answer in format without it), off for a pretrained one
  # (model.source=hf|gguf: SFT on it would overwrite what it already knows); True / False force it
  c.sft.enabled = _unset(bool)
  c.sft.steps = 600
  c.sft.batch_size = 64
  c.sft.learning_rate = 2e-3
  c.sft.num_examples = 8000
  c.sft.max_len = 48
  c.sft.boxed_fraction = 0.5  # half the SFT targets give the bare answer, which the grader does not credit
  c.sft.target = (
      "answer"  # answer: " \\boxed{5}" | worked: " 2-3=-1 ... -4+9=5 \\boxed{5}" (traced tasks: data/worked.py)
  )
  c.sft.row_tokens = 0  # 0 = one example per row (max_len); N >= max_len: pack each step's examples into rows of N
  c.sft.cache_dir = "cache"

  # MIPU Step 2 (arXiv 2606.29526; minpro_jax/rl/mipu.py): after each step's updates, sample validation prompts with the
  # new parameters at sampling.precision and keep the updates only if T_post >= -gap_tolerance. Pair with
  # sampling.precision=fp8 and loss.rollout_is=token (Step 1). Costs one extra generation + scoring per step and a
  # copy of params + optimizer state.
  c.mipu = ConfigDict()
  c.mipu.rollback = False
  c.mipu.gap_tolerance = 1e-4  # c in "accept iff T_post >= -c" (the paper sweeps 0, +1e-4, -1e-4)
  c.mipu.val_prompts = 8  # fresh training prompts per check (a pure function of seed and step)
  c.mipu.val_group_size = 4  # samples per validation prompt (group-normalised advantages need >= 2)
  c.mipu.mode = "gap"  # gap: the T_post test | random: roll back with probability random_rate (the ablation)
  c.mipu.random_rate = _unset(float)  # mode=random: the rollback probability; unset = the rate of match_rate_of
  c.mipu.match_rate_of = ""  # mode=random: a finished run's workdir (or a sibling of this one); its rollback rate
  c.mipu.ground_truth = False  # gap: also sample the validation prompts at fp32 and log J(mu') - J(pi')
  # gap: the statistic tested against -c: t_post (the paper: T at the new weights) | delta_t (T(theta') - T(theta_k),
  # the same prompts and seed) | delta_j (J(mu') - J(mu_k), paired rewards); the deltas sample at theta_k too
  c.mipu.statistic = "t_post"
  c.mipu.tolerance = "fixed"  # fixed: c = gap_tolerance | calibrated: c from draws of T at the first check's start
  c.mipu.calibration_draws = 8  # tolerance=calibrated: validation draws of T at the starting weights
  c.mipu.calibration_z = 2.0  # tolerance=calibrated: accept T_post >= mean - z * sd of those draws

  c.eval = ConfigDict()
  c.eval.every = 10  # global steps; 0 = only at start and end
  c.eval.num_problems = 200
  c.eval.n = 4  # samples per problem (pass@1 = avg@n)
  c.eval.ks = (1, 4)
  c.eval.temperature = 1.0
  c.eval.top_p = 1.0
  c.eval.seed = 12345  # held-out problems come from a different generator seed
  c.eval.path = ""  # benchmark files "name=fmt:path,name2=fmt:path2"; for data.source file/champ,
  # empty = hold out min(num_problems, 20%) of the training problems
  c.eval.reward_mode = _unset(str)  # unset = reward.mode; "math" for MATH-500 / OlympiadBench-style answers

  c.checkpoint = ConfigDict()
  c.checkpoint.every = 10  # global steps; also on SIGTERM / SIGINT and after the last step (0 = only then)
  c.checkpoint.keep = 2

  c.mesh = ConfigDict()
  c.mesh.shape = ""  # "" = one device; e.g. "data=2,fsdp=4" (must multiply to the device count)
  # the learner's logical-axis rules (runtime/rules.py): "" = "default"; a rule set's name, or overrides on it, e.g.
  # "default:mlp=fsdp,q_heads=fsdp,kv_heads=fsdp" (docs/aot.md: a sharding sweep varies this)
  c.mesh.rules = ""

  c.log = ConfigDict()
  c.log.tensorboard = True
  c.log.plots = True
  c.log.progress = True
  # global steps between the sampler-learner mismatch metrics (sampler_learner/*, logged at steps s % N == 0). The
  # learner's score pass (one forward over the step's batch) runs only on those steps unless the loss reads its
  # log-probs (loss.rollout_is / rollout_mis: then every step). 1 = every step: per-step curves, and the metric at
  # the same steps as in runs before this field; the paper configs use 10 (docs/configs.md#logging)
  c.log.mismatch_every = 1
  return c


def get_config() -> ConfigDict:
  return base_config()
