"""The off-policy RL trainer: sample -> grade -> delay buffer -> updates, with exact staleness and exact resume.

One global step s:
  1. take the next prompt batch (B prompts) from the data iterator;
  2. sample G responses per prompt from the newest parameters (version v = updates so far), recording the
     sampler's behavior log-probs and v per sample; score the same tokens with the learner at v (training-precision
     log-probs, for TIS/MIS every step, else only for the mismatch metrics every `log.mismatch_every` steps); in a
     multi-process run each process gets back, grades and scores only its rows (whole groups:
     `Sampler.generate(own_rows=True)`, `process_inputs.score`);
  3. grade the responses and compute group advantages (by explicit group ids);
  4. push the batch into the `RolloutBuffer` and pop the one pushed at step s - delay (none while it fills), pass
     over it `num_epochs` times (`minpro_jax.rl.epochs`), split each pass into `num_updates_per_step` mini-batches
     and take one optimizer update on each (at the learning rate times the LR-decay multiplier,
     `minpro_jax.rl.lr_decay`); the staleness this gives is derived in
     `minpro_jax.rl.rollout`; in a multi-process run each process pushes, holds and checkpoints only its rows, and
     the learner's global arrays are assembled from them (`minpro_jax.rl.process_inputs`);
  5. with `config.mipu.rollback` (MIPU Step 2, `minpro_jax.run.mipu_step`): sample validation prompts with the updated
     parameters at the sampler's precision and roll the step's updates back (parameters, optimizer state,
     counters) when T_post < -gap_tolerance (or at random, `mipu.mode="random"`, the paper's ablation).
With `config.sampling.devices` and delay >= 1, steps 2-3 and 4 run at the same time on disjoint devices, with the
same samples and updates (`minpro_jax.run.step_runner`). With `config.staleness.mode="inflight"` the sampler instead
streams one pool of rows across steps and the weights move mid-response (`minpro_jax.run.inflight_runner`).

Randomness is a pure function of (seed, global step), and checkpoints hold parameters, optimizer state, the data
iterator state, the waiting rollout batches and the `RunProgress`, so a run killed at any point and re-run with the
same command continues exactly as if it had never stopped (tests/test_train_resume.py).
"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from minpro_jax.data import ProblemLoader, format_prompt
from minpro_jax.data.rewards import overlong_penalty
from minpro_jax.errors import TrainingError
from minpro_jax.rl import lr_decay, process_inputs, rollout_metrics
from minpro_jax.rl.advantages import group_advantages
from minpro_jax.rl.dynamic_sampling import Round, fill_informative
from minpro_jax.rl.learner import Learner
from minpro_jax.rl.packing import micro_batch_warning, row_tokens
from minpro_jax.rl.process_dynamic import take_own_groups
from minpro_jax.rl.rollout import RolloutBatch, RolloutBuffer, mask_truncated
from minpro_jax.rl.token_staleness import staleness_from_counts, token_staleness_metrics
from minpro_jax.rl.update_metrics import combine_update_metrics
from minpro_jax.run import run_config, run_load, sampler_setup, step_checkpoint
from minpro_jax.run.heldout import evaluate, grade_split
from minpro_jax.run.inflight_runner import InflightRunner, inflight_mode
from minpro_jax.run.metrics_log import MetricsWriter, plot_run, write_summary
from minpro_jax.run.mipu_step import MipuStep
from minpro_jax.run.mipu_step import summary as mipu_summary
from minpro_jax.run.run_progress import RunProgress
from minpro_jax.run.run_setup import RunParts, setup_run
from minpro_jax.run.run_watch import MAX_ALL_SKIPPED_STEPS, RunWatch
from minpro_jax.run.sampler_setup import sampler_kwargs
from minpro_jax.run.step_runner import StepRunner
from minpro_jax.runtime import abort_line, multihost
from minpro_jax.runtime.sharding import use_mesh
from minpro_jax.sampling import Sampler, SamplingParams

logger = logging.getLogger(__name__)


class Trainer:
  """Runs training on the parts `run_setup.setup_run` built (construction itself has no side effects).

  Args:
    parts: the run's `RunParts`.
  """

  def __init__(self, parts: RunParts):
    c = self.c = parts.config
    self.parts = parts
    self.workdir, self.mesh, self.ckpt = parts.workdir, parts.mesh, parts.checkpointer
    self.rules = run_config.learner_rules(c)  # the learner's logical-axis rules (config.mesh.rules)
    self.model, self.tokenizer = parts.model, parts.tokenizer
    self.train_problems, self.prompt_ids, self.eval_sets = parts.train_problems, parts.prompt_ids, parts.eval_sets
    self.sft_info = parts.sft_info
    # The global batch order, the same on every process (docs/multihost.md): a run's samples do not depend on the
    # process count; each process grades its rows of it (`evaluation.grade_split`).
    self.loader = ProblemLoader(
        self.train_problems, c.prompts_per_step, seed=c.seed, num_epochs=c.data.num_epochs, shard_index=0, shard_count=1
    )
    self.sampling = sampler_setup.sampling_params(c, self.tokenizer.stop_ids)
    run_config.check_routes_fit(c, self.model.config)  # scratch and hf were checked before the setup; gguf here
    # the sampler's layout (the learner's mesh, or its own: config.sampling.mesh and .devices), rows, precision
    sampler_kw = self.sampler_kw = sampler_kwargs(c, self.model, self.tokenizer, self.mesh, parts.device_split)
    record = bool(c.loss.router_replay or c.sampling.record_routes)
    self.sampler = Sampler(self.model.config, record_routes=record, **sampler_kw)
    # evaluation never needs routes (2 * layers * k bytes per token): its own sampler, the same compiled shapes
    self.eval_sampler = Sampler(self.model.config, **sampler_kw) if record else self.sampler
    self.learner = Learner(
        self.model,
        run_config.loss_config(c),
        run_config.optimizer_config(c),
        micro_batch_size=run_config.learner_micro_batch(c),
        mesh=self.mesh,
        row_tokens=row_tokens(c),
        ess_step=run_config.ess_step(c),
    )
    if warning := micro_batch_warning(c):
      logger.warning(warning)
    self.mipu_step = MipuStep(self) if c.mipu.rollback else None
    # a step's sampling and learning: in sequence, or overlapped (minpro_jax/run/step_runner.py); or streamed with
    # in-flight parameter updates (config.staleness.mode="inflight", minpro_jax/run/inflight_runner.py)
    self.steps = InflightRunner(self) if inflight_mode(c) else StepRunner(self)
    self.lr_decay = run_config.lr_decay_config(c)  # None when off
    self._stop_signal: int | None = None
    self._final_eval = False  # set once the last step is checkpointed: a signal then exits at once
    self._writer, self._restored_rows = None, None  # the run's MetricsWriter; the metrics rows a resume restored

  @classmethod
  def from_config(cls, config) -> "Trainer":
    """`Trainer(setup_run(config))`. Raises `ConfigError` naming the field of an invalid config."""
    return cls(setup_run(config))

  # ------------------------------------------------------------------ sampling, grading, evaluation
  def step_seed(self, step: int, salt: int) -> int:
    """A seed for global step `step`'s draw number `salt` (a uint32 from the run's seed, `step` and `salt`)."""
    return int(np.random.SeedSequence([self.c.seed, step, salt]).generate_state(1)[0])

  def generate(self, params, problems, sampling: SamplingParams, seed: int, group_size: int, sampler=None, **kw):
    """`group_size` responses per problem of `problems` under `params` (the run's sampler, or `sampler`): the
    sampler's `generate` output, rows prompt-major. `kw` goes to the sampler (e.g. `precision`)."""
    with use_mesh(self.mesh, self.rules):
      return (sampler or self.sampler).generate(
          params, [self.prompt_ids[p.id] for p in problems], sampling, seed, group_size=group_size, **kw
      )

  def _decode(self, gen, rows: slice = slice(None)) -> list[str]:
    pairs = zip(gen.response_tokens[rows], gen.response_mask[rows])
    return [self.tokenizer.decode(t[m].tolist()) for t, m in pairs]

  def rollout(
      self, state, gen, problems, group_size: int, score: bool = True, graded=None
  ) -> tuple[RolloutBatch, list[str], dict[str, Any]]:
    """Grades `gen` (prompt-major rows of `problems`, or in a multi-process run this process's rows of them:
    `Sampler.generate(own_rows=True)`; `graded` = (texts, rewards, stats) of every row when already graded) and,
    with `score`, scores it with the learner at `state.params` (else its `learner_logp` stays zero:
    `Trainer.scoring`). With `reward.mask_truncated` (DAPO's overlong filtering) truncated rows get no loss: their
    response mask is cleared after the advantages are computed with their rewards.

    Returns:
      (the `RolloutBatch` of `gen`'s rows with rewards, advantages and learner log-probs; the response texts of
      every row, None where another process graded; the grading stats, with the seconds spent grading under
      "seconds").
    """
    t0 = time.time()
    texts, rewards, gstats = graded or self.grade(gen, problems, group_size)
    num_rows = len(problems) * group_size
    own = len(gen) != num_rows  # this process's rows: whole groups, so their advantages are exact
    rewards = rewards[multihost.process_rows(num_rows)] if own else rewards
    adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(gen.group_ids), mode=self.c.advantage_mode))
    batch = RolloutBatch.from_generation(gen, rewards=rewards, advantages=adv.astype(np.float32))
    if self.c.reward.mask_truncated:
      batch = mask_truncated(batch)
    gstats = {**gstats, "seconds": time.time() - t0}
    if not score:
      return batch, texts, gstats
    recorded = batch.routes is not None  # the learner's own routes ([N, L, layers, k]) only to compare with them
    num = self.c.num_updates_per_step  # packed: each mini-batch on its own (`process_packing`)
    chunk = num_rows // num if num_rows % num == 0 else None
    with use_mesh(self.mesh, self.rules):
      if own:  # its rows in, its rows of the log-probs out (collective; `process_inputs.score`)
        scored = process_inputs.score(
            self.learner, state.params, batch, num_rows, return_routes=recorded, chunk_rows=chunk
        )
      else:
        scored = self.learner.score(state.params, batch, return_routes=recorded, chunk_rows=chunk)
    learner_logp, learner_routes = scored if recorded else (scored, None)
    if recorded:  # where the learner's router, at the sampling version, picks other experts
      gstats["router_mismatch"] = rollout_metrics.route_mismatch_frac(learner_routes, batch.routes, own)
    return (
        batch.replace(learner_logp=np.where(batch.response_mask, learner_logp, 0.0).astype(np.float32)),
        texts,
        gstats,
    )

  def grade(self, gen, problems, group_size: int) -> tuple[list[str | None], np.ndarray, dict[str, Any]]:
    """The response texts of `gen` (prompt-major rows of `problems`, or this process's rows of them) on this
    process's rows (`grade_split` grades only those; None on the others'), the [N] float32 rewards of every row
    and the grading stats."""
    c = self.c
    n = len(problems) * group_size
    texts: list[str | None] = [None] * n
    mine = multihost.process_rows(n)  # the rows `grade_split` grades here: only they are decoded
    own = len(gen) != n  # `gen` holds only them (`Sampler.generate(own_rows=True)`)
    texts[mine] = self._decode(gen, slice(None) if own else mine)
    truncated = np.zeros(n, bool)
    truncated[mine] = gen.truncated if own else gen.truncated[mine]
    golds = [p.answer for p in problems for _ in range(group_size)]
    rewards, gstats = grade_split(
        texts, golds, mode=c.reward.mode, format_reward=c.reward.format_reward, truncated=list(truncated)
    )
    if c.reward.overlong_buffer:  # DAPO's soft overlong penalty on top of the grader's score (case B32)
      max_len, buf, f = c.sampling.max_new_tokens, c.reward.overlong_buffer, c.reward.overlong_factor
      lengths = multihost.gather_rows(gen.lengths, n) if own else gen.lengths  # [N] int32, small
      rewards = [r + overlong_penalty(int(k), max_len, buf, f) for r, k in zip(rewards, lengths)]
    return texts, np.asarray(rewards, np.float32), gstats

  def generate_texts(self, params, prompts: list[str], n: int, seed: int) -> list[list[str]]:
    """`evaluation.evaluate`'s generate_fn: n decoded responses per prompt text (`config.eval` sampling)."""
    e = self.c.eval
    ids = [self.tokenizer.encode(p, add_bos=self.c.data.template == "plain") for p in prompts]
    sp = SamplingParams(
        temperature=e.temperature,
        top_p=e.top_p if e.top_p < 1.0 else None,
        max_new_tokens=self.sampling.max_new_tokens,
        stop_token_ids=self.sampling.stop_token_ids,
    )
    with use_mesh(self.mesh, self.rules):
      texts = self._decode(self.eval_sampler.generate(params, ids, sp, seed, group_size=n))
    return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

  def evaluate(self, params, step: int, name: str) -> dict[str, Any]:
    """Held-out evaluation of `params` (`config.eval`); writes `workdir/eval/<name>.json|md`."""
    e = self.c.eval
    with use_mesh(self.mesh, self.rules):
      params = self.eval_sampler.prepare_params(params)  # converted once for all of the evaluation's batches
    fn = lambda prompts, n, seed: self.generate_texts(params, prompts, n, seed)  # noqa: E731
    return evaluate(
        fn,
        self.eval_sets,
        n=e.n,
        ks=tuple(e.ks),
        seed=e.seed + step,
        batch_size=max(1, 256 // e.n),
        prompt_fn=lambda p: format_prompt(p, self.tokenizer, self.c.data.template),
        modes=e.reward_mode or self.c.reward.mode,
        out_dir=f"{self.workdir}/eval" if multihost.is_primary() else None,
        name=name,
    )

  # ------------------------------------------------------------------ one global step
  def scoring(self, step: int) -> tuple[bool, bool]:
    """(whether global step `step` runs the learner's score pass over its batch, whether it logs the sampler-learner
    mismatch metrics): the metrics every `config.log.mismatch_every` steps, the pass then or when the loss reads
    `learner_logp` (TIS/MIS). A function of the step alone, so a resumed run skips the same steps; the loss and the
    updates do not depend on it."""
    logs = step % self.c.log.mismatch_every == 0
    return logs or self.learner.loss_cfg.reads_learner_logp, logs

  def sample_step(self, state, step: int, sampler_params=None) -> tuple[RolloutBatch, dict[str, Any]]:
    """Steps 1-3 of the module docstring for global step `step` at `state` (its `params` and `step`); returns the
    rollout batch and its metrics. `sampler_params`: `state.params` already prepared for the sampler."""
    c = self.c
    t0 = time.time()
    problems = next(self.loader)
    version = int(state.step)
    params = state.params if sampler_params is None else sampler_params
    group_ids = step * c.prompts_per_step + np.arange(len(problems))
    gen = self.generate(
        params,
        problems,
        self.sampling,
        self.step_seed(step, 1),
        c.group_size,
        group_ids=group_ids,
        policy_version=version,
        own_rows=True,  # several processes: each gets its rows (whole groups) back
    )
    graded, dynamic = None, {}
    if c.sampling.drop_equal_reward_groups:  # DAPO's: rl/dynamic_sampling.py, each process its rows of each round
      filled, dynamic = self._fill_informative(params, step, gen, problems, group_ids, version)
      gen, graded = filled.gen, (filled.texts, filled.rewards, filled.stats)
    batch, metrics = self.graded_batch(state, step, gen, problems, time.time() - t0, graded)
    return batch, {**metrics, **dynamic}  # several processes: its rows

  def graded_batch(
      self, state, step: int, gen, problems, sample_seconds: float, graded=None
  ) -> tuple[RolloutBatch, dict[str, Any]]:
    """Step 3 of the module docstring for the batch `gen` of global step `step`'s `problems`, sampled in
    `sample_seconds`: grades it, scores it at `state.params` when `scoring(step)` says so, and returns the rollout
    batch and its sample metrics (`graded`: as `rollout`). The delay mode's `sample_step` and the in-flight mode's
    runner (`minpro_jax.run.inflight_runner`, for each batch as it completes) call it."""
    c = self.c
    version = gen.policy_version
    t1 = time.time()
    score, logs_mismatch = self.scoring(step)
    batch, texts, gstats = self.rollout(state, gen, problems, c.group_size, score=score, graded=graded)
    t2, t_grade = time.time(), gstats["seconds"]
    n = c.prompts_per_step * c.group_size  # `gen` and `batch` hold this process's rows of them: its share of the
    sampled = rollout_metrics.sample_metrics(gen, batch, slice(None), n)  # statistics, gathered as [N, k]
    n_tok = sampled.pop("tokens")
    metrics = {
        **sampled,
        "reward/no_answer_frac": gstats["no_answer"] / len(texts),
        "reward/timeouts": gstats["timeout"],
        "sample/policy_version": version,
        "time/sample": sample_seconds,
        "time/grade": t_grade,
        "time/score": t2 - t1 - t_grade,
        "throughput/sample_tokens_per_s": n_tok / max(sample_seconds, 1e-9),
    }
    if logs_mismatch:  # the same steps whether or not the loss scored every step: runs stay comparable
      mm = rollout_metrics.mismatch_metrics(batch, slice(None), n)
      metrics.update({f"sampler_learner/{k}": v for k, v in mm.items()})
      if "router_mismatch" in gstats:
        metrics["sampler_learner/router_mismatch_frac"] = gstats["router_mismatch"]
    return batch, metrics

  def _fill_informative(self, params, step: int, gen, problems, group_ids, version: int):
    """`dynamic_sampling.fill_informative` for global step `step`: round k > 0 draws the next `prompts_per_step`
    prompts and samples them at the same parameters with its own seed, unless the global steps to come need every
    batch the loader has left."""
    c = self.c

    def sample_round(k: int, gen=None, problems=None) -> Round | None:
      if gen is None:
        if self.loader.remaining <= c.total_steps - step - 1:  # the steps to come need every batch left
          return None
        problems = next(self.loader)
        seed = self.step_seed(step, 1000 + k)
        gen = self.generate(
            params, problems, self.sampling, seed, c.group_size, group_ids=group_ids, policy_version=version,
            own_rows=True,
        )  # fmt: skip
      return Round(gen, *self.grade(gen, problems, c.group_size))

    first = sample_round(0, gen, problems)
    rounds, pad_id = int(c.sampling.max_sampling_rounds), self.sampler_kw["pad_id"]
    take = functools.partial(take_own_groups, group_size=c.group_size, pad_id=pad_id)  # collective
    return fill_informative(first, sample_round, group_size=c.group_size, max_rounds=rounds, pad_id=pad_id, take=take)

  def learner_batch(self, released: RolloutBatch | None) -> RolloutBatch | process_inputs.StagedBatch | None:
    """What `learn_step` takes of the batch the delay buffer released (`process_inputs.for_learner`: in several
    processes, the global arrays made from each process's rows). Every process calls it at the same point, from the
    main thread (it makes collective host calls)."""
    c = self.c
    return process_inputs.for_learner(released, self.learner, c.prompts_per_step * c.group_size, c.num_updates_per_step)

  def learn_step(
      self, state, batch: RolloutBatch | process_inputs.StagedBatch, lr_scale: float = 1.0
  ) -> tuple[Any, dict[str, Any]]:
    """Step 4: `num_epochs` passes over a released batch (`learner_batch`), one optimizer update per mini-batch of
    each, at `lr_scale` x the scheduled rate (`process_inputs.updates`, `minpro_jax.rl.epochs`)."""
    c = self.c
    t0 = time.time()
    first = int(state.step)  # the version the step's first update runs at (the per-token staleness' reference)
    with use_mesh(self.mesh, self.rules):
      state, ups, stale, tokens = process_inputs.updates(
          self.learner,
          state,
          batch,
          c.num_updates_per_step,
          lr_scale,
          num_epochs=run_config.num_epochs(c),
          group_size=c.group_size,
          seed=c.seed,
      )
    dt = time.time() - t0
    metrics: dict[str, Any] = {
        "staleness/min": int(stale.min()),
        "staleness/mean": float(stale.mean()),
        "staleness/max": int(stale.max()),
        # [k]: uses of a sample k updates after it was drawn (a sample is used once per pass, num_epochs)
        "staleness/histogram": np.bincount(stale).tolist(),
        "time/learn": dt,
        "throughput/learn_tokens_per_s": float(tokens) / max(dt, 1e-9),
    }
    if isinstance(batch, RolloutBatch):  # one process (or gathered): per token
      metrics.update(token_staleness_metrics(batch, first))
    elif batch.versions is not None:  # several processes: from every process's per-token versions
      metrics.update(staleness_from_counts(batch.versions, first))
    return state, {**metrics, **combine_update_metrics(ups)}

  # ------------------------------------------------------------------ evaluation and checkpoints
  def _eval_and_keep_best(self, params, eval_step: int, name: str, progress: RunProgress) -> dict[str, Any]:
    """Evaluates and saves `params` as the best when they improve on it; returns the evaluation."""
    res = self.evaluate(params, eval_step, name)
    score = res["macro"].get("pass@1")
    if progress.improves(score):
      progress.best_score, progress.best_step = score, eval_step
      self.ckpt.save_best(eval_step, params, {"score": score, "step": eval_step})
    return res

  def _save(self, step: int, state, buffer: RolloutBuffer, progress: RunProgress) -> None:
    buf, meta = step_checkpoint.payload(self, step, buffer, progress)
    self.ckpt.save(step, state, buf, meta)

  def _restore(self, state, buffer: RolloutBuffer, progress: RunProgress) -> tuple[Any, RunProgress, int]:
    """The newest run checkpoint that reads back (after the config check), or the fresh state: (state, progress,
    first global step to run)."""
    restored = step_checkpoint.restore(self, state, buffer)
    if restored is None:
      return state, progress, 0
    latest, state, meta = restored
    self._restored_rows = meta.get("metrics")
    start = int(meta["global_step"]) + 1
    if start == self.c.total_steps:
      logger.warning(
          "the run in %s finished all %d global steps: repeating only its final evaluation", self.workdir, start
      )
    logger.info("resumed from global step %d (policy_version %d)", latest, int(state.step))
    return state, self._with_final_best(RunProgress.from_json(meta["progress"]), start), start

  def _with_final_best(self, progress: RunProgress, start: int) -> RunProgress:
    """`progress` with the best of a shorter run's final evaluation, which ran after its last checkpoint: when the
    best parameters on disk are those of policy step `start` (the restored one), they were that evaluation's."""
    best = self.ckpt.best_meta() if start < self.c.total_steps else None
    if best is not None and best["step"] == start and progress.improves(best["score"]):
      progress.best_score, progress.best_step = best["score"], start
    return progress

  def _install_signal_handlers(self) -> None:
    def handler(signum, frame):
      del frame
      if self._final_eval:  # the last step is checkpointed already: nothing to wait for
        _exit_during_final_eval(signum, self.workdir)
      logger.warning("received signal %d: checkpointing after this step, then exiting", signum)
      self._stop_signal = signum

    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, handler)

  def _agreed_stop_signal(self) -> int | None:
    """The signal to stop on after this step, the same on every process: one that reached any process (a
    preemption notice may reach one host first) stops them all, since the checkpoint they then write is
    collective. Read once per step, so a signal arriving later is seen by every process at the next step."""
    signum = self._stop_signal
    if multihost.process_count() == 1:
      return signum
    signals = multihost.gather_rows(np.asarray([signum or 0], np.int64), multihost.process_count())
    return int(signals[signals > 0][0]) if signals.any() else None

  # ------------------------------------------------------------------ run
  def run(self) -> dict[str, Any]:
    """Trains to `config.total_steps` global steps (resuming from the newest checkpoint in workdir if any).

    Returns:
      The summary dict also written to `workdir/summary.json`.
    """
    try:
      return self._run()
    finally:
      self.close()

  def close(self) -> None:
    """Ends the learner's worker thread, releases the workdir (its lock); `run` calls it however it ends."""
    self.steps.close()
    if self.parts.lock is not None:
      self.parts.lock.close()

  def _run(self) -> dict[str, Any]:
    c = self.c
    state = self.learner.init_state(nnx.split(self.model)[1])
    self.ckpt.check_disk_space(state, state.params)  # before any work a full disk would lose
    buffer = RolloutBuffer(c.delay)
    state, progress, start = self._restore(state, buffer, RunProgress(sft_info=self.sft_info))
    if multihost.is_primary():  # after the resume check: what `export` and `evaluate` read back
      run_load.save_run_files(self.workdir, c, self.tokenizer)
    writer = MetricsWriter(
        self.workdir,
        resume_step=start - 1 if start else None,
        keep_final_eval=0 < start < c.total_steps,  # a finished run continued to more steps
        tensorboard=c.log.tensorboard,
        enabled=multihost.is_primary(),
        restored_rows=self._restored_rows,
    )
    self._writer = writer
    self._install_signal_handlers()
    if progress.sft_eval is None:  # the starting policy is a candidate for "best" too
      res = self._eval_and_keep_best(state.params, 0, "step_000000_initial", progress)
      progress.sft_eval = res["macro"]
      writer.write(-1, _eval_metrics(res))
    bar = tqdm(
        total=c.total_steps,
        initial=start,
        desc="RL",
        dynamic_ncols=True,
        disable=not c.log.progress or not multihost.is_primary(),
    )
    watch = RunWatch(self.model.config.vocab_size)
    for step in range(start, c.total_steps):
      t0 = time.time()
      surge = lr_decay.SurgeState.from_json(progress.lr_decay)
      lr_scale = lr_decay.multiplier(surge, self.lr_decay) if self.lr_decay else 1.0
      state, before, metrics = self.steps.run(state, step, buffer, lr_scale)  # sample_step and learn_step
      if before is not None:  # MIPU Step 2: after the updates
        state, mipu_metrics = self.mipu_step(state, before, step, progress)
        metrics.update(mipu_metrics)
      if self.lr_decay and "response/length_mean" in metrics:  # this step's length moves the trigger
        surge, lr_metrics = lr_decay.observe(surge, metrics["response/length_mean"], lr_scale, self.lr_decay)
        progress.lr_decay = surge.to_json()
        metrics.update(lr_metrics)
      metrics.update(policy_version=int(state.step), skipped_updates_total=int(state.skipped))
      metrics["buffer/waiting"] = len(buffer)
      if c.eval.every and (step + 1) % c.eval.every == 0 and step + 1 < c.total_steps:
        te = time.time()
        res = self._eval_and_keep_best(state.params, step + 1, f"step_{step + 1:06d}", progress)
        metrics.update(_eval_metrics(res))
        metrics["time/eval"] = time.time() - te
      metrics["time/step"] = time.time() - t0
      writer.write(step, metrics)
      if watch.observe(step, metrics):  # every update of the last steps was non-finite: stop on the last good state
        self._save(step, state, buffer, progress)
        raise TrainingError(
            f"every optimizer update of global steps {step - MAX_ALL_SKIPPED_STEPS + 1}..{step} was non-finite "
            f"(loss, gradient or the updated parameters; see learn/skipped_updates in metrics.jsonl); the last good "
            f"state is checkpointed at step {step} in {self.workdir}/checkpoints. Lower optimizer.learning_rate "
            "or check the data and the model"
        )
      bar.update(1)
      bar.set_postfix(
          reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
          sec=f"{metrics['time/step']:.1f}",
          v=metrics["policy_version"],
      )
      stop = self._agreed_stop_signal()
      if stop is not None or (c.checkpoint.every and (step + 1) % c.checkpoint.every == 0):
        self._save(step, state, buffer, progress)
      if stop is not None:  # the bar ends as "RL stopped", on its own line, before the message
        writer.close()
        bar.set_description("RL stopped")
        bar.close()
        left = "the final evaluation" if step + 1 == c.total_steps else f"steps {step + 1}..{c.total_steps - 1}"
        logger.warning(
            "stopped by signal %d at global step %d (checkpointed); re-run the same command for %s", stop, step, left
        )
        raise SystemExit(128 + stop)
    bar.close()
    if self.ckpt.latest_step() != c.total_steps - 1:  # before the final evaluation, so a stop during it loses nothing
      self._save(c.total_steps - 1, state, buffer, progress)
    self._final_eval = True
    if self._stop_signal is not None:  # arrived during the save
      _exit_during_final_eval(self._stop_signal, self.workdir)
    logger.info("final evaluation (every step is checkpointed)")
    final = self._eval_and_keep_best(state.params, c.total_steps, "final", progress)
    writer.write(c.total_steps, _eval_metrics(final))
    writer.close()
    return self._finish(state, progress, final)

  def _finish(self, state, progress: RunProgress, final: dict[str, Any]) -> dict[str, Any]:
    summary = {
        "config": self.c.to_dict(),
        "sft": progress.sft_info,
        "eval_after_sft": progress.sft_eval,
        "eval_final": final["macro"],
        "eval_final_per_benchmark": final["benchmarks"],
        "best": {"score": progress.best_score, "step": progress.best_step},
        "policy_version": int(state.step),
        "skipped_updates": int(state.skipped),
        "mipu": mipu_summary(progress),
        "eval_problems": {k: len(v) for k, v in self.eval_sets.items()},
        "eval_samples_per_problem": self.c.eval.n,
        "setup_seconds": self.parts.setup_seconds,
    }
    if multihost.is_primary():
      write_summary(self.workdir, summary)
      if self.c.log.plots:
        plot_run(self.workdir)
    self.ckpt.close()
    self.final_state = state
    return summary


def _exit_during_final_eval(signum: int, workdir: str) -> None:
  """Ends the process at once with 128 + `signum`: every step is checkpointed, only the final evaluation (and
  summary.json) is left, which a re-run repeats. `os._exit`, since an exception raised in a signal handler can be
  swallowed by the code it interrupts."""
  sys.stderr.write(
      f"error: stopped by signal {signum} during the final evaluation; every step is checkpointed in "
      f"{workdir}/checkpoints: re-running the same command repeats only the final evaluation\n"
  )
  sys.stderr.flush()
  logging.shutdown()
  abort_line.exit_now(128 + signum)


def _eval_metrics(res: dict[str, Any]) -> dict[str, Any]:
  """The metrics.jsonl entries of an evaluation: its macro scores, and pass@1 as eval/avg_score."""
  return {**{f"eval/{k}": v for k, v in res["macro"].items()}, "eval/avg_score": res["macro"].get("pass@1")}
