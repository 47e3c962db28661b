"""The overlapped step in the budget: sampling on its own chips, learning on the rest (`config.sampling.devices`).

With `sampling.devices = n` the trainer gives the sampler the last n / P chips of each of the P hosts
(`runtime.device_split.split_devices`) and the learner's mesh (`mesh.shape`) the rest; with delay >= 1 and
`sampling.overlap` a step runs (`minpro_jax.run.step_runner.StepRunner`)

    the weight transfer (the learner's parameters onto the sampler's chips, in its layout and dtype), then
    on the sampler's chips: sampling the step's rollouts      | on the learner's chips: the step's updates
    then on the learner's chips: scoring the new rollouts (it needs them, and the learner's chips are busy until the
    updates end),

so step = transfer + max(sampling, updates) + score; run one after the other on the same split, transfer + sampling
+ score + updates. The host's grading follows the sampling on the sampler's side (forecast only). Here each side is a `Budget` of its own chips (a `SubSlice`): the sampler's programs compiled on
its chips' layout (`sampling.mesh`, decode rows "auto" with no learner state beside them), the learner's score and
update on its mesh over the rest. The transfer is not one program (its source and destination chips differ, which
one XLA program cannot span): its time is the bytes a chip sends or receives over ICI at the chip's ICI rate, an
estimate from arithmetic, beside the programs' estimates from compiled HLO.

A run of several processes cannot split its devices yet (`device_split`: JAX 0.10.2 moves arrays only within one
device set); the rows say so when the slice has several hosts.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

from minpro_jax.aot.budget import Budget, param_bytes, shard_bytes
from minpro_jax.aot.efficiency import LEVELS, constants_for
from minpro_jax.aot.forecast import record
from minpro_jax.aot.topologies import Slice
from minpro_jax.errors import ConfigError
from minpro_jax.runtime.device_split import sampler_device_count, split_devices


@dataclasses.dataclass(frozen=True)
class SubSlice(Slice):
  """Some chips of a slice: `chosen`, `chips_per_host` of each host (its chips in a host's share)."""

  chosen: tuple = ()

  def devices(self) -> list:
    return list(self.chosen)


def sub_slice(sl: Slice, devices, what: str) -> SubSlice:
  """The `SubSlice` of `sl` holding `devices` (the same number on each host)."""
  per_host = len(devices) // max(len({d.process_index for d in devices}), 1)
  return SubSlice(f"{sl.name} ({what}: {len(devices)} chips)", sl.chip, len(devices), sl.topology,
                  (per_host, 1, 1), tuple(devices))  # fmt: skip


def split_step(c, sl: Slice, mesh_spec: str, *, log=lambda s: None, **budget_kw) -> list[dict[str, Any]]:
  """The budget rows of config `c`'s step with `c.sampling.devices` on slice `sl`: the sampler's parts
  ("sampling", "eval" when asked) on its chips, "transfer", the learner's ("score", "update") on the rest with mesh
  `mesh_spec`, then "step (overlapped)" and "step (one after the other)".

  Args:
    budget_kw: `Budget`'s keywords (lengths, prompt_len, seed, parts, dump_hlo, hlo_from); dumps go to
      `<dump_hlo>/sampler` and `<dump_hlo>/learner`.

  Raises:
    ConfigError: `config.sampling.devices` that does not split `sl` (naming it), or as `Budget`.
  """
  devices = sl.devices()
  count = sampler_device_count(c.sampling.devices, len(devices))
  try:
    split = split_devices(count, devices)
  except ValueError as e:
    raise ConfigError(f"config.sampling.devices={c.sampling.devices}: {e}; give each host the same share") from e
  shared = copy.deepcopy(c)  # each side's programs as on shared devices, then laid out on its own chips
  shared.sampling.devices = 0
  parts = tuple(budget_kw.pop("parts"))
  dumps = budget_kw.pop("dump_hlo", None), budget_kw.pop("hlo_from", None)

  def side(name, chips, wanted, sampler_only):
    at = [None if d is None else f"{d}/{name}" for d in dumps]
    sub = sub_slice(sl, chips, name)
    # the sampler's side: its layout over its own chips, no learner state beside it (the learner's parameters,
    # replicated there, are only the abstract input of its weight conversion)
    return Budget(shared, sub, mesh_spec if not sampler_only else "data=-1", parts=wanted, dump_hlo=at[0],
                  hlo_from=at[1], log=lambda s: log(f"{name}: {s}"), sampler_only=sampler_only, **budget_kw)  # fmt: skip

  s_parts = tuple(p for p in parts if p in ("sampling", "eval")) or ("sampling",)
  l_parts = tuple(p for p in parts if p in ("score", "update")) or ("score", "update")
  s_budget = side("sampler", split.sampler, s_parts, True)
  l_budget = side("learner", split.learner, l_parts, False)
  s_rows, l_rows = s_budget.run(), l_budget.run()

  # the transfer: each learner chip sends its parameters' shard (in the sampler's dtype) to every sampler chip
  # that holds a copy; each sampler chip receives its layout's share of the sampler's weights
  prepared = s_budget.progs.prepared_params()
  received = shard_bytes(prepared)
  copies = param_bytes(prepared) and shard_bytes(prepared) * len(split.sampler) / param_bytes(prepared)
  sent = param_bytes(prepared) / len(split.learner) * copies
  ici = sl.chip.ici_bytes_per_s
  t = max(received, sent) / ici if ici else None
  k = constants_for(sl.chip.platform) if ici else None
  transfer = {
      "part": "transfer",
      "shapes": "learner chips -> sampler chips over ICI (arithmetic, not a compiled program)",
      "iterations": 1,
      "seconds_overlapped": t,
      "seconds_serial": t,
      "bound_seconds": t,
      "ratio": 1.0 if t else None,
      "bytes_received_per_sampler_chip": received,
      "bytes_sent_per_learner_chip": sent,
      # the forecast: the same bytes at the link efficiency (the roofline's rate assumes every link busy)
      "forecast": record(t / k.link_efficiency.values(), {"collectives": t / k.link_efficiency.values()}, 0, 1, 1)
      if k is not None
      else None,
  }
  by_part = {r["part"]: r for r in s_rows + l_rows if not r.get("sub")}
  rows = [
      *({**r, "side": "sampler"} for r in s_rows if r["part"] != "step"),
      {**transfer, "side": "both"},
      *({**r, "side": "learner"} for r in l_rows if r["part"] != "step"),
      *({**r, "side": "both"} for r in _steps(by_part, transfer, multi_host=sl.num_hosts > 1)),
  ]
  common = {
      "sampler_chips": len(split.sampler),
      "learner_chips": len(split.learner),
      "sampler_layout": s_rows[0]["sampler_layout"],
      "learner_mesh": l_rows[0]["mesh"],
      "decode_rows": s_rows[0]["decode_rows"],
  }
  base = s_budget._common()  # the config's fingerprint, model, lengths
  return [{**base, **r, **common} if r["side"] == "both" else {**r, **common} for r in rows]


def _steps(part: dict[str, dict], transfer: dict, *, multi_host: bool) -> list[dict]:
  """The overlapped and the sequential step rows from the parts' rows (eval amortised: it runs on its own)."""

  def get(name, key):
    r = part.get(name) or next((v for k, v in part.items() if k.startswith(name)), None)
    return None if r is None or r.get("fits") is False else r.get(key)

  def levels(name):
    f = get(name, "forecast") if name != "transfer" else transfer.get("forecast")
    return None if f is None else np.array([f["seconds"][lvl] for lvl in LEVELS])

  out = []
  for key in ("seconds_overlapped", "seconds_serial", "bound_seconds"):
    s, c, u, t = get("sampling", key), get("score", key), get("update", key), transfer.get(key)
    ev = get("eval", key) or 0.0
    if None in (s, c, u, t):
      out.append((None, None))
      continue
    out.append((t + max(s, u) + c + ev, t + s + c + u + ev))
  s, c, u, t, h = (levels(n) for n in ("sampling", "score", "update", "transfer", "host"))
  ev = levels("eval") if get("eval", "forecast") is not None else 0.0
  h = 0.0 if h is None else h
  forecasts = (None, None) if any(x is None for x in (s, c, u, t)) else (
      t + np.maximum(s + h, u) + c + ev, t + s + h + c + u + ev)  # fmt: skip
  note = "a split needs one process today (runtime/device_split.py): not runnable on this multi-host slice" if (
      multi_host) else ""  # fmt: skip
  rows = []
  for i, name in enumerate(("step (overlapped)", "step (one after the other)")):
    sec, ser, bound = (v[i] for v in out)
    f = forecasts[i]
    rows.append({
        "part": name,
        "seconds_overlapped": sec,
        "seconds_serial": ser,
        "bound_seconds": bound,
        "ratio": sec / bound if sec and bound else None,
        "forecast": None if f is None else record(f, {}, 0, 0, None),
        "note": note,
    })  # fmt: skip
  return rows
