"""The value domains of the training config's numeric fields that no part checks itself, and the settings under
which a run cannot learn.

`run_config.validate_config` checks most fields against the module that owns them (`SamplingParams`,
`OptimizerConfig`, the objectives, `ModelConfig`, ...). `check_domains` covers the rest, by class:

* integers: their domain (a seed is >= 0: numpy's generators refuse negative seeds; a size or count is >= 1);
* floats: finite, and in their range (a loss coefficient is >= 0, a fraction lies in [0, 1]);
* settings under which every advantage is zero or no update is made, so that a run would go to its end, exit 0,
  and have learnt nothing: greedy sampling of a group (`sampling.top_k=1` or `sampling.top_p=0` with
  `group_size >= 2`: every response of a group is the same, so every group-normalised advantage is 0), a partial
  credit for a wrong answer as large as the credit for a right one (`reward.format_reward >= 1`), and
  `total_steps <= delay` (every rollout is still in the delay buffer at the end).

`tests/test_config_domains.py` walks every numeric field of `configs/default.py` and checks that each
has a refused value (or is listed as taking any value).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

from minpro_jax.errors import ConfigError


class Domain(NamedTuple):
  """The values a config field takes: `kind` ("int" | "float"), `low` <= value (< when `low_open`), value <=
  `high`, or < when `high_open`; checked only when `when(config)` (None = always). `why` ends the message."""

  field: str
  kind: str
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  when: Callable[[Any], bool] | None = None
  why: str = ""


def sft_enabled(c) -> bool:
  """Whether the run warm-starts with SFT: `config.sft.enabled`, or when unset (None, the default) on for a scratch
  model and off for a pretrained one (`model.source` hf or gguf, e.g. a run started from an export)."""
  return bool(c.sft.enabled) if c.sft.enabled is not None else c.model.source == "scratch"


_SFT = sft_enabled

DOMAINS: tuple[Domain, ...] = (
    Domain("seed", "int", 0, why="numpy's generators refuse negative seeds"),
    Domain("eval.seed", "int", 0, why="numpy's generators refuse negative seeds"),
    Domain("data.size", "int", 1, why="the number of problems a generator source draws"),
    Domain("tokenizer.vocab_size", "int", 1),
    Domain("sampling.temperature", "float", 0.0, low_open=True),
    Domain("eval.temperature", "float", 0.0),
    Domain(
        "reward.format_reward",
        "float",
        0.0,
        1.0,
        high_open=True,
        why="it is the credit of a well-formed wrong answer, below the 1.0 of a right one (0 = binary rewards)",
    ),
    Domain("reward.overlong_factor", "float", 0.0),
    Domain("loss.entropy_coef", "float", 0.0, why="0 = off"),
    Domain("loss.kl_coef", "float", 0.0, why="0 = off; a negative coefficient pushes the policy away"),
    Domain("loss.router_aux_coef", "float", 0.0, why="0 = off"),
    Domain("sft.learning_rate", "float", 0.0, 1.0, low_open=True, when=_SFT, why="SFT warm starts use 1e-4 .. 1e-2"),
    Domain("sft.num_examples", "int", 1, when=_SFT),
    Domain("sft.max_len", "int", 2, when=_SFT, why="a prompt token and a target token at least"),
    Domain("sft.boxed_fraction", "float", 0.0, 1.0, when=_SFT, why="a fraction of the SFT targets"),
    Domain("sft.row_tokens", "int", 0, when=_SFT, why="0 = one example per row; else the packed rows' token budget"),
    Domain("learner.row_tokens", "int", 0, why="0 = one sample per row; else the packed rows' token budget"),
    Domain("num_epochs", "int", 1, why="passes over each released batch (PPO epochs; 1 = one pass)"),
    Domain("log.mismatch_every", "int", 1, why="global steps between the sampler-learner mismatch metrics (1 = every)"),
    Domain("sampling.max_sampling_rounds", "int", 1, why="rounds of prompts_per_step prompts a step may sample"),
    Domain("staleness.inflight_every", "int", 1, why="decode steps per segment of the in-flight pool"),
)


def _range(d: Domain) -> str:
  lo = None if d.low is None else f"{'>' if d.low_open else '>='} {d.low:g}"
  hi = None if d.high is None else f"{'<' if d.high_open else '<='} {d.high:g}"
  return " and ".join(x for x in (lo, hi) if x)


def _get(c, field: str) -> Any:
  node = c
  for part in field.split("."):
    node = node[part]
  return node


def _need(cond: bool, field: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"config.{field}: {msg}")


def check_value(d: Domain, value: Any) -> None:
  """Raises ConfigError naming `config.<d.field>` when `value` lies outside `d`."""
  kind = "an int" if d.kind == "int" else "a finite number"
  ok_type = isinstance(value, int) if d.kind == "int" else isinstance(value, (int, float))
  ok = ok_type and not isinstance(value, bool) and math.isfinite(value)
  if ok and d.low is not None:
    ok = value > d.low if d.low_open else value >= d.low
  if ok and d.high is not None:
    ok = value < d.high if d.high_open else value <= d.high
  why = f" ({d.why})" if d.why else ""
  _need(ok, d.field, f"must be {kind} {_range(d)}{why}, got {value!r}")


def check_domains(c) -> None:
  """Checks the fields of `DOMAINS` and the settings under which a run cannot learn (see the module docstring).

  Raises:
    ConfigError: naming `config.<field>` and the fix.
  """
  for d in DOMAINS:
    if d.when is None or d.when(c):
      check_value(d, _get(c, d.field))
  ks = tuple(c.eval.ks)
  _need(bool(ks), "eval.ks", f"must list at least one k in [1, eval.n={c.eval.n}] (pass@k is reported for each)")
  s = c.sampling
  greedy = s.top_k == 1 or s.top_p == 0
  _need(
      not greedy or c.group_size == 1,
      "sampling.top_k" if s.top_k == 1 else "sampling.top_p",
      f"top_k={s.top_k}, top_p={s.top_p} samples greedily: the group_size={c.group_size} responses of a prompt are "
      "all the same, so every group-normalised advantage is 0 and nothing is learnt; use top_k=0 and top_p=1 "
      "(off), or a wider top_k / top_p",
  )
  _need(
      not s.drop_equal_reward_groups or c.group_size >= 2,
      "sampling.drop_equal_reward_groups",
      f"a group of group_size={c.group_size} always has equal rewards, so every group would be dropped; use "
      "group_size >= 2 or turn dynamic sampling off",
  )
  _need(
      c.total_steps > c.delay,
      "total_steps",
      f"{c.total_steps} <= delay={c.delay}: every rollout is still in the delay buffer at the end, so the run makes "
      f"no update; set total_steps > delay (total_steps = delay + the global steps that learn, e.g. "
      f"{c.delay + 10})",
  )
