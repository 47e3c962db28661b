#!/usr/bin/env bash
# Sharding sweep: the same experiment once per mesh shape, each in its own workdir. DRY RUN BY DEFAULT: it prints
# the commands; pass --run to execute them one after another.
#
#   launch/sweep_sharding.sh                                   # print the commands (default shapes, local launcher)
#   SHAPES="fsdp=-1 data=2,fsdp=-1" EXTRA_ARGS="--config.total_steps=5" launch/sweep_sharding.sh --run
#   LAUNCHER=tpu TPU_NAME=my-v5p ZONE=us-east5-a MODEL_PATH=/mnt/ckpt/Qwen3-8B-Base launch/sweep_sharding.sh --run
#   CONFIG=minpro_jax/configs/default.py SHAPES="data=8 fsdp=8 data=2,fsdp=4" \
#     EXTRA_ARGS="--config.total_steps=2" XLA_FLAGS=--xla_force_host_platform_device_count=8 \
#     launch/sweep_sharding.sh --run                           # the tiny config on 8 virtual CPU devices
#
# Environment: SHAPES (space-separated `--config.mesh.shape` values; axes data, fsdp, tensor, expert; one size may
# be -1 = the remaining devices; default "fsdp=-1 data=2,fsdp=-1 fsdp=-1,tensor=2"); CONFIG (default
# minpro_jax/configs/paper/qwen3_8b.py:minpro,2); WORKDIR_PREFIX (default runs/sweep; the workdir of shape "data=2,fsdp=-1"
# is $WORKDIR_PREFIX/mesh_data2_fsdp-1); MODEL_PATH; EXTRA_ARGS (added to every run);
# LAUNCHER: local (default: .venv/bin/python on this machine) | gpu (launch/gpu.sh, STEPS=run) | tpu
# (launch/tpu_vm.sh, STEPS=run, on every worker; needs TPU_NAME and ZONE).
# Each run writes metrics.jsonl / summary.json to its workdir; compare step times there. A failing shape (e.g. a
# size that does not divide the device count or the heads) stops the sweep.
set -euo pipefail

DRY_RUN=1
for arg in "$@"; do
  case "$arg" in
    --run) DRY_RUN=0 ;;
    --dry-run|-n) DRY_RUN=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "sweep_sharding.sh: unknown argument '$arg' (use --run or --dry-run; see --help)" >&2; exit 2 ;;
  esac
done

SHAPES="${SHAPES:-fsdp=-1 data=2,fsdp=-1 fsdp=-1,tensor=2}"
CONFIG="${CONFIG:-minpro_jax/configs/paper/qwen3_8b.py:minpro,2}"
WORKDIR_PREFIX="${WORKDIR_PREFIX:-runs/sweep}"
MODEL_PATH="${MODEL_PATH:-}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
EXTRA_ARGS="${EXTRA_ARGS//$'\n'/ }"   # newlines separate words too
LAUNCHER="${LAUNCHER:-local}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$HERE")"

show() {  # print a command so that it can be pasted into a shell
  local out="+" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then out+=" $a"; else out+=" ${a@Q}"; fi
  done
  echo "$out"
}

workdir_for() {  # "data=2,fsdp=-1" -> $WORKDIR_PREFIX/mesh_data2_fsdp-1
  local name="${1//=/}"
  echo "$WORKDIR_PREFIX/mesh_${name//,/_}"
}

case "$LAUNCHER" in
  local|gpu|tpu) ;;
  *) echo "sweep_sharding.sh: LAUNCHER=$LAUNCHER; use local, gpu or tpu" >&2; exit 2 ;;
esac
read -r -a shapes <<< "$SHAPES"
if [[ ${#shapes[@]} == 0 ]]; then echo "sweep_sharding.sh: SHAPES is empty" >&2; exit 2; fi
echo "# sharding sweep: ${#shapes[@]} mesh shapes (${shapes[*]}); config $CONFIG; launcher $LAUNCHER"
[[ "$DRY_RUN" == 1 ]] && echo "# dry run (default): commands are printed, not executed; pass --run to execute"
cd "$REPO_ROOT"
for shape in "${shapes[@]}"; do
  workdir="$(workdir_for "$shape")"
  args="--config.mesh.shape=$shape${EXTRA_ARGS:+ $EXTRA_ARGS}"
  echo "# mesh.shape=$shape -> workdir $workdir"
  case "$LAUNCHER" in
    local)
      read -r -a extra <<< "$EXTRA_ARGS"
      cmd=(.venv/bin/python -m minpro_jax.train "--config=$CONFIG" "--config.mesh.shape=$shape"
           "--config.workdir=$workdir")
      [[ -n "$MODEL_PATH" ]] && cmd+=("--config.model.path=$MODEL_PATH")
      cmd+=("${extra[@]}")
      ;;
    gpu)
      cmd=(env STEPS=run "CONFIG=$CONFIG" "WORKDIR=$workdir" "MODEL_PATH=$MODEL_PATH" "EXTRA_ARGS=$args"
           bash "$HERE/gpu.sh")
      ;;
    tpu)
      cmd=(env STEPS=run "CONFIG=$CONFIG" "WORKDIR=$workdir" "MODEL_PATH=$MODEL_PATH" "EXTRA_ARGS=$args"
           bash "$HERE/tpu_vm.sh")
      ;;
  esac
  show "${cmd[@]}"
  if [[ "$DRY_RUN" == 0 ]]; then "${cmd[@]}"; fi
done
