"""Every numeric field of the training config has a domain that `validate_config` enforces, naming the field; and
the settings under which a run would learn nothing are refused up front (minpro_jax/run/config_domains.py).

The table holds, for each numeric field of `configs/default.py`, values outside its domain; a field
that takes any value of its type says why instead. `test_every_numeric_field_is_in_the_table` keeps the table
complete: a field added to the config without a domain fails it.
"""

import math

import pytest
from train_helpers import load_default_config, make_config, tiny_overrides

from minpro_jax.errors import ConfigError
from minpro_jax.run.config_domains import DOMAINS, Domain, check_value
from minpro_jax.run.run_config import validate_config

INF, NAN = math.inf, math.nan
# field -> (bad values, extra overrides that make the field matter). Checked with the tiny config.
BAD: dict[str, tuple[tuple, dict]] = {
    "seed": ((-1,), {}),
    "total_steps": ((0, -1), {}),
    "prompts_per_step": ((0, -2), {}),
    "group_size": ((0,), {}),
    "num_updates_per_step": ((0, 3), {}),
    "micro_batch_size": ((0, 3), {}),
    "delay": ((-1,), {}),
    "model.attn_block_size": ((0,), {}),
    "tokenizer.vocab_size": ((0,), {}),
    "data.size": ((0, -5), {}),
    "data.max_prompt_tokens": ((0,), {}),
    "data.num_epochs": ((0,), {}),
    "sampling.temperature": ((0.0, -1.0, INF, NAN), {}),
    "sampling.top_p": ((1.5, NAN), {}),
    "sampling.top_k": ((-1,), {}),
    "sampling.max_new_tokens": ((0,), {}),
    "sampling.decode_rows": ((0, -1), {}),
    "sampling.page_size": ((0, -1), {}),
    "sampling.num_pages": ((-1, 4), {"sampling.kv_cache": "paged", "sampling.page_size": 8}),  # 37 tokens: 5 pages
    "sampling.devices": ((-1, 1, 1.5, 0.1), {}),  # of 1 device: none left to the learner, a fraction giving 0
    "reward.format_reward": ((1.0, 2.0, -0.5, INF, NAN), {}),
    "reward.overlong_buffer": ((-1, 7), {}),  # above sampling.max_new_tokens=6
    "reward.overlong_factor": ((-1.0, INF, NAN), {}),
    "loss.eps_low": ((1.5, -0.1), {"loss.method": "grpo"}),
    "loss.eps_high": ((-0.1,), {"loss.method": "grpo"}),
    "loss.dual_clip_c": ((0.5,), {"loss.method": "grpo"}),
    "loss.m2_threshold": ((-1.0,), {"loss.method": "m2po"}),
    "loss.tv_low": ((-0.1, NAN), {"loss.method": "dppo"}),
    "loss.tv_high": ((-0.1, NAN), {"loss.method": "dppo"}),
    "loss.ratio_cap": ((0.0, -1.0, NAN), {"loss.method": "dppo"}),
    "loss.tv_delta": ((0.0, -0.1, NAN), {"loss.method": "cppo"}),
    "loss.tv_position_weight_min": ((0.0, 1.5, NAN), {"loss.method": "cppo"}),
    "loss.tv_prefix_budget": ((-0.01, NAN), {"loss.method": "cppo"}),
    "loss.behavior_weight_cap": ((0.0, -1.0, NAN), {"loss.method": "decoupled_ppo"}),
    "loss.negative_veto": ((1.0, 0.5, NAN), {"loss.method": "grpo"}),
    "num_epochs": ((0, -1), {}),
    "loss.tis_cap": ((0.0, NAN), {"loss.rollout_is": "token"}),
    "loss.entropy_coef": ((-0.1, INF, NAN), {}),
    "loss.kl_coef": ((-0.1, INF, NAN), {}),
    "loss.router_aux_coef": ((-0.1, NAN), {}),
    "loss.logprob_chunk_size": ((0,), {}),
    "optimizer.learning_rate": ((0.0, 2.0, INF, NAN), {}),
    "optimizer.warmup_steps": ((-1,), {}),
    "optimizer.decay_steps": ((-1,), {}),
    "optimizer.final_lr_ratio": ((-0.1, 1.5), {}),
    "optimizer.weight_decay": ((-0.1, NAN), {}),
    "optimizer.max_grad_norm": ((-1.0, NAN), {}),
    "optimizer.b2": ((1.0, 1.5), {}),
    "optimizer.lr_decay_baseline_steps": ((0,), {}),
    "optimizer.lr_decay_surge_ratio": ((1.0,), {}),
    "optimizer.lr_decay_period_factor": ((0.0,), {}),
    "optimizer.lr_decay_factor": ((0.0, 1.5), {}),
    "optimizer.lr_decay_min_ratio": ((-0.1, 1.5), {}),
    "sft.steps": ((0,), {}),
    "sft.batch_size": ((0,), {}),
    "sft.learning_rate": ((0.0, 2.0, INF), {}),
    "sft.num_examples": ((0,), {}),
    "sft.max_len": ((0, 1), {}),
    "sft.row_tokens": ((-1, 1), {}),  # negative; below sft.max_len
    "sft.boxed_fraction": ((-0.1, 1.5, NAN), {}),
    "mipu.gap_tolerance": ((NAN, INF), {"mipu.rollback": True}),
    "mipu.val_prompts": ((0,), {"mipu.rollback": True}),
    "mipu.val_group_size": ((1,), {"mipu.rollback": True}),
    "mipu.random_rate": ((-0.1, 1.5), {"mipu.rollback": True, "mipu.mode": "random"}),
    "eval.every": ((-1,), {}),
    "eval.num_problems": ((0,), {}),
    "eval.n": ((0,), {}),
    "eval.ks": (((), (0,), (3,), (1, 1)), {}),  # eval.n=2 in the tiny config
    "eval.temperature": ((-1.0, INF, NAN), {}),
    "eval.top_p": ((0.0, 1.5), {}),
    "eval.seed": ((-1,), {}),
    "checkpoint.every": ((-1,), {}),
    "checkpoint.keep": ((0,), {}),
    "log.mismatch_every": ((0, -1), {}),
    "learner.row_tokens": ((-1, 37), {}),  # below data.max_prompt_tokens + sampling.max_new_tokens = 38
    "sampling.max_sampling_rounds": ((0, -1), {}),
    "staleness.inflight_every": ((0, -4), {}),
    "mipu.calibration_draws": ((1, 0), {"mipu.rollback": True, "mipu.tolerance": "calibrated"}),
    "mipu.calibration_z": ((NAN, INF), {"mipu.rollback": True, "mipu.tolerance": "calibrated"}),
}
# Numeric fields with no refused value, and why; and the groups whose fields their owner checks.
ANY_VALUE = {
    "loss.rollout_mis_bounds": "a pair checked as a pair (test_config.py)",
}
OWNED_GROUPS = ("model.overrides.", "data.task_config.")  # ModelConfig / reasoning-gym check these (test_config.py)


def _numeric_fields(c, prefix=""):
  out = []
  for k in c.keys():
    v, path = c[k], f"{prefix}{k}"
    if hasattr(v, "keys"):
      out += _numeric_fields(v, path + ".")
    elif isinstance(v, (int, float, tuple)) and not isinstance(v, bool):
      out.append(path)
    elif v is None and c.get_type(k) in (int, float, tuple):  # an unset placeholder: the method's default
      out.append(path)
  return out


def test_every_numeric_field_is_in_the_table():
  fields = [f for f in _numeric_fields(load_default_config()) if not f.startswith(OWNED_GROUPS)]
  missing = [f for f in fields if f not in BAD and f not in ANY_VALUE]
  assert not missing, f"numeric config fields without a refused value in BAD (or a reason in ANY_VALUE): {missing}"
  assert len(fields) > 50


@pytest.mark.parametrize(
    "field, value, extra", [(f, v, extra) for f, (values, extra) in BAD.items() for v in values], ids=repr
)
def test_a_value_outside_the_domain_is_refused_naming_the_field(tmp_path, field, value, extra):
  ov = tiny_overrides(tmp_path, **extra)
  ov[field] = value
  with pytest.raises(ConfigError) as e:
    validate_config(make_config(ov), num_devices=1)
  group = field.rsplit(".", 1)[0] if "." in field else field
  # the message names the field (a few checks name the pair or the group they check together)
  assert str(e.value).startswith((f"config.{field}", f"config.{group}:", "config.num_updates_per_step")), str(e.value)


def test_the_domains_accept_their_edges(tmp_path):
  c = make_config(tiny_overrides(tmp_path))
  for d in DOMAINS:
    for edge in (d.low, d.high):
      open_ = d.low_open if edge == d.low else d.high_open
      if edge is None or open_:
        continue
      check_value(d, int(edge) if d.kind == "int" else float(edge))  # a closed end is in the domain
  validate_config(c, num_devices=1)


def test_check_value_messages():
  d = Domain("reward.format_reward", "float", 0.0, 1.0, high_open=True, why="a credit")
  with pytest.raises(ConfigError, match=r"^config.reward.format_reward: must be a finite number >= 0 and < 1 \(a cre"):
    check_value(d, 1.0)
  with pytest.raises(ConfigError, match="must be an int >= 0"):
    check_value(Domain("seed", "int", 0), 1.5)
  with pytest.raises(ConfigError, match="got True"):
    check_value(Domain("seed", "int", 0), True)


@pytest.mark.parametrize(
    "ov, field, words",
    [
        ({"sampling.top_k": 1}, "sampling.top_k", "every group-normalised advantage is 0"),
        ({"sampling.top_p": 0.0}, "sampling.top_p", "every group-normalised advantage is 0"),
        ({"total_steps": 1, "delay": 1}, "total_steps", "makes no update"),
        ({"total_steps": 2, "delay": 5}, "total_steps", "set total_steps > delay"),
        ({"reward.format_reward": 1.0}, "reward.format_reward", "below the 1.0 of a right one"),
    ],
)
def test_settings_that_learn_nothing_are_refused(tmp_path, ov, field, words):
  with pytest.raises(ConfigError, match=rf"^config\.{field}: .*{words}"):
    validate_config(make_config(tiny_overrides(tmp_path, **ov)), num_devices=1)


def test_greedy_sampling_is_fine_for_groups_of_one(tmp_path):
  ov = tiny_overrides(tmp_path, group_size=1, prompts_per_step=4, micro_batch_size=2, **{"sampling.top_k": 1})
  validate_config(make_config(ov), num_devices=1)
