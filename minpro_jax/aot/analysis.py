"""What a compiled program costs per device: memory, FLOPs, bytes, a roofline estimate and its collectives.

Memory is XLA's `compiled.memory_analysis()` (per device, exact for the compiled program, independent of load).
Total = arguments + outputs - aliased (donated) bytes + temporaries; the generated code is reported beside it.

FLOPs: XLA's `cost_analysis()` counts the body of a while loop once, whatever its trip count, and every program
here loops (scanned layers, micro-batches, decode steps), so its figures (`hlo_flops`, `hlo_bytes_accessed`) are
lower bounds. `flops` is therefore the analytic count of `model_flops` (the matmuls of every layer and the LM
head, attention's QK^T and PV, the backward's two, and the forward recomputed by remat), per device assuming the
work splits evenly; `bytes_accessed` scales XLA's bytes by the same loop factor (flops / hlo_flops): an estimate
that assumes a loop body has the program's arithmetic intensity. The roofline time is max(flops / peak FLOP/s,
bytes / HBM bandwidth): an estimate of the best case, not a prediction.

Collectives are read from the optimized HLO text: every all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute (their async `-start` forms counted once, `-done` not), with the bytes of its result. Counts
are static: an op inside a loop body is counted once.
"""

from __future__ import annotations

import re
from typing import Any

from minpro_jax.models.config import ModelConfig

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_OP = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>(?:ragged-)?(?:" + "|".join(COLLECTIVES) + r"))(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")


def array_bytes(dtype: str, dims: str) -> float:
  """Bytes of an HLO array of element type `dtype` ("bf16", "f32", ...) and dimensions `dims` ("128,8,1,128")."""
  size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return size * n


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
  """{op: {"count": n, "bytes": total result bytes}} of the collectives in optimized HLO text (see module doc).

  An async `-start` op's result is a tuple that holds its operand and its result: its largest array is counted.
  """
  out = {op: {"count": 0, "bytes": 0.0} for op in COLLECTIVES}
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    op = m.group("op").removeprefix("ragged-")
    arrays = [array_bytes(d, s) for d, s in _ARRAY.findall(m.group("shape"))]
    out[op]["count"] += 1
    out[op]["bytes"] += (max(arrays) if m.group("start") else sum(arrays)) if arrays else 0.0
  return out


def model_flops(cfg: ModelConfig, program: str, *, rows: int, prompt_len: int, response_len: int, remat: str):
  """Analytic FLOPs of one run of `program` over the whole batch (all devices together).

  Per token, a forward costs 2 * N_matmul (every projection, the active experts' SwiGLUs, the router and the LM
  head) + 4 * layers * q_heads * head_dim * context (QK^T and PV). update = a forward, a backward (2x) and, under
  remat "block", the forward again; score and prefill = a forward; decode = response_len single-token forwards
  against the whole cache (the static sampler attends every slot); sample = prefill + decode of rows requests. Context: causal learner/prefill rows attend
  (T + 1) / 2 positions on average; a decode step attends prompt_len + response_len slots.
  """
  d, hd, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
  attn_proj = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  if cfg.is_moe:
    mlp = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
  else:
    mlp = 3 * d * cfg.intermediate_size
  n_matmul = layers * (attn_proj + mlp) + d * cfg.vocab_size
  attn_per_ctx = 4 * layers * cfg.num_heads * hd

  def forward(tokens: int, context: float) -> float:
    return tokens * (2 * n_matmul + attn_per_ctx * context)

  seq = prompt_len + response_len
  if program == "update":
    return forward(rows * seq, (seq + 1) / 2) * (4 if remat == "block" else 3)
  if program == "score":
    return forward(rows * seq, (seq + 1) / 2)
  if program == "prefill":
    return forward(rows * prompt_len, (prompt_len + 1) / 2)
  if program == "decode":
    return forward(rows * response_len, seq)
  if program == "sample":  # every request's prefill and all its response_len tokens: an upper bound
    return forward(rows * prompt_len, (prompt_len + 1) / 2) + forward(rows * response_len, seq)
  raise ValueError(f"unknown program {program!r}")


def _cost(compiled) -> dict[str, float]:
  ca = compiled.cost_analysis()
  ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
  return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def analyze(compiled, *, hbm_bytes: int, peak_flops: float, hbm_bandwidth: float, flops_total: float, devices: int):
  """The per-device record of a compiled program (module docstring). `hbm_bytes` 0 = unknown (CPU): `fits` None."""
  m = compiled.memory_analysis()
  mem = {
      "argument_bytes": int(m.argument_size_in_bytes),
      "output_bytes": int(m.output_size_in_bytes),
      "alias_bytes": int(m.alias_size_in_bytes),
      "temp_bytes": int(m.temp_size_in_bytes),
      "code_bytes": int(m.generated_code_size_in_bytes),
      "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0) or 0),
  }
  total = mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
  cost = _cost(compiled)
  flops = flops_total / devices
  loop_factor = flops / cost["flops"] if cost["flops"] > 0 else 1.0
  bytes_est = cost["bytes"] * max(loop_factor, 1.0)
  row: dict[str, Any] = {
      **mem,
      "total_bytes": int(total),
      "hbm_bytes": int(hbm_bytes),
      "hbm_fraction": round(total / hbm_bytes, 4) if hbm_bytes else None,
      "fits": (total <= hbm_bytes) if hbm_bytes else None,
      "flops": flops,
      "hlo_flops": cost["flops"],
      "hlo_bytes_accessed": cost["bytes"],
      "bytes_accessed": bytes_est,
  }
  if peak_flops and hbm_bandwidth:
    t_compute, t_memory = flops / peak_flops, bytes_est / hbm_bandwidth
    row.update(
        roofline_seconds=max(t_compute, t_memory),
        roofline_bound="compute" if t_compute >= t_memory else "memory",
    )
  else:
    row.update(roofline_seconds=None, roofline_bound=None)
  row["collectives"] = collectives(compiled.as_text())
  return row


def add_resident(row: dict[str, Any], name: str, nbytes: int, hbm_bytes: int) -> None:
  """Counts `nbytes` per device that stay allocated beside the program while it runs (e.g. MIPU's snapshot of the
  learner state, `minpro_jax.rl.mipu.snapshot`) into the row's `total_bytes`, `hbm_fraction` and `fits`, recorded
  under `name`. `hbm_bytes` 0 = unknown (CPU)."""
  row[name] = int(nbytes)
  row["total_bytes"] = int(row["total_bytes"]) + int(nbytes)
  if hbm_bytes:
    row["hbm_fraction"] = round(row["total_bytes"] / hbm_bytes, 4)
    row["fits"] = row["total_bytes"] <= hbm_bytes


# XLA:TPU's two phrasings: "Used 120.50G of 95.74G hbm" and "HLO temporaries (156.05G) exceeds available HBM"
_TEMP_MESSAGE = re.compile(r"temporaries \(([\d.]+)([KMGT])i?B?\)")
_HBM_MESSAGE = re.compile(r"[Uu]sed\s+([\d.]+)([KMGT]i?B?)\s+of\s+([\d.]+)([KMGT]i?B?)\s+hbm")


def does_not_fit(error: BaseException) -> dict[str, Any] | None:
  """A compile that failed because the program needs more HBM than the chip has, as a report row; else None."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  row: dict[str, Any] = {"fits": False, "error": text.strip().splitlines()[0][:300]}
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  m = _HBM_MESSAGE.search(text)
  if m:
    row["total_bytes"] = int(float(m.group(1)) * scale[m.group(2)[0]])
  m = _TEMP_MESSAGE.search(text)
  if m:
    row["temp_bytes"] = int(float(m.group(1)) * scale[m.group(2)])
  return row
