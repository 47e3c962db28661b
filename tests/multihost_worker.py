"""One process of the multi-process tests (`tests/test_multihost.py`), started by `minpro_jax.launch_local`.

    python -m tests.multihost_worker MODE OUT_DIR

MODE "primitives": initializes jax.distributed through `maybe_initialize_distributed` (the trainer's path), runs
the host-side primitives of `minpro_jax.runtime.multihost` and the trainer's data order on a 2 x 2 mesh, and writes
what this process saw to OUT_DIR/process_<i>.json. MODE "fail": process 1 exits with status 3, the others wait.
MODE "sleep": every process waits for SIGTERM, records it in OUT_DIR/process_<i>.signal and exits 143. MODE
"stubborn": every process ignores SIGTERM and waits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def primitives(out_dir: str) -> dict:
  from minpro_jax.runtime.distributed import maybe_initialize_distributed

  assert maybe_initialize_distributed() is True
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from minpro_jax.data import ProblemLoader
  from minpro_jax.data.records import MathProblem
  from minpro_jax.errors import LaunchError
  from minpro_jax.evaluation import grade_split
  from minpro_jax.runtime import multihost
  from minpro_jax.runtime.sharding import make_mesh

  mesh = make_mesh({"data": 2, "fsdp": 2})
  rows = np.arange(24, dtype=np.float32).reshape(8, 3)  # the same host value on every process
  sharded = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P(("data", "fsdp"))))(rows)
  problems = [MathProblem(id=f"p{i}", prompt=f"q{i}", answer=str(i), source="toy") for i in range(40)]
  loader = ProblemLoader(problems, 6, seed=3, shard_index=0, shard_count=1)
  batch = next(loader)
  mine = batch[multihost.process_rows(len(batch))]
  responses = [f"\\boxed{{{p.answer if k % 2 else 'x'}}}" for k, p in enumerate(batch)]
  rewards, stats = grade_split(responses, [p.answer for p in batch], mode="math")
  try:
    multihost.check_same(f"config of process {jax.process_index()}", "the config")
    same_error = None
  except LaunchError as e:
    same_error = str(e)
  multihost.check_same("one config", "the config")
  return {
      "process_index": jax.process_index(),
      "process_count": jax.process_count(),
      "devices": jax.device_count(),
      "local_devices": jax.local_device_count(),
      "fully_addressable": bool(sharded.is_fully_addressable),
      "to_host": multihost.to_host(sharded).tolist(),
      "sum": multihost.sum_over_processes(np.asarray([1, jax.process_index()])).tolist(),
      "gathered": multihost.gather_rows(np.arange(7)[multihost.process_rows(7)] * 10, 7).tolist(),
      "batch_ids": [p.id for p in batch],
      "my_ids": [p.id for p in mine],
      "rewards": rewards,
      "stats": stats,
      "check_same_error": same_error,
  }


def main() -> None:
  mode, out_dir = sys.argv[1], sys.argv[2]
  index = int(os.environ["JAX_PROCESS_ID"])
  if mode == "primitives":
    with open(os.path.join(out_dir, f"process_{index}.json"), "w") as f:
      json.dump(primitives(out_dir), f)
  elif mode == "fail":
    if index == 1:
      sys.exit(3)
    time.sleep(120)
  elif mode == "sleep":

    def handler(signum, frame):
      del frame
      with open(os.path.join(out_dir, f"process_{index}.signal"), "w") as f:
        f.write(str(signum))
      sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    open(os.path.join(out_dir, f"process_{index}.ready"), "w").close()
    time.sleep(120)
  elif mode == "stubborn":  # a process that cannot act on SIGTERM (as one blocked in a collective)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out_dir, f"process_{index}.ready"), "w").close()
    time.sleep(120)
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main()
