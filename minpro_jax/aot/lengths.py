"""Response-length models for the step budget: a seeded draw of one step's N response lengths.

gamma:mean=8192[,shape=2]   gamma(shape, mean / shape), rounded up, clipped to [1, max_new_tokens] (long-tailed,
                            as RL responses are; the clip is what truncation does)
const:20480                 every response that long (clipped to max_new_tokens)
FILE.json / FILE.txt        a list of lengths (JSON list, or integers separated by white space), resampled with
                            replacement to N (taken as is when it has exactly N)
FILE.jsonl / metrics.jsonl  a run's metrics: the newest step's `response/length_quantiles` (11 deciles, logged by
                            the trainer), drawn by inverse-CDF interpolation; a log without them (older runs)
                            falls back to gamma(2) at the newest `response/length_mean`, and says so
"""

from __future__ import annotations

import json
import os

import numpy as np

from minpro_jax.errors import ConfigError


def _kv(text: str, spec: str) -> dict[str, float]:
  out = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    key, sep, value = part.partition("=")
    try:
      out[key.strip()] = float(value) if sep else float(key)
    except ValueError:
      raise ConfigError(f"--lengths={spec}: {part!r} is not key=number (e.g. gamma:mean=8192,shape=2)") from None
  return out


def draw_lengths(spec: str, n: int, max_new_tokens: int, seed: int = 0) -> tuple[np.ndarray, str]:
  """(n int64 response lengths in [1, max_new_tokens], a one-line description of where they came from).

  Raises:
    ConfigError: an unknown model, a bad parameter, or a file that is missing or holds no lengths, naming
      `--lengths`.
  """
  rng = np.random.default_rng(seed)
  clip = lambda x: np.clip(np.ceil(np.asarray(x, float)), 1, max_new_tokens).astype(np.int64)
  kind, _, rest = spec.partition(":")
  if kind == "gamma" and not os.path.exists(spec):
    p = _kv(rest, spec)
    mean, shape = p.get("mean"), p.get("shape", 2.0)
    if not mean or mean <= 0 or shape <= 0 or set(p) - {"mean", "shape"}:
      raise ConfigError(f"--lengths={spec}: write gamma:mean=M[,shape=K] with M, K > 0 (e.g. gamma:mean=8192)")
    lengths = clip(rng.gamma(shape, mean / shape, n))
    return lengths, f"gamma(shape {shape:g}, mean {mean:g}) clipped to [1, {max_new_tokens}], seed {seed}"
  if kind == "const" and not os.path.exists(spec):
    p = _kv(rest, spec)
    value = next(iter(p.values()), None) if len(p) == 1 else None
    if value is None or value < 1:
      raise ConfigError(f"--lengths={spec}: write const:N with N >= 1 (e.g. const:20480)")
    return clip(np.full(n, value)), f"const {int(value)} (clipped to {max_new_tokens})"
  if not os.path.isfile(spec):
    raise ConfigError(
        f"--lengths={spec}: neither a model (gamma:mean=M[,shape=K], const:N) nor a file; give a JSON list or a "
        "run's metrics.jsonl"
    )
  if spec.endswith(".jsonl"):
    return _from_metrics(spec, n, max_new_tokens, rng, seed)
  with open(spec) as f:
    text = f.read()
  try:
    values = json.loads(text) if text.lstrip().startswith("[") else [float(x) for x in text.split()]
    values = np.asarray(values, float).ravel()
  except ValueError:
    raise ConfigError(f"--lengths={spec}: expected a JSON list of lengths or integers separated by spaces") from None
  if values.size == 0 or not np.all(np.isfinite(values)) or values.min() < 1:
    raise ConfigError(f"--lengths={spec}: holds no lengths, or lengths < 1 / not finite")
  picked = values if values.size == n else rng.choice(values, size=n, replace=True)
  return clip(picked), f"{spec} ({values.size} lengths, resampled to {n}, seed {seed})"


def _from_metrics(path: str, n: int, max_new_tokens: int, rng, seed: int) -> tuple[np.ndarray, str]:
  quantiles, mean, step = None, None, None
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec.get("response/length_quantiles"), list):
        quantiles, step = rec["response/length_quantiles"], rec.get("step")
      if isinstance(rec.get("response/length_mean"), (int, float)):
        mean, step = rec["response/length_mean"], rec.get("step") if quantiles is None else step
  clip = lambda x: np.clip(np.ceil(np.asarray(x, float)), 1, max_new_tokens).astype(np.int64)
  if quantiles is not None and len(quantiles) >= 2:
    q = np.asarray(quantiles, float)
    u = rng.uniform(0.0, 1.0, n)
    return clip(np.interp(u, np.linspace(0, 1, q.size), q)), f"{path} step {step} deciles, seed {seed}"
  if mean is None:
    raise ConfigError(f"--lengths={path}: no response/length_quantiles or response/length_mean in this metrics file")
  return (
      clip(rng.gamma(2.0, mean / 2.0, n)),
      f"{path} step {step}: no length deciles logged, gamma(shape 2) at its mean {mean:.0f}, seed {seed}",
  )
