"""launch/*.sh: bash syntax, the dry-run output, and one non-dry tpu_vm.sh pass against a fake `gcloud` that
checks every remote command's syntax and runs the sync + run steps in a temporary "worker" home directory."""

import os
import stat
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
SCRIPTS = ("tpu_vm.sh", "gpu.sh", "sweep_sharding.sh")
PAPER_CONFIG = "configs/paper/qwen3_8b.py:minpro,2"


def _bash(script, *args, env=None, cwd=ROOT):
  base = {
      k: v
      for k, v in os.environ.items()
      if k
      not in (
          "TPU_NAME",
          "ZONE",
          "PROJECT",
          "CONFIG",
          "MODEL_PATH",
          "WORKDIR",
          "EXTRA_ARGS",
          "STEPS",
          "CREATE",
          "REPO_URL",
          "DETACH",
          "SHAPES",
          "LAUNCHER",
          "GCLOUD_SSH_FLAGS",
      )
  }
  return subprocess.run(
      ["bash", os.path.join(LAUNCH, script), *args],
      env={**base, **(env or {})},
      cwd=cwd,
      capture_output=True,
      text=True,
      timeout=60,
  )


def _commands(stdout):
  return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
  proc = subprocess.run(["bash", "-n", os.path.join(LAUNCH, script)], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  assert os.access(os.path.join(LAUNCH, script), os.X_OK), f"{script} is not executable"
  help_text = _bash(script, "--help")
  assert help_text.returncode == 0 and "Environment:" in help_text.stdout and "set -euo" not in help_text.stdout


def test_tpu_vm_dry_run():
  proc = _bash(
      "tpu_vm.sh",
      "--dry-run",
      env={
          "TPU_NAME": "pod1",
          "ZONE": "us-east5-a",
          "MODEL_PATH": "/mnt/ckpt/Qwen3-8B-Base",
          "EXTRA_ARGS": "--config.total_steps=10",
      },
  )
  assert proc.returncode == 0, proc.stderr
  cmds = _commands(proc.stdout)
  assert [c.split()[:5] for c in cmds] == [["gcloud", "compute", "tpus", "tpu-vm", "scp"]] + [
      ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
  ] * 3
  assert all("--worker=all" in c and "--zone us-east5-a" in c for c in cmds)
  train = cmds[-1]
  assert train.startswith("gcloud compute tpus tpu-vm ssh pod1 ")
  assert f"--config={PAPER_CONFIG}" in train
  assert "MINPRO_DISTRIBUTED=1 .venv/bin/python -m minpro_jax.train" in train
  assert "--config.model.path=/mnt/ckpt/Qwen3-8B-Base --config.total_steps=10" in train
  assert "make setup" in cmds[2] and "jax[tpu]==0.10.2" in cmds[2]
  assert "dry run" in proc.stdout


def test_tpu_vm_create_clone_detach():
  proc = _bash(
      "tpu_vm.sh",
      "-n",
      env={
          "TPU_NAME": "pod1",
          "ZONE": "z",
          "PROJECT": "proj",
          "CREATE": "1",
          "SPOT": "1",
          "ACCELERATOR_TYPE": "v5litepod-16",
          "REPO_URL": "https://example.org/minpro_jax.git",
          "DETACH": "1",
      },
  )
  assert proc.returncode == 0, proc.stderr
  cmds = _commands(proc.stdout)
  assert cmds[0] == (
      "gcloud compute tpus tpu-vm create pod1 --zone z --project proj --accelerator-type v5litepod-16 "
      "--version v2-alpha-tpuv5 --spot"
  )
  assert "git clone -q https://example.org/minpro_jax.git minpro_jax" in cmds[1]
  assert "MINPRO_DISTRIBUTED=1 nohup .venv/bin/python -m minpro_jax.train" in cmds[-1]
  assert "> train_worker.log" in cmds[-1]


@pytest.mark.parametrize(
    "env, args, message",
    [
        ({"ZONE": "z"}, ["--dry-run"], "TPU_NAME"),
        ({"TPU_NAME": "t"}, ["--dry-run"], "ZONE"),
        ({"TPU_NAME": "t", "ZONE": "z"}, ["--bogus"], "unknown argument"),
        ({"TPU_NAME": "t", "ZONE": "z", "STEPS": "sync deploy"}, ["--dry-run"], "unknown step 'deploy'"),
    ],
)
def test_tpu_vm_bad_input(env, args, message):
  proc = _bash("tpu_vm.sh", *args, env=env)
  assert proc.returncode != 0
  assert message in proc.stderr


def test_tpu_vm_against_fake_gcloud(tmp_path):
  """Not a dry run: gcloud is a stub that syntax-checks each --command and runs it in a fake worker home."""
  home = tmp_path / "worker_home"
  fake_python = home / "minpro_jax" / ".venv" / "bin" / "python"
  fake_python.parent.mkdir(parents=True)
  fake_python.write_text(
      '#!/usr/bin/env bash\necho "MINPRO_DISTRIBUTED=$MINPRO_DISTRIBUTED"\n' 'for a in "$@"; do echo "ARG[$a]"; done\n'
  )
  fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(r"""#!/usr/bin/env bash
set -e
echo "$*" >> "$FAKE_LOG"
if [[ "$4" == scp ]]; then cp "$5" "$FAKE_HOME/minpro_jax_src.tar.gz"; exit 0; fi
prev=""
for a in "$@"; do
  if [[ "$prev" == --command ]]; then bash -n -c "$a"; (cd "$FAKE_HOME" && bash -c "$a"); fi
  prev="$a"
done
""")
  gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
  log = tmp_path / "gcloud.log"
  env = {
      "PATH": f"{bin_dir}:{os.environ['PATH']}",
      "FAKE_LOG": str(log),
      "FAKE_HOME": str(home),
      "TMPDIR": str(tmp_path),
      "TPU_NAME": "pod1",
      "ZONE": "z",
      "STEPS": "sync run",
      "MODEL_PATH": "/mnt/my ckpt/Qwen3-8B-Base",
      "WORKDIR": "/mnt/shared/run 1",
      "EXTRA_ARGS": "--config.total_steps=3 --config.mesh.shape=data=2,fsdp=-1\n  --config.eval.ks=(1,)",
  }
  proc = _bash("tpu_vm.sh", env=env)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  calls = log.read_text().splitlines()
  assert len(calls) == 3 and all("--worker=all" in c for c in calls)
  with tarfile.open(tmp_path / "minpro_jax_src.tar.gz") as tar:
    names = set(tar.getnames())
  assert {
      "minpro_jax/runtime/distributed.py",
      "launch/tpu_vm.sh",
      "Makefile",
      "configs/paper/qwen3_8b.py",
  } <= names
  assert not any(n.startswith((".venv/", "runs/", "cache/")) for n in names)
  assert (home / "minpro_jax" / "minpro_jax" / "runtime" / "distributed.py").is_file()  # unpacked on the "worker"
  out = proc.stdout
  assert "MINPRO_DISTRIBUTED=1" in out
  expected = [
      "-m",
      "minpro_jax.train",
      f"--config={PAPER_CONFIG}",
      "--config.model.path=/mnt/my ckpt/Qwen3-8B-Base",
      "--config.workdir=/mnt/shared/run 1",
      "--config.total_steps=3",
      "--config.mesh.shape=data=2,fsdp=-1",
      "--config.eval.ks=(1,)",
  ]
  assert [line[4:-1] for line in out.splitlines() if line.startswith("ARG[")] == expected


def test_gpu_dry_run():
  proc = _bash("gpu.sh", "--dry-run", env={"MODEL_PATH": "/ckpt/Qwen3-8B-Base"})
  assert proc.returncode == 0, proc.stderr
  cmds = _commands(proc.stdout)
  assert cmds[0] == f"make -C {ROOT} setup"
  assert cmds[1] == f"{ROOT}/.venv/bin/pip install -q 'jax[cuda12]==0.10.2'"
  assert cmds[-1] == (
      f".venv/bin/python -m minpro_jax.train --config={PAPER_CONFIG} " "--config.model.path=/ckpt/Qwen3-8B-Base"
  )
  proc = _bash("gpu.sh", "-n", env={"STEPS": "run", "CONFIG": "configs/default.py", "EXTRA_ARGS": ""})
  assert proc.returncode == 0, proc.stderr
  assert _commands(proc.stdout)[-1] == ".venv/bin/python -m minpro_jax.train --config=configs/default.py"
  proc = _bash(
      "gpu.sh",
      "-n",
      env={
          "STEPS": "run",
          "CONFIG": "configs/default.py",
          "EXTRA_ARGS": "--config.total_steps=2\n  --config.eval.ks=(1,)",
      },
  )
  assert proc.returncode == 0, proc.stderr
  assert _commands(proc.stdout)[-1] == (
      ".venv/bin/python -m minpro_jax.train --config=configs/default.py "
      "--config.total_steps=2 '--config.eval.ks=(1,)'"
  )


def test_sweep_dry_run_separates_workdirs():
  proc = _bash("sweep_sharding.sh", "--dry-run", env={"EXTRA_ARGS": "--config.total_steps=2"})
  assert proc.returncode == 0, proc.stderr
  cmds = _commands(proc.stdout)
  shapes = ["fsdp=-1", "data=2,fsdp=-1", "fsdp=-1,tensor=2"]
  workdirs = ["runs/sweep/mesh_fsdp-1", "runs/sweep/mesh_data2_fsdp-1", "runs/sweep/mesh_fsdp-1_tensor2"]
  assert cmds == [
      f".venv/bin/python -m minpro_jax.train --config={PAPER_CONFIG} --config.mesh.shape={s} "
      f"--config.workdir={w} --config.total_steps=2"
      for s, w in zip(shapes, workdirs)
  ]
  assert "pass --run" in proc.stdout


def test_sweep_tpu_launcher_composes_tpu_vm(tmp_path):
  proc = _bash(
      "sweep_sharding.sh",
      "--dry-run",
      env={"LAUNCHER": "tpu", "SHAPES": "data=2,fsdp=-1", "TPU_NAME": "pod1", "ZONE": "z"},
  )
  assert proc.returncode == 0, proc.stderr
  (cmd,) = _commands(proc.stdout)
  assert cmd.startswith("env STEPS=run ") and cmd.endswith("/launch/tpu_vm.sh")
  assert "WORKDIR=runs/sweep/mesh_data2_fsdp-1" in cmd and "EXTRA_ARGS=--config.mesh.shape=data=2,fsdp=-1" in cmd
  # The printed command, run with --dry-run appended, reaches tpu_vm.sh with the mesh shape and workdir.
  inner = subprocess.run(
      ["bash", "-c", f"{cmd} --dry-run"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=60,
      env={**os.environ, "TPU_NAME": "pod1", "ZONE": "z"},
  )
  assert inner.returncode == 0, inner.stderr
  train = _commands(inner.stdout)[-1]
  assert "--worker=all" in train
  assert "--config.workdir=runs/sweep/mesh_data2_fsdp-1 --config.mesh.shape=data=2,fsdp=-1" in train


def test_sweep_is_compile_only_by_default_with_one_table_for_every_shape():
  env = {
      "TOPOLOGY": "cpu:8",
      "CONFIG": "configs/default.py",
      "SHAPES": "data=8 fsdp=8",
      "PROGRAMS": "score",
      "EXTRA_ARGS": "--config.prompts_per_step=4 --config.group_size=2 --config.num_updates_per_step=1",
  }
  proc = _bash("sweep_sharding.sh", env=env)
  assert proc.returncode == 0, proc.stderr
  assert "minpro_jax.aot --config=configs/default.py --topology=cpu:8 --programs=score" in proc.stdout
  table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and "| score |" in ln]
  assert [ln.split(" | ")[0] for ln in table] == ["| data=8", "| fsdp=8"]


def test_sweep_rejects_bad_launcher():
  proc = _bash("sweep_sharding.sh", "--dry-run", env={"LAUNCHER": "slurm"})
  assert proc.returncode == 2 and "LAUNCHER=slurm" in proc.stderr
