#!/usr/bin/env bash
# Run minpro_jax on a Cloud TPU VM (single host or a multi-host pod): every step runs on ALL workers at once via
# `gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "..."`.
#
#   TPU_NAME=my-v5p ZONE=us-east5-a MODEL_PATH=/mnt/ckpt/Qwen3-8B-Base launch/tpu_vm.sh --dry-run   # show only
#   TPU_NAME=my-v5p ZONE=us-east5-a MODEL_PATH=/mnt/ckpt/Qwen3-8B-Base launch/tpu_vm.sh             # sync, setup, run
#   CREATE=1 ACCELERATOR_TYPE=v5p-32 TPU_NAME=... ZONE=... launch/tpu_vm.sh             # create the VM first
#   STEPS=run TPU_NAME=... ZONE=... EXTRA_ARGS="--config.total_steps=10" launch/tpu_vm.sh             # rerun / resume
#
# Steps (STEPS, space separated; default "sync setup run", plus "create" first when CREATE=1):
#   create  gcloud compute tpus tpu-vm create (ACCELERATOR_TYPE, RUNTIME_VERSION, SPOT=1 for spot capacity)
#   sync    REPO_URL set: git clone (or fetch + checkout REPO_REF) on every worker; else pack this checkout
#           (tracked + untracked-not-ignored files, so no .venv/runs/cache) and scp + unpack it on every worker
#   setup   Python 3.11 venv (apt installs python3.11 if missing), `make setup`, then the TPU jaxlib (JAX_TPU_PIP)
#   run     MINPRO_DISTRIBUTED=1 .venv/bin/python -m minpro_jax.train --config=$CONFIG ... on every worker
#           (minpro_jax.runtime.distributed then calls jax.distributed.initialize; a single-host VM is simply 1 process)
#
# Environment: TPU_NAME, ZONE (required); PROJECT; CONFIG (default configs/paper/qwen3_8b.py:minpro,2);
# MODEL_PATH (--config.model.path; must exist on every worker: copy it there or use a shared mount);
# WORKDIR (--config.workdir; orbax multi-host checkpoints need a path all workers share: an NFS or gcsfuse mount);
# EXTRA_ARGS (more --config.FIELD=VALUE flags, word-split); REMOTE_DIR (default minpro_jax, relative to $HOME);
# REPO_URL, REPO_REF (default main); JAX_TPU_PIP (default "jax[tpu]==0.10.2", matching requirements.txt);
# PYTHON (default python3.11); DETACH=1 (run under nohup, log to REMOTE_DIR/train_worker.log, return at once);
# GCLOUD_SSH_FLAGS (extra ssh flags, e.g. "--internal-ip" or "--tunnel-through-iap").
set -euo pipefail

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run|-n) DRY_RUN=1 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "tpu_vm.sh: unknown argument '$arg' (settings are environment variables; see --help)" >&2; exit 2 ;;
  esac
done

: "${TPU_NAME:?set TPU_NAME (the TPU VM name)}"
: "${ZONE:?set ZONE (e.g. us-east5-a)}"
PROJECT="${PROJECT:-}"
CONFIG="${CONFIG:-configs/paper/qwen3_8b.py:minpro,2}"
MODEL_PATH="${MODEL_PATH:-}"
WORKDIR="${WORKDIR:-}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
EXTRA_ARGS="${EXTRA_ARGS//$'\n'/ }"   # newlines separate words too
REMOTE_DIR="${REMOTE_DIR:-minpro_jax}"
REPO_URL="${REPO_URL:-}"
REPO_REF="${REPO_REF:-main}"
JAX_TPU_PIP="${JAX_TPU_PIP:-jax[tpu]==0.10.2}"
PYTHON="${PYTHON:-python3.11}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5p-32}"
# Runtime image: v5p v2-alpha-tpuv5, v5e v2-alpha-tpuv5-lite, v6e v2-alpha-tpuv6e, v4 tpu-ubuntu2204-base.
RUNTIME_VERSION="${RUNTIME_VERSION:-v2-alpha-tpuv5}"
DETACH="${DETACH:-0}"
GCLOUD_SSH_FLAGS="${GCLOUD_SSH_FLAGS:-}"
if [[ -n "${STEPS:-}" ]]; then
  steps="$STEPS"
else
  steps="sync setup run"
  [[ "${CREATE:-0}" == 1 ]] && steps="create $steps"
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
project_flags=()
[[ -n "$PROJECT" ]] && project_flags=(--project "$PROJECT")
read -r -a ssh_extra <<< "$GCLOUD_SSH_FLAGS"

sq() {  # quote one word for the remote shell (single quotes only when it has special characters)
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

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

on_all_workers() {  # $1: remote shell command, run on every worker of the TPU VM
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" "${project_flags[@]}" "${ssh_extra[@]}" \
    --worker=all --command "$1"
}

step_create() {
  local spot=()
  [[ "${SPOT:-0}" == 1 ]] && spot=(--spot)
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" "${project_flags[@]}" \
    --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" "${spot[@]}"
}

step_sync() {
  if [[ -n "$REPO_URL" ]]; then
    on_all_workers "set -e; if [ -d $(sq "$REMOTE_DIR")/.git ]; then git -C $(sq "$REMOTE_DIR") fetch -q origin; \
else git clone -q $(sq "$REPO_URL") $(sq "$REMOTE_DIR"); fi; git -C $(sq "$REMOTE_DIR") checkout -q $(sq "$REPO_REF")"
    return
  fi
  local tarball="${TMPDIR:-/tmp}/minpro_jax_src.tar.gz"
  echo "# pack $REPO_ROOT (git ls-files: tracked + untracked-not-ignored) into $tarball"
  if [[ "$DRY_RUN" == 0 ]]; then
    (cd "$REPO_ROOT" && git ls-files -z --cached --others --exclude-standard -- . ':!runs' \
      | tar czf "$tarball" --ignore-failed-read --null -T -)
  fi
  run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:minpro_jax_src.tar.gz" --zone "$ZONE" \
    "${project_flags[@]}" "${ssh_extra[@]}" --worker=all
  on_all_workers "set -e; mkdir -p $(sq "$REMOTE_DIR"); tar xzf minpro_jax_src.tar.gz -C $(sq "$REMOTE_DIR")"
}

step_setup() {
  on_all_workers "set -e; cd $(sq "$REMOTE_DIR"); \
if ! command -v $(sq "$PYTHON") >/dev/null; then \
sudo apt-get update -q && sudo apt-get install -y -q $(sq "$PYTHON") $(sq "$PYTHON-venv"); fi; \
test -x .venv/bin/python || $(sq "$PYTHON") -m venv .venv; \
make setup; .venv/bin/pip install -q $(sq "$JAX_TPU_PIP"); \
.venv/bin/python -c 'import jax; print(\"jax\", jax.__version__)'"
}

train_command() {  # the python part; step_run puts MINPRO_DISTRIBUTED=1 (and nohup) in front
  local cmd=".venv/bin/python -m minpro_jax.train --config=$(sq "$CONFIG")"
  [[ -n "$MODEL_PATH" ]] && cmd+=" --config.model.path=$(sq "$MODEL_PATH")"
  [[ -n "$WORKDIR" ]] && cmd+=" --config.workdir=$(sq "$WORKDIR")"
  local extra=() w
  read -r -a extra <<< "$EXTRA_ARGS"
  for w in "${extra[@]}"; do cmd+=" $(sq "$w")"; done
  echo "$cmd"
}

step_run() {
  local cmd
  cmd="$(train_command)"
  if [[ "$DETACH" == 1 ]]; then
    on_all_workers "cd $(sq "$REMOTE_DIR") && \
MINPRO_DISTRIBUTED=1 nohup $cmd > train_worker.log 2>&1 < /dev/null & echo started"
  else
    on_all_workers "cd $(sq "$REMOTE_DIR") && MINPRO_DISTRIBUTED=1 $cmd"
  fi
}

echo "# minpro_jax on TPU VM '$TPU_NAME' (zone $ZONE${PROJECT:+, project $PROJECT}); steps: $steps"
echo "# config: $CONFIG; model: ${MODEL_PATH:-<config default>}; workdir: ${WORKDIR:-<config default>}"
[[ "$DRY_RUN" == 1 ]] && echo "# dry run: commands are printed, not executed"
for s in $steps; do
  case "$s" in
    create|sync|setup|run) echo "# step: $s"; "step_$s" ;;
    *) echo "tpu_vm.sh: unknown step '$s' in STEPS (use create sync setup run)" >&2; exit 2 ;;
  esac
done
