"""Command-line entry point: `python -m minpro_jax.train --config=minpro_jax/configs/default.py [--config.FIELD=VALUE ...]`.

Any config field can be overridden on the command line (ml_collections), e.g.
`--config.loss.method=grpo --config.delay=4 --config.workdir=runs/grpo_d4`. Re-running the same command resumes
from the newest checkpoint in the workdir.
"""

from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("MPLCONFIGDIR", os.path.join(os.path.expanduser("~"), ".cache", "minpro_jax_mpl"))

from absl import app  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", "minpro_jax/configs/default.py", "Experiment config file.", lock_config=True
)


def main(argv):
  del argv
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax", "math_verify", "latex2sympy2_extended"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  from minpro_jax.runtime.host_memory import keep_freed_host_memory

  keep_freed_host_memory()  # host (XLA:CPU) steps stop re-faulting their temporaries; before JAX starts threads
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  maybe_initialize_distributed()  # multi-host TPU / multi-node GPU only; must precede any JAX computation
  from minpro_jax.run_setup import setup_run
  from minpro_jax.trainer import Trainer

  summary = Trainer(setup_run(_CONFIG.value)).run()
  keys = ("eval_after_sft", "eval_final", "best", "policy_version", "skipped_updates")
  print(json.dumps({k: summary[k] for k in keys}, indent=2))


if __name__ == "__main__":
  app.run(main)
