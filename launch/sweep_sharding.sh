#!/usr/bin/env bash
# Sharding sweep over mesh shapes. COMPILE-ONLY BY DEFAULT: one `python -m minpro_jax.aot` call compiles the
# config's programs for every shape on a TPU topology (or cpu:N) on this machine, with no accelerator, and prints one
# table (per-device memory, fits / does not fit, FLOPs, roofline estimate, collectives). --run trains once per shape
# instead (each in its own workdir); --dry-run prints those training commands.
#
#   launch/sweep_sharding.sh                                   # compile the 8B paper config for v5p-8, 3 shapes
#   TOPOLOGY=v5p-64 SHAPES="fsdp=-1 data=2,fsdp=-1" OUT=reports/8b_v5p64.json launch/sweep_sharding.sh
#   TOPOLOGY=cpu:8 CONFIG=configs/default.py SHAPES="data=8 fsdp=8" launch/sweep_sharding.sh
#   SHAPES="fsdp=-1 data=2,fsdp=-1" EXTRA_ARGS="--config.total_steps=5" launch/sweep_sharding.sh --run
#   SHAPES="fsdp=-1,tensor=2" RULES="default default:mlp=fsdp,q_heads=fsdp,kv_heads=fsdp" launch/sweep_sharding.sh
#   LAUNCHER=tpu TPU_NAME=my-v5p ZONE=us-east5-a MODEL_PATH=/mnt/ckpt/Qwen3-8B-Base launch/sweep_sharding.sh --run
#
# Environment: SHAPES (space-separated mesh shapes; axes data, fsdp, tensor, expert; one size may be -1 = the
# remaining devices; default "fsdp=-1 data=2,fsdp=-1 fsdp=-1,tensor=2"); CONFIG (default
# configs/paper/qwen3_8b.py:minpro,2); RULES (space-separated learner logical-axis rules as config.mesh.rules takes
# them, each crossed with every shape; default the config's; minpro_jax/runtime/rules.py); EXTRA_ARGS (added to
# every command).
# Compile-only: TOPOLOGY (default v5p-8; v4-N, v5e-N, v5p-N, v6e-N or cpu:N), PROGRAMS (default
# update,score,prefill,decode), REMAT (space-separated remat policies; default the config's), OUT (JSON report; a
# rerun keeps the rows it already has), DUMP_HLO (folder for the optimized HLO and shardings). See docs/aot.md.
# --run / --dry-run: WORKDIR_PREFIX (default runs/sweep; the workdir of shape "data=2,fsdp=-1" is
# $WORKDIR_PREFIX/mesh_data2_fsdp-1); MODEL_PATH; LAUNCHER: local (default: .venv/bin/python on this machine) | gpu
# (launch/gpu.sh, STEPS=run) | tpu (launch/tpu_vm.sh, STEPS=run, on every worker; needs TPU_NAME and ZONE).
# Each run writes metrics.jsonl / summary.json to its workdir; compare step times there. A failing shape (e.g. a
# size that does not divide the device count or the heads) stops the sweep.
set -euo pipefail

MODE=compile
for arg in "$@"; do
  case "$arg" in
    --run) MODE=run ;;
    --dry-run|-n) MODE=dry-run ;;
    --compile) MODE=compile ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "sweep_sharding.sh: unknown argument '$arg' (use --run, --dry-run or --compile; see --help)" >&2; exit 2 ;;
  esac
done

SHAPES="${SHAPES:-fsdp=-1 data=2,fsdp=-1 fsdp=-1,tensor=2}"
CONFIG="${CONFIG:-configs/paper/qwen3_8b.py:minpro,2}"
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
cd "$REPO_ROOT"
if [[ "$MODE" == compile ]]; then
  TOPOLOGY="${TOPOLOGY:-v5p-8}"
  echo "# compile-only sharding sweep: ${#shapes[@]} mesh shapes (${shapes[*]}); config $CONFIG; topology $TOPOLOGY"
  cmd=(.venv/bin/python -m minpro_jax.aot "--config=$CONFIG" "--topology=$TOPOLOGY"
       "--programs=${PROGRAMS:-update,score,prefill,decode}")
  for shape in "${shapes[@]}"; do cmd+=("--mesh=$shape"); done
  read -r -a rule_sets <<< "${RULES:-}"
  for r in "${rule_sets[@]}"; do cmd+=("--rules=$r"); done
  read -r -a remats <<< "${REMAT:-}"
  for r in "${remats[@]}"; do cmd+=("--remat=$r"); done
  [[ -n "${OUT:-}" ]] && cmd+=("--out=$OUT")
  [[ -n "${DUMP_HLO:-}" ]] && cmd+=("--dump-hlo=$DUMP_HLO")
  [[ -n "$MODEL_PATH" ]] && cmd+=("--config.model.path=$MODEL_PATH")
  read -r -a extra <<< "$EXTRA_ARGS"
  cmd+=("${extra[@]}")
  show "${cmd[@]}"
  exec "${cmd[@]}"
fi
echo "# sharding sweep: ${#shapes[@]} mesh shapes (${shapes[*]}); config $CONFIG; launcher $LAUNCHER"
[[ "$MODE" == dry-run ]] && echo "# dry run: commands are printed, not executed; pass --run to execute"
read -r -a rule_sets <<< "${RULES:-}"
[[ ${#rule_sets[@]} == 0 ]] && rule_sets=("")
for shape in "${shapes[@]}"; do
for ri in "${!rule_sets[@]}"; do
  rules="${rule_sets[$ri]}"
  workdir="$(workdir_for "$shape")${rules:+_rules$ri}"
  args="--config.mesh.shape=$shape${rules:+ --config.mesh.rules=$rules}${EXTRA_ARGS:+ $EXTRA_ARGS}"
  echo "# mesh.shape=$shape${rules:+ mesh.rules=$rules} -> workdir $workdir"
  case "$LAUNCHER" in
    local)
      read -r -a extra <<< "$EXTRA_ARGS"
      cmd=(.venv/bin/python -m minpro_jax.train "--config=$CONFIG" "--config.mesh.shape=$shape"
           "--config.workdir=$workdir")
      [[ -n "$rules" ]] && cmd+=("--config.mesh.rules=$rules")
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
  if [[ "$MODE" == run ]]; then "${cmd[@]}"; fi
done
done
