#!/usr/bin/env bash
# Run minpro_jax on one multi-GPU node (run it on that node, from the repository root or anywhere).
#
#   MODEL_PATH=/ckpt/Qwen3-8B-Base launch/gpu.sh --dry-run     # show what it would do
#   MODEL_PATH=/ckpt/Qwen3-8B-Base launch/gpu.sh               # setup (once) + run
#   STEPS=run CONFIG=configs/default.py EXTRA_ARGS="--config.mesh.shape=data=8" launch/gpu.sh
#
# One node = one process that sees every local GPU (jax.devices()); `--config.mesh.shape` (the paper configs use
# "fsdp=-1": all GPUs on the fsdp axis) spreads the model over them, so nothing is initialised across processes.
# Several nodes: start one process per node with SLURM (`srun --ntasks-per-node=1 launch/gpu.sh`, STEPS=run) or with
# JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set on every node; minpro_jax.runtime.distributed then calls
# jax.distributed.initialize (see its docstring).
#
# Steps (STEPS, default "setup run"):
#   setup  `make setup` (CPU jaxlib from requirements), then the CUDA 12 plugin: pip install "jax[cuda12]==0.10.2"
#          (JAX_CUDA_PIP; the version must match jax in requirements.txt; needs an NVIDIA driver >= 525, the pip
#          wheels bring CUDA and cuDNN themselves)
#   run    .venv/bin/python -m minpro_jax.train --config=$CONFIG [--config.model.path=$MODEL_PATH]
#          [--config.workdir=$WORKDIR] $EXTRA_ARGS
# Environment: CONFIG (default configs/paper/qwen3_8b.py:minpro,2), MODEL_PATH, WORKDIR, EXTRA_ARGS (word-split),
# JAX_CUDA_PIP, CUDA_VISIBLE_DEVICES (subset of GPUs). JAX preallocates 75% of each GPU's memory; set
# XLA_PYTHON_CLIENT_MEM_FRACTION to change it. A hang at the first rollout on some PCIe boxes: try NCCL_P2P_DISABLE=1.
set -euo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) DRY_RUN=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$arg' (settings are environment variables; see --help)" >&2; exit 2 ;;
  esac
done

CONFIG="${CONFIG:-configs/paper/qwen3_8b.py:minpro,2}"
MODEL_PATH="${MODEL_PATH:-}"
WORKDIR="${WORKDIR:-}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
EXTRA_ARGS="${EXTRA_ARGS//$'\n'/ }"   # newlines separate words too
JAX_CUDA_PIP="${JAX_CUDA_PIP:-jax[cuda12]==0.10.2}"
STEPS="${STEPS:-setup run}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

show() {  # print a command so that it can be pasted into a shell
  local out="+" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then out+=" $a"; else out+=" ${a@Q}"; fi
  done
  echo "$out"
}

run() {
  show "$@"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}

step_setup() {
  run make -C "$REPO_ROOT" setup
  run "$REPO_ROOT/.venv/bin/pip" install -q "$JAX_CUDA_PIP"
  run "$REPO_ROOT/.venv/bin/python" -c 'import jax; print(jax.__version__, jax.devices())'
}

step_run() {
  local extra=() cmd
  read -r -a extra <<< "$EXTRA_ARGS"
  cmd=(.venv/bin/python -m minpro_jax.train "--config=$CONFIG")
  [[ -n "$MODEL_PATH" ]] && cmd+=("--config.model.path=$MODEL_PATH")
  [[ -n "$WORKDIR" ]] && cmd+=("--config.workdir=$WORKDIR")
  cmd+=("${extra[@]}")
  echo "+ cd $REPO_ROOT"
  cd "$REPO_ROOT"
  run "${cmd[@]}"
}

echo "# minpro_jax on this GPU node ($(hostname)); steps: $STEPS"
echo "# config: $CONFIG; model: ${MODEL_PATH:-<config default>}; workdir: ${WORKDIR:-<config default>}"
[[ "$DRY_RUN" == 1 ]] && echo "# dry run: commands are printed, not executed"
for s in $STEPS; do
  case "$s" in
    setup|run) echo "# step: $s"; "step_$s" ;;
    *) echo "gpu.sh: unknown step '$s' in STEPS (use setup run)" >&2; exit 2 ;;
  esac
done
