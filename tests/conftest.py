"""Test setup: 8 virtual CPU devices, fp32 matmuls, one persistent compilation cache for the session, and temp dirs
for libraries that write to $HOME."""

import json
import os
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Must happen before jax is imported anywhere. LLVM at -O0 for XLA:CPU's code: the suite's programs are tiny, so
# compiling them is most of its time, and -O0 compiles them ~2.7x faster and runs them no slower (tests/README.md).
# The same HLO is compiled: only round-off may differ from -O2 (vectorised sums), and every run a test compares
# with another is compiled the same way. Processes the tests start inherit it (train_helpers.cli_env); the libtpu
# compiles do not (tpu_helpers).
CPU_CODEGEN_FLAGS = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {CPU_CODEGEN_FLAGS}")
os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="mpl-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One persistent JAX compilation cache for the session, its xdist workers and every process they start (trainer
# CLI, study runner, launch_local, libtpu compiles all inherit the environment): the suite compiles the same tiny
# programs in many tests, and a cached program is the executable a fresh compile makes
# (tests/test_compilation_cache.py). Every program is cached, however small or quick to compile. No size limit:
# with one, JAX's cache scans the whole directory (a stat and a read per entry) under a file lock at every write,
# so the suite slowed quadratically as the cache grew to thousands of entries (a test 13x slower late in a run;
# tests/README.md). Without the lock a process could read an entry another one is still writing: the entry is
# compressed, so a torn one fails to decompress, and JAX then warns and compiles afresh, as it does where XLA
# rejects a cached entry (jax-ml/jax#38445 on some Intel CPUs). `make clean` removes it with .pytest_cache.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".pytest_cache", "jax_compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

# `make test` runs two xdist workers with `--dist loadgroup --no-loadscope-reorder`: a worker takes one group at a
# time, in collection order. A group is a test file (its module fixtures then run once), unless a test carries its
# own `xdist_group` mark. The groups measured slowest (tests/README.md) are collected first, so that the long ones
# never start last while the other worker idles; the rest keep their order.
SLOWEST_FIRST = (
    "test_multihost",
    "test_train_resume",
    "test_overlap",  # two CLI runs on 8 devices and a SIGKILL + resume (~150 s)
    "test_inflight_multihost",  # two 2-process in-flight runs and a 1-process one (~140 s)
    "test_fidelity_model",  # SFT warm start, a trajectory and four drifts at a toy size
    "test_mipu_power",  # SFT warm start and three runs of the power study at a toy size
    "test_paged_sampler",  # a TPU compile of the paged decode loop (~95 s)
    "study_smoke",
    "test_colab_notebook",
    "aot_tpu",
    "budget_tpu",
    "multihost_one_device",
    "test_bad_input",
    "test_silent_runs",
    "test_multihost_errors",
    "smollm2_one_step",
    "test_train_e2e",
    "test_aot",
    "test_mipu",
    "test_model_hf_parity",
    "test_sampler",
    "multihost_launch",
)


def _group(item) -> str:
  marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
  return "_".join(sorted(map(str, marks)))


@pytest.hookimpl(tryfirst=True)  # before xdist appends the group to the test ids
def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if not _group(item):
      item.add_marker(pytest.mark.xdist_group(item.path.stem))
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(_group(item), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
  """Stops the run when `--dist loadgroup` is not grouping: the scheduler reads a test's group from the `@group`
  suffix of its id, and without it each test is scheduled alone and each module fixture runs once per worker."""
  if node.config.getvalue("dist") == "loadgroup":
    loose = [i for i in ids if "@" not in i]
    if loose:
      pytest.exit(
          f"--dist loadgroup is not grouping ({len(loose)} test ids carry no @group, e.g. {loose[0]}): pytest "
          "9.2 drops xdist 3.8's group suffix (pytest-dev/pytest-xdist#1386); install requirements-test.txt "
          "(make setup)",
          returncode=pytest.ExitCode.USAGE_ERROR,
      )


# Every test phase is appended to TIMES_FILE as it ends (by the controlling process; one JSON line each: test id,
# phase, seconds, outcome, xdist worker, end time), so a run that is killed or times out still says where its time
# went: `python tests/durations.py` sums them per test, file and worker (tests/README.md).
TIMES_FILE = os.environ.get("MINPRO_TEST_TIMES", os.path.join(REPO, ".pytest_cache", "test_times.jsonl"))


def pytest_sessionstart(session):
  if not hasattr(session.config, "workerinput"):
    os.makedirs(os.path.dirname(TIMES_FILE), exist_ok=True)
    open(TIMES_FILE, "w").close()


def pytest_runtest_logreport(report):
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return
  worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
  line = {"test": report.nodeid, "when": report.when, "s": round(report.duration, 3), "outcome": report.outcome}
  with open(TIMES_FILE, "a") as f:
    f.write(json.dumps({**line, "worker": worker, "end": round(time.time(), 1)}) + "\n")
