"""The off-policy RL trainer: sample -> grade -> delay buffer -> updates, with exact staleness and exact resume.

One global step s:
  1. take the next prompt batch (B prompts) from the data iterator;
  2. sample G responses per prompt with the sampler from the newest parameters (version v = updates so far),
     recording the sampler's behavior log-probs and v per sample; score the same tokens with the learner
     at v (training-precision log-probs, for mismatch metrics and TIS/MIS);
  3. grade the responses and compute group advantages (by explicit group ids);
  4. push the batch into the `RolloutBuffer`, pop the batch pushed at step s - delay (none during the first
     `delay` steps: the buffer fills and no update happens), split it into `num_updates_per_step` mini-batches
     and take one optimizer update on each (micro-batch accumulation inside).
  5. with `config.mipu.rollback` (MIPU Step 2, `minpro_jax.rl.mipu`): sample validation prompts with the updated
     parameters at the sampler's precision, compute T_post, and roll the step's updates back (parameters,
     optimizer state, counters) when T_post < -gap_tolerance.
A sample consumed by update j of a step therefore has staleness delay * n + j once the buffer has been full
for `delay` steps (the paper's d = 2, n = 16: 32..47). The first `delay` consumed batches were sampled before
any update and have staleness (s - delay) * n + j instead; their staleness is logged like every other.

Randomness is a pure function of (seed, global step), and checkpoints hold parameters, optimizer state,
counters, the data iterator state and the waiting rollout batches, so a run killed at any point and re-run with
the same command continues exactly as if it had never stopped (tests/test_train_resume.py).
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minpro_jax import run_config
from minpro_jax.checkpoint import RunCheckpointer, buffer_state_from_restored
from minpro_jax.data import ProblemLoader, encode_prompts, format_prompt
from minpro_jax.data.rewards import grade
from minpro_jax.metrics_log import MetricsWriter, plot_run, write_summary
from minpro_jax.rl import mipu
from minpro_jax.rl.advantages import group_advantages
from minpro_jax.rl.aggregation import inference_gap_t_post
from minpro_jax.rl.learner import Learner, staleness
from minpro_jax.rl.objectives import mismatch_metrics
from minpro_jax.rl.rollout import RolloutBatch, RolloutBuffer
from minpro_jax.runtime.sharding import make_mesh, use_mesh
from minpro_jax.sampling import Sampler, SamplingParams

logger = logging.getLogger(__name__)


class Trainer:
  """Builds everything from a config (see minpro_jax/configs/default.py) and runs training with `run()`.

  Raises:
    run_config.ConfigError: invalid config (raised before any expensive work).
  """

  def __init__(self, config):
    run_config.validate_config(config)
    self.c = c = config
    if c.total_steps <= c.delay:
      logger.warning(
          "total_steps=%d <= delay=%d: every rollout is still in the delay buffer at the end, so the run "
          "makes no update",
          c.total_steps,
          c.delay,
      )
    self.workdir = os.path.abspath(c.workdir)
    try:
      os.makedirs(self.workdir, exist_ok=True)
      with tempfile.TemporaryFile(dir=self.workdir):
        pass
    except OSError as e:
      raise run_config.ConfigError(
          f"config.workdir: cannot write to {self.workdir} ({e.strerror or e}); choose a "
          "writable directory, e.g. --config.workdir=runs/my_run"
      ) from e
    shape = run_config.parse_mesh_shape(c.mesh.shape)
    self.mesh = make_mesh(shape) if shape else None
    t0 = time.time()
    from minpro_jax.run_setup import build_model_and_tokenizer

    self.problems, self.eval_sets = run_config.train_and_eval_problems(c)
    run_config.check_mipu_problem_count(c, len(self.problems))  # before the tokenizer and SFT
    self.ckpt = RunCheckpointer(self.workdir, keep=c.checkpoint.keep)
    resuming = self.ckpt.latest_step() is not None  # the checkpoint holds the weights: no SFT needed
    self.model, self.tokenizer, self.sft_info = build_model_and_tokenizer(
        c, self.problems, self.mesh, self.workdir, skip_sft=resuming
    )
    self.model_config = self.model.config
    self.train_problems, self.prompt_ids = self._encode(self.problems)
    self.eval_sets = self._fit_eval_sets(self.eval_sets)
    run_config.check_mipu_problem_count(c, len(self.train_problems))  # after prompts too long were dropped
    self.loader = ProblemLoader(self.train_problems, c.prompts_per_step, seed=c.seed, num_epochs=c.data.num_epochs)
    self.sampling = SamplingParams(
        temperature=float(c.sampling.temperature),
        top_k=int(c.sampling.top_k) or None,
        top_p=float(c.sampling.top_p) if c.sampling.top_p < 1.0 else None,
        max_new_tokens=int(c.sampling.max_new_tokens),
        stop_token_ids=tuple(int(i) for i in self.tokenizer.stop_ids),
    )
    self.sampler = Sampler(
        self.model_config,
        precision=c.sampling.precision,
        mesh=self.mesh,
        pad_id=max(self.tokenizer.pad_id, 0),
        prompt_buckets=_prompt_buckets(c.data.max_prompt_tokens),
    )
    mb = min(c.micro_batch_size, c.prompts_per_step * c.group_size // c.num_updates_per_step)
    self.learner = Learner(
        self.model, run_config.loss_config(c), run_config.optimizer_config(c), micro_batch_size=mb, mesh=self.mesh
    )
    self.setup_seconds = time.time() - t0
    self._stop_signal: int | None = None

  # ------------------------------------------------------------------ helpers
  def _mesh(self):
    return use_mesh(self.mesh)

  def _encode_fitting(self, problems, what: str):
    """`encode_prompts` at data.max_prompt_tokens; a warning counts the prompts skipped as too long."""
    enc = encode_prompts(
        problems, self.tokenizer, max_prompt_tokens=self.c.data.max_prompt_tokens, template=self.c.data.template
    )
    if enc.skipped:
      logger.warning(
          "%s: skipped %d of %d problems longer than data.max_prompt_tokens=%d",
          what,
          len(enc.skipped),
          len(problems),
          self.c.data.max_prompt_tokens,
      )
    return enc

  def _encode(self, problems):
    enc = self._encode_fitting(problems, "training set")
    if len(enc.problems) < self.c.prompts_per_step:
      raise run_config.ConfigError(
          f"config.data: {len(enc.problems)} training problems are left ({len(problems)} after removing the held-out "
          f"prompts, {len(enc.skipped)} of them longer than data.max_prompt_tokens={self.c.data.max_prompt_tokens}), "
          f"fewer than prompts_per_step={self.c.prompts_per_step}; use more data, a larger max_prompt_tokens or a "
          "smaller prompts_per_step"
      )
    return enc.problems, {p.id: ids for p, ids in zip(enc.problems, enc.token_ids)}

  def _fit_eval_sets(self, eval_sets):
    """Held-out sets without the prompts longer than data.max_prompt_tokens (the sampler cannot take them)."""
    out = {}
    for name, problems in eval_sets.items():
      enc = self._encode_fitting(problems, f"held-out set {name}")
      if not enc.problems:
        raise run_config.ConfigError(
            f"config.data.max_prompt_tokens: no prompt of held-out set {name!r} fits in "
            f"{self.c.data.max_prompt_tokens} tokens; raise it"
        )
      out[name] = list(enc.problems)
    return out

  def _step_seed(self, step: int, salt: int) -> int:
    return int(np.random.SeedSequence([self.c.seed, step, salt]).generate_state(1)[0])

  def _prompt_text(self, problem) -> str:
    return format_prompt(problem, self.tokenizer, self.c.data.template)

  def generate_texts(self, params, prompts: list[str], n: int, seed: int, *, temperature: float, top_p: float):
    """`evaluation.evaluate`'s generate_fn: n decoded responses per prompt text."""
    add_bos = self.c.data.template == "plain"
    ids = [self.tokenizer.encode(p, add_bos=add_bos) for p in prompts]
    sp = SamplingParams(
        temperature=temperature,
        top_p=top_p if top_p < 1.0 else None,
        max_new_tokens=self.sampling.max_new_tokens,
        stop_token_ids=self.sampling.stop_token_ids,
    )
    with self._mesh():
      gen = self.sampler.generate(params, ids, sp, seed, group_size=n)
    texts = self._decode(gen)
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

  def _grade(self, gen, problems, group_size: int):
    """Texts, float32 rewards, grading stats and group advantages of a generated batch (prompt-major rows)."""
    c = self.c
    texts = self._decode(gen)
    golds = [p.answer for p in problems for _ in range(group_size)]
    rewards, gstats = grade(
        texts, golds, mode=c.reward.mode, format_reward=c.reward.format_reward, truncated=list(gen.truncated)
    )
    rewards = np.asarray(rewards, np.float32)
    adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(gen.group_ids), mode=c.advantage_mode))
    return texts, rewards, gstats, adv

  def _decode(self, gen) -> list[str]:
    return [self.tokenizer.decode(t[m].tolist()) for t, m in zip(gen.response_tokens, gen.response_mask)]

  def evaluate(self, params, step: int, name: str) -> dict[str, Any]:
    from minpro_jax.evaluation import evaluate

    e = self.c.eval
    with self._mesh():
      params = self.sampler.prepare_params(params)  # converted once for all of the evaluation's batches
    fn = lambda prompts, n, seed: self.generate_texts(
        params, prompts, n, seed, temperature=e.temperature, top_p=e.top_p  # noqa: E731
    )
    res = evaluate(
        fn,
        self.eval_sets,
        n=e.n,
        ks=tuple(e.ks),
        prompt_fn=self._prompt_text,
        seed=e.seed + step,
        batch_size=max(1, 256 // e.n),
        modes=e.reward_mode or self.c.reward.mode,
        out_dir=os.path.join(self.workdir, "eval"),
        name=name,
    )
    return res

  # ------------------------------------------------------------------ one global step
  def sample_step(self, state, step: int) -> tuple[RolloutBatch, dict[str, Any]]:
    """Steps 1-3 of the module docstring for global step `step`; returns the rollout batch and its metrics."""
    c = self.c
    t0 = time.time()
    problems = next(self.loader)
    version = int(state.step)
    group_ids = step * c.prompts_per_step + np.arange(len(problems))
    with self._mesh():
      gen = self.sampler.generate(
          state.params,
          [self.prompt_ids[p.id] for p in problems],
          self.sampling,
          self._step_seed(step, 1),
          group_size=c.group_size,
          group_ids=group_ids,
          policy_version=version,
      )
    arrays = gen.to_learner_arrays()
    t1 = time.time()
    texts, rewards, gstats, adv = self._grade(gen, problems, c.group_size)
    t2 = time.time()
    with self._mesh():
      learner_logp = self.learner.score(state.params, arrays._asdict())
    mm = jax.device_get(
        mismatch_metrics(
            jnp.asarray(learner_logp), jnp.asarray(arrays.behavior_logp), jnp.asarray(arrays.response_mask)
        )
    )
    batch = RolloutBatch(
        tokens=arrays.tokens,
        segment_ids=arrays.segment_ids,
        positions=arrays.positions,
        response_mask=arrays.response_mask,
        behavior_logp=arrays.behavior_logp,
        learner_logp=np.where(arrays.response_mask, learner_logp, 0.0).astype(np.float32),
        advantages=adv.astype(np.float32),
        rewards=rewards,
        group_ids=gen.group_ids.astype(np.int64),
        policy_version=np.full(len(gen), version, np.int64),
        response_lengths=gen.lengths,
        truncated=gen.truncated,
    )
    t3 = time.time()
    ent = gen.entropy
    n_tok = max(int(gen.response_mask.sum()), 1)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/accuracy": float((rewards >= 1.0).mean()),
        "reward/no_answer_frac": gstats["no_answer"] / len(texts),
        "reward/timeouts": gstats["timeout"],
        "response/length_mean": float(gen.lengths.mean()),
        "response/length_max": int(gen.lengths.max()),
        "response/truncated_frac": float(gen.truncated.mean()),
        "response/entropy": float((ent * gen.response_mask).sum() / n_tok) if ent is not None else None,
        "advantage/zero_frac": float((adv == 0).mean()),
        "sample/policy_version": version,
        "time/sample": t1 - t0,
        "time/grade": t2 - t1,
        "time/score": t3 - t2,
        "throughput/sample_tokens_per_s": n_tok / max(t1 - t0, 1e-9),
    }
    metrics.update({f"sampler_learner/{k}": float(v) for k, v in mm.items()})
    return batch, metrics

  def check_inference_gap(self, state, step: int) -> mipu.GapCheck:
    """MIPU Step 2 (arXiv 2606.29526) at the parameters `state.params` (just updated): sample validation
    prompts with the sampler, score them with the learner, and test T_post >= -config.mipu.gap_tolerance.

    Args:
      state: the `TrainState` after the step's updates (read only; the caller rolls back).
      step: global step (seeds the validation draw and its sampling, so a resumed run decides the same).

    Returns:
      A `mipu.GapCheck` (float t_post in advantage units, the verdict, the validation reward mean and count).

    Raises:
      ValueError: config.mipu.val_prompts larger than the training problems (normally caught at start).
    """
    m = self.c.mipu
    idx = mipu.validation_indices(len(self.train_problems), m.val_prompts, self._step_seed(step, 3))
    problems = [self.train_problems[i] for i in idx]
    with self._mesh():
      gen = self.sampler.generate(
          state.params,
          [self.prompt_ids[p.id] for p in problems],
          self.sampling,
          self._step_seed(step, 4),
          group_size=m.val_group_size,
          policy_version=int(state.step),
      )
    arrays = gen.to_learner_arrays()
    _, rewards, _, adv = self._grade(gen, problems, m.val_group_size)
    with self._mesh():
      learner_logp = self.learner.score(state.params, arrays._asdict())
    t_post = float(
        inference_gap_t_post(
            jnp.asarray(learner_logp),
            jnp.asarray(arrays.behavior_logp),
            jnp.asarray(adv),
            jnp.asarray(arrays.response_mask),
        )
    )
    return mipu.GapCheck(
        t_post=t_post,
        accepted=mipu.accept_update(t_post, float(m.gap_tolerance)),
        reward_mean=float(rewards.mean()),
        num_samples=len(rewards),
    )

  def learn_step(self, state, batch: RolloutBatch) -> tuple[Any, dict[str, Any]]:
    """Step 4: one optimizer update per mini-batch of a released batch."""
    t0 = time.time()
    ups, stale = [], []
    for mini in batch.split(self.c.num_updates_per_step):
      stale.append(staleness(int(state.step), mini.policy_version))
      with self._mesh():
        state, m = self.learner.update(state, mini.learner_arrays())
      ups.append(m)
    stale = np.concatenate(stale)
    dt = time.time() - t0
    metrics: dict[str, Any] = {
        "staleness/min": int(stale.min()),
        "staleness/mean": float(stale.mean()),
        "staleness/max": int(stale.max()),
        "time/learn": dt,
        "throughput/learn_tokens_per_s": float(batch.segment_ids.sum()) / max(dt, 1e-9),
    }
    for k in ups[0]:
      vals = np.asarray([u[k] for u in ups], np.float64)
      if k == "weight_by_position_bin":
        cnt = np.asarray([u["tokens_by_position_bin"] for u in ups], np.float64)
        tot = cnt.sum(0)
        metrics["learn/weight_by_position_bin"] = [
            float(x) if t > 0 else None for x, t in zip((vals * cnt).sum(0) / np.maximum(tot, 1), tot)
        ]
      elif k == "tokens_by_position_bin":
        continue
      elif k.endswith("_max"):
        metrics[f"learn/{k}"] = float(vals.max())
      elif k.endswith("_min"):
        metrics[f"learn/{k}"] = float(vals.min())
      elif k == "update_skipped":
        metrics["learn/skipped_updates"] = int(vals.sum())
      else:
        metrics[f"learn/{k}"] = float(vals.mean())
    return state, metrics

  # ------------------------------------------------------------------ run
  def _install_signal_handlers(self):
    def handler(signum, frame):
      del frame
      logger.warning("received signal %d: checkpointing after this step, then exiting", signum)
      self._stop_signal = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, handler)

  def _save(self, step: int, state, buffer: RolloutBuffer, extra: dict[str, Any]) -> None:
    meta = {
        "global_step": step,
        "data": self.loader.get_state(),
        "config": run_config.resume_fingerprint(self.c),
        **extra,
    }
    self.ckpt.save(step, state, buffer.state_dict(), meta)

  def run(self) -> dict[str, Any]:
    """Trains to `config.total_steps` global steps (resuming from the newest checkpoint in workdir if any).

    Returns:
      The summary dict also written to `workdir/summary.json`.
    """
    c = self.c
    _, params = nnx.split(self.model)
    state = self.learner.init_state(params)
    self.ckpt.check_disk_space(state, state.params)  # before any work a full disk would lose
    buffer = RolloutBuffer(c.delay)
    extra = {
        "best_score": None,
        "best_step": None,
        "sft_eval": None,
        "sft_info": self.sft_info,
        "mipu_checks": 0,
        "mipu_rollbacks": 0,
    }
    start = 0
    restored = self.ckpt.restore_latest(  # the config check comes before the arrays: a changed model is not "damage"
        state, check_meta=lambda meta: run_config.check_resume(c, meta.get("config"), self.workdir)
    )
    latest = None
    if restored is not None:
      latest, state, buf_state, meta = restored
      buffer.load_state_dict(buffer_state_from_restored(buf_state))
      self.loader.set_state(meta["data"])
      extra = {k: meta.get(k, extra[k]) for k in extra}
      start = int(meta["global_step"]) + 1
      logger.info("resumed from global step %d (policy_version %d)", latest, int(state.step))
    writer = MetricsWriter(
        self.workdir, resume_step=start - 1 if latest is not None else None, tensorboard=c.log.tensorboard
    )
    self._install_signal_handlers()

    if extra["sft_eval"] is None:
      res = self.evaluate(state.params, 0, "step_000000_initial")
      extra["sft_eval"] = res["macro"]
      # the starting policy is a candidate for "best" too: a run whose updates only hurt keeps the initial weights
      extra["best_score"], extra["best_step"] = res["macro"].get("pass@1"), 0
      self.ckpt.save_best(0, state.params, {"score": extra["best_score"], "step": 0})
      writer.write(
          -1, {f"eval/{k}": v for k, v in res["macro"].items()} | {"eval/avg_score": res["macro"].get("pass@1")}
      )

    bar = None
    if c.log.progress:
      from tqdm import tqdm

      bar = tqdm(total=c.total_steps, initial=start, desc="RL", dynamic_ncols=True)
    for step in range(start, c.total_steps):
      t0 = time.time()
      batch, metrics = self.sample_step(state, step)
      buffer.push(step, batch)
      released = buffer.pop(step)
      if released is not None:
        before = mipu.snapshot(state) if c.mipu.rollback else None
        state, lm = self.learn_step(state, released)
        metrics.update(lm)
        if before is not None:
          tm = time.time()
          check = self.check_inference_gap(state, step)
          if not check.accepted:
            state = before  # roll back parameters, optimizer state and counters; the batch is dropped
          extra["mipu_checks"] += 1
          extra["mipu_rollbacks"] += int(not check.accepted)
          metrics.update(
              {
                  "mipu/t_post": check.t_post,
                  "mipu/accepted": int(check.accepted),
                  "mipu/val_reward": check.reward_mean,
                  "mipu/rollbacks_total": extra["mipu_rollbacks"],
                  "time/mipu": time.time() - tm,
              }
          )
      metrics["policy_version"] = int(state.step)
      metrics["skipped_updates_total"] = int(state.skipped)
      metrics["buffer/waiting"] = len(buffer)
      evaluated = c.eval.every and (step + 1) % c.eval.every == 0 and step + 1 < c.total_steps
      if evaluated:
        te = time.time()
        res = self.evaluate(state.params, step + 1, f"step_{step + 1:06d}")
        score = res["macro"].get("pass@1")
        metrics.update({f"eval/{k}": v for k, v in res["macro"].items()})
        metrics["eval/avg_score"] = score
        metrics["time/eval"] = time.time() - te
        if extra["best_score"] is None or score > extra["best_score"]:
          extra["best_score"], extra["best_step"] = score, step + 1
          self.ckpt.save_best(step + 1, state.params, {"score": score, "step": step + 1})
      metrics["time/step"] = time.time() - t0
      writer.write(step, metrics)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}",
            acc=f"{metrics['reward/accuracy']:.3f}",
            sec=f"{metrics['time/step']:.1f}",
            v=metrics["policy_version"],
        )
      if self._stop_signal is not None or (c.checkpoint.every and (step + 1) % c.checkpoint.every == 0):
        self._save(step, state, buffer, extra)
      if self._stop_signal is not None:
        writer.close()
        logger.warning(
            "stopped by signal %d at global step %d; re-run the same command to resume", self._stop_signal, step
        )
        raise SystemExit(128 + self._stop_signal)
    if bar is not None:
      bar.close()

    final = self.evaluate(state.params, c.total_steps, "final")
    final_score = final["macro"].get("pass@1")
    writer.write(c.total_steps, {f"eval/{k}": v for k, v in final["macro"].items()} | {"eval/avg_score": final_score})
    if extra["best_score"] is None or final_score > extra["best_score"]:
      extra["best_score"], extra["best_step"] = final_score, c.total_steps
      self.ckpt.save_best(c.total_steps, state.params, {"score": final_score, "step": c.total_steps})
    if self.ckpt.latest_step() != c.total_steps - 1:
      self._save(c.total_steps - 1, state, buffer, extra)
    writer.close()
    summary = {
        "config": c.to_dict(),
        "sft": extra["sft_info"],
        "eval_after_sft": extra["sft_eval"],
        "eval_final": final["macro"],
        "eval_final_per_benchmark": final["benchmarks"],
        "best": {"score": extra["best_score"], "step": extra["best_step"]},
        "policy_version": int(state.step),
        "skipped_updates": int(state.skipped),
        "mipu": {"checks": extra["mipu_checks"], "rollbacks": extra["mipu_rollbacks"]},
        "eval_problems": {k: len(v) for k, v in self.eval_sets.items()},
        "eval_samples_per_problem": c.eval.n,
        "setup_seconds": self.setup_seconds,
    }
    write_summary(self.workdir, summary)
    if c.log.plots:
      plot_run(self.workdir)
    self.ckpt.close()
    self.final_state = state
    return summary


def _prompt_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  buckets = [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if b < max_prompt_tokens]
  return tuple(buckets) + (max_prompt_tokens,)
