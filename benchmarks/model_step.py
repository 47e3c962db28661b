"""Learner step throughput: our JAX/NNX train step vs Hugging Face transformers (torch CPU), same run.

One training step = forward + backward + AdamW update on a [B, T] batch of random tokens, fp32:

  * ours: `nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)` and an `nnx.jit` step (model and optimizer
    donated) taking `nnx.value_and_grad` of the mean teacher-forced token log-prob loss from
    `minpro_jax.models.token_logprobs` (chunked fp32 log-softmax).
  * baseline "transformers": `LlamaForCausalLM` (or `Qwen3ForCausalLM`) built from the same config, fp32, SDPA
    attention, `labels=tokens` loss, `torch.optim.AdamW(lr=1e-4, weight_decay=1e-4)`, torch threads = XLA's
    CPU threads (os.cpu_count()).

The two sides run in alternation, round by round (`bench_paired`): the transformers step lives in a spawned
child process that sleeps on a pipe while ours runs, so the two frameworks never share a process (torch's
OpenMP threads and XLA's pool slowed each other when interleaved in one process) and both see the machine in
the same minutes; this shared CPU's speed drifts by 25 % and more from one minute to the next, so a ratio of two separate phases
could land anywhere. Reported: best and median per side, the best-vs-best ratio, and the median of the
per-round ratios (`ratio_median_of_paired_rounds`), which a drift between rounds does not move.

Both models are randomly initialised (no weights are loaded). The process first calls
`minpro_jax.runtime.host_memory.keep_freed_host_memory()` (glibc keeps freed blocks mapped; set MINPRO_KEEP_HOST_MEMORY=0
to compare without), which applies to both frameworks alike; minor page faults per step are reported for both. Reported per preset: seconds per step (best and
median of the timed steps), tokens/s, achieved FLOP/s and MFU against this machine's fp32 matmul peak measured in
the same run (best of several large `jnp.dot`, before and after the model steps; the larger is used).

FLOPs per step are counted analytically (PaLM, Chowdhery et al. 2022, app. B):
    flops = tokens * (6 * N_matmul + 12 * L * H * head_dim * T)
with N_matmul = L * (D * head_dim * (2H + 2K) + 3 * D * F) + D * V (every weight that is a matmul operand,
including the LM head; the embedding gather is free), attention counted over the full T x T square. XLA's own
count for the compiled step (`cost_analysis()["flops"]`, which also counts the recomputation of a
checkpointed chunk and elementwise work) is reported next to it.

Usage:
  .venv/bin/python benchmarks/model_step.py                      # tiny + smollm2-135m, B=8, T=256, 5 rounds
  .venv/bin/python benchmarks/model_step.py --presets smollm2-135m --layers 4 --steps 2   # quick look

Prints one JSON object and writes benchmarks/results/model_step.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import time

from minpro_jax.runtime.host_memory import keep_freed_host_memory, minor_page_faults

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
  """nproc, CPU model (from /proc/cpuinfo), load average, library versions and the UTC date."""
  cpu = "unknown"
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  import jax

  info = {
      "nproc": os.cpu_count(),
      "cpu_model": cpu,
      "platform": platform.platform(),
      "loadavg_1m_5m_15m": list(os.getloadavg()),
      "jax": jax.__version__,
      "jax_backend": jax.default_backend(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  return info


def write_result(name: str, result: dict) -> pathlib.Path:
  """Prints `result` as JSON and writes it to benchmarks/results/<name>.json.

  `name` may end in ".json" (not added twice) or be a path (absolute, or relative to benchmarks/results/),
  e.g. `--name /tmp/try1` for a run that should not replace a committed result. Returns the path written.
  """
  path = RESULTS_DIR / (name if name.endswith(".json") else f"{name}.json")
  path.parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps(result, indent=2, sort_keys=False)
  path.write_text(text + "\n")
  print(text)
  return path


def matmul_peak(sizes=(2048, 4096), repeats: int = 5) -> dict:
  """Best fp32 FLOP/s of a square `jnp.dot` per size (default matmul precision)."""
  import jax
  import jax.numpy as jnp

  out = {}
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    out[str(n)] = 2 * n**3 / best
  return out


def analytic_flops(cfg, batch: int, seq: int) -> dict:
  """Training FLOPs of one step by the formula in the module docstring (dense models only)."""
  d, hd, h, k, f = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
  n_layer = d * hd * (2 * h + 2 * k) + 3 * d * f
  n_matmul = cfg.num_layers * n_layer + d * cfg.vocab_size
  tokens = batch * seq
  attn = 12 * cfg.num_layers * h * hd * seq
  return {
      "n_matmul_params": n_matmul,
      "n_params": cfg.num_params(),
      "tokens": tokens,
      "flops_per_token": 6 * n_matmul + attn,
      "flops": tokens * (6 * n_matmul + attn),
      "formula": "tokens * (6 * N_matmul + 12 * L * H * head_dim * T); " "N_matmul = L * (D*hd*(2H+2K) + 3*D*F) + D*V",
  }


def ours_stepper(cfg, batch: int, seq: int, chunk_size: int):
  """Builds and compiles our train step; returns (run_step, info).

  Args:
    cfg: the `ModelConfig` (randomly initialised, seed 0).
    batch, seq: the [B, T] shape of the random int32 token batch every step reuses.
    chunk_size: `token_logprobs` sequence chunk (>= seq: one dense chunk, as in the benchmark's default).

  Returns:
    (run_step, info): run_step() runs one step (forward + backward + AdamW, model and optimizer donated) and
    returns (wall seconds, minor page faults of the process during it, loss as a float); info has
    `compile_s` and `xla_cost_analysis_flops` of the compiled step.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from minpro_jax.models import token_logprobs
  from minpro_jax.models.transformer import init_model

  model = init_model(cfg, seed=0)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

  def loss_fn(m, tokens_bt):
    return -jnp.mean(token_logprobs(m, tokens_bt, chunk_size=chunk_size).logp[:, 1:])

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(m, opt, tokens_bt):
    loss, grads = nnx.value_and_grad(loss_fn)(m, tokens_bt)
    opt.update(m, grads)
    return loss

  tokens = jax.random.randint(jax.random.key(0), (batch, seq), 0, cfg.vocab_size, jnp.int32)
  t0 = time.perf_counter()
  compiled = train_step.lower(model, optimizer, tokens).compile()
  compile_s = time.perf_counter() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", float("nan"))) if cost else float("nan")

  def run_step():
    f0, t0 = minor_page_faults(), time.perf_counter()
    loss = train_step(model, optimizer, tokens)
    loss.block_until_ready()
    return time.perf_counter() - t0, minor_page_faults() - f0, float(loss)

  return run_step, {"compile_s": compile_s, "xla_cost_analysis_flops": xla_flops}


def _timings(info: dict, runs: list) -> dict:
  """`info` plus `step_s` and `minor_page_faults` (one per run) and the last `loss`, from the (seconds, faults,
  loss) tuples that a stepper's run_step returns."""
  return {**info, "step_s": [r[0] for r in runs], "minor_page_faults": [r[1] for r in runs], "loss": runs[-1][2]}


def bench_ours(cfg, batch: int, seq: int, steps: int, chunk_size: int) -> dict:
  """Times our nnx.jit train step in this process: one warm-up, then `steps` >= 1 timed.

  Returns:
    `ours_stepper`'s info plus `step_s` and `minor_page_faults` (one per timed step) and the last `loss`.
  """
  run_step, info = ours_stepper(cfg, batch, seq, chunk_size)
  return _timings(info, [run_step() for _ in range(steps + 1)][1:])


def hf_model(cfg):
  """The transformers (torch CPU) model of `cfg`'s architecture, randomly initialised, fp32, SDPA attention,
  in train mode.

  Raises:
    ValueError: for an architecture without a transformers class here (only llama and qwen3 dense).
  """
  import torch
  import transformers

  torch.manual_seed(0)
  common = dict(
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      rope_theta=cfg.rope_theta,
      rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_position_embeddings,
      attention_bias=False,
  )
  if cfg.architecture == "llama":
    hf_cfg, cls = transformers.LlamaConfig(**common, mlp_bias=False), transformers.LlamaForCausalLM
  elif cfg.architecture == "qwen3":
    hf_cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
  else:
    raise ValueError(f"no transformers baseline for architecture {cfg.architecture!r}")
  hf_cfg._attn_implementation = "sdpa"
  return cls(hf_cfg).float().train()


def transformers_stepper(cfg, batch: int, seq: int, threads: int):
  """Builds the transformers step (`hf_model`, `torch.optim.AdamW`, `labels=tokens` loss).

  Args:
    cfg: the `ModelConfig` whose architecture `hf_model` rebuilds in transformers (torch seed 0).
    batch, seq: the [B, T] shape of the random token batch every step reuses.
    threads: `torch.set_num_threads(threads)`, which applies to the whole process.

  Returns:
    (run_step, info) as `ours_stepper`; info has the torch and transformers versions, the thread count and
    the attention implementation.

  Raises:
    ValueError: from `hf_model`, for an architecture without a transformers class here.
  """
  import torch
  import transformers

  torch.set_num_threads(threads)
  model = hf_model(cfg)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
  tokens = torch.randint(0, cfg.vocab_size, (batch, seq))

  def run_step():
    f0, t0 = minor_page_faults(), time.perf_counter()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, minor_page_faults() - f0, float(loss.detach())

  return run_step, {
      "torch": torch.__version__,
      "transformers": transformers.__version__,
      "torch_threads": torch.get_num_threads(),
      "attn_implementation": "sdpa",
  }


def bench_transformers(cfg, batch: int, seq: int, steps: int, threads: int) -> dict:
  """Times a transformers (torch CPU, fp32, eager) forward + backward + AdamW step of the same model in this
  process: one warm-up, then `steps` >= 1 timed. Returns the same keys as `bench_ours` (info from
  `transformers_stepper`)."""
  run_step, info = transformers_stepper(cfg, batch, seq, threads)
  return _timings(info, [run_step() for _ in range(steps + 1)][1:])


def _transformers_worker(conn, cfg, batch: int, seq: int, threads: int) -> None:
  """Body of the baseline subprocess of `bench_paired`: one step per message received, until None.

  Any exception is sent to the parent as ("error", traceback text) before the process exits.
  """
  import traceback

  try:
    keep_freed_host_memory()
    run_step, info = transformers_stepper(cfg, batch, seq, threads)
    conn.send(info)
    while conn.recv() is not None:
      conn.send(run_step())
  except Exception:  # pylint: disable=broad-except  # reported to the parent, which raises
    conn.send(("error", traceback.format_exc()))


def bench_paired(cfg, batch: int, seq: int, steps: int, chunk_size: int, threads: int) -> tuple[dict, dict]:
  """Ours and transformers in alternation: round r runs one step of each, the first side alternating.

  The transformers step runs in a child process (spawned, so its OpenMP threads and allocator never share
  a process with XLA's), which sleeps on a pipe while ours runs, and the other way round. Both sides see the
  machine in the same minutes, so a drift of this shared CPU's speed lands on both: the per-round ratios
  `paired_ratio` (transformers seconds / ours seconds = ours / transformers tokens/s) are what the medians are
  taken over. One warm-up step per side first.

  Returns:
    (ours, transformers) dicts as `bench_ours` / `bench_transformers` give, each with `step_s` in round order;
    ours also has `paired_ratio`.

  Raises:
    RuntimeError: the baseline process failed (e.g. no transformers class for the preset; its traceback is
      included) or exited.
  """
  import multiprocessing

  run_ours, ours_info = ours_stepper(cfg, batch, seq, chunk_size)
  ctx = multiprocessing.get_context("spawn")
  conn, child_conn = ctx.Pipe()
  proc = ctx.Process(target=_transformers_worker, args=(child_conn, cfg, batch, seq, threads), daemon=True)
  proc.start()
  child_conn.close()  # the child's end lives in the child only, so its death ends our recv with EOFError

  def receive():
    while not conn.poll(1.0):
      if not proc.is_alive():
        raise RuntimeError(f"transformers baseline process exited with code {proc.exitcode} (see its output above)")
    msg = conn.recv()
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
      raise RuntimeError(f"transformers baseline process failed:\n{msg[1]}")
    return msg

  try:
    base_info = receive()

    def run_base():
      conn.send("step")
      return receive()

    run_ours(), run_base()  # warm-up
    ours_runs, base_runs = [], []
    for r in range(steps):
      if r % 2:
        base_runs.append(run_base())
        ours_runs.append(run_ours())
      else:
        ours_runs.append(run_ours())
        base_runs.append(run_base())
    conn.send(None)
    proc.join(timeout=60)
  finally:
    if proc.is_alive():
      proc.kill()
      proc.join()

  ours, base = _timings(ours_info, ours_runs), _timings(base_info, base_runs)
  ours["paired_ratio"] = [b / o for o, b in zip(ours["step_s"], base["step_s"])]
  return ours, base


def summarize(times, flops, tokens, peak) -> dict:
  """Best and median seconds of `times`, and tokens/s, FLOP/s and MFU (against `peak` FLOP/s) at the best."""
  best = min(times)
  return {
      "step_s_best": best,
      "step_s_median": statistics.median(times),
      "tokens_per_s": tokens / best,
      "achieved_flops_per_s": flops / best,
      "mfu": flops / best / peak,
  }


def main(argv=None) -> dict:
  """Runs the benchmark (command-line flags in `argv`), writes results/<name>.json and returns the result."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default="tiny,smollm2-135m")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--steps", type=int, default=5, help="timed steps (paired rounds) after one warm-up step per side")
  p.add_argument("--layers", type=int, default=None, help="override num_layers (quick looks only)")
  p.add_argument("--chunk-size", type=int, default=256, help="token_logprobs chunk_size")
  p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
  p.add_argument(
      "--name", default="model_step", help="results file name, or a path (absolute, or relative to benchmarks/results/)"
  )
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1 (timed rounds after the warm-up), got {args.steps}")
  keep_freed = keep_freed_host_memory()  # before JAX starts its threads; applies to both frameworks

  import jax

  from minpro_jax.models import get_preset

  threads = os.cpu_count()
  result = {
      "benchmark": "model_step",
      "baseline": "transformers (torch CPU eager, fp32, SDPA) fwd+bwd+AdamW",
      "machine": machine_info(),
      "batch": args.batch,
      "seq": args.seq,
      "dtype": "float32",
      "matmul_precision": str(jax.config.jax_default_matmul_precision),
      "xla_cpu_threads": threads,
      "host_memory_keep_freed": keep_freed,
      "presets": {},
  }
  peak_before = matmul_peak()
  for name in args.presets.split(","):
    cfg = get_preset(name) if args.layers is None else get_preset(name, num_layers=args.layers)
    fl = analytic_flops(cfg, args.batch, args.seq)
    if args.no_baseline:
      ours, base = bench_ours(cfg, args.batch, args.seq, args.steps, args.chunk_size), None
    else:
      ours, base = bench_paired(cfg, args.batch, args.seq, args.steps, args.chunk_size, threads)
    result["presets"][name] = {"num_layers": cfg.num_layers, "flops": fl, "ours": ours, "transformers": base}
  peak_after = matmul_peak()
  peak = max(list(peak_before.values()) + list(peak_after.values()))
  result["matmul_peak"] = {
      "before": peak_before,
      "after": peak_after,
      "peak_flops_per_s": peak,
      "method": "best of 5 jnp.dot fp32 NxN, N in (2048, 4096), before and after",
  }
  for name, r in result["presets"].items():
    fl, tok = r["flops"]["flops"], r["flops"]["tokens"]
    r["ours"].update(summarize(r["ours"]["step_s"], fl, tok, peak))
    if r["transformers"] is not None:
      r["transformers"].update(summarize(r["transformers"]["step_s"], fl, tok, peak))
      r["ratio_ours_over_transformers_tokens_per_s"] = r["ours"]["tokens_per_s"] / r["transformers"]["tokens_per_s"]
      r["ratio_median_of_paired_rounds"] = statistics.median(r["ours"]["paired_ratio"])
  result["machine"]["loadavg_end"] = list(os.getloadavg())
  if "smollm2-135m" in result["presets"] and args.layers is None:
    r = result["presets"]["smollm2-135m"]
    result["targets"] = {
        "smollm2_ours_ge_transformers": (r.get("ratio_ours_over_transformers_tokens_per_s") or 0) >= 1.0,
        "smollm2_mfu_ge_0.70": r["ours"]["mfu"] >= 0.70,
    }
  write_result(args.name, result)
  return result


if __name__ == "__main__":
  main()
