#!/usr/bin/env bash
# The seed papers' runs that are still missing (issue 38), on this project's CPU: one queue of
# harness commands that skip finished runs and resume interrupted ones, worked by lanes in the
# background, so the same command continues the queue in a later session. Each lane takes the next
# job no lane has taken this session (a claim is an atomic mkdir), so the lanes balance themselves:
# a lane whose job ended early takes the next one. After each job its finished runs are copied into
# docs/complete_runs/ (index.py add) and the index rewritten; committing them is left to the
# session (git add docs/complete_runs).
#
#   bash docs/complete_runs/cpu_queue.sh            # two lanes, detached; logs in runs/cpu_queue/
#   LANES=1 bash docs/complete_runs/cpu_queue.sh    # one lane (e.g. while the cores are needed)
#   bash docs/complete_runs/cpu_queue.sh list       # the jobs, in order
#   bash docs/complete_runs/cpu_queue.sh stop       # stop every lane after its round, then park
#
# A checkout does not keep runs/: before a session ends, `bash docs/complete_runs/cpu_queue.sh stop`
# (up to a round's time: one SIGTERM to each lane's process group ends the lane and its harness, and
# lets the running fit end its round and checkpoint; a kill instead would cut the round, whose
# releases stay charged and are made again, a round of budget lost each time: docs/running.md), then
# commit docs/complete_runs: `stop` ends with `index.py park`, which copies the stopped runs' last
# checkpoints to docs/complete_runs/in_progress/, and this script's restore writes them back, so the
# next session resumes them where they stopped.
#
# The jobs (queue below): each client alone in FedFDP's Tables VI, V and IV (MNIST), with DP-SGD and
# without; FinP's CNN with Adam (DP rows, each client alone, main rows); RC-DPFL at the paper's
# setting, one seed a job (DPFedAvg, IFCA, RC-DPFL, the oracle, KM-CDPFL, each client alone with
# DP-SGD, then without DP), on MNIST, then on FashionMNIST (seed 0's seven rows first).
# Measured on the 2 cores, two lanes side by side: a local DP-SGD run 1 to 25 min (eps 1 to 3.52), a
# no-DP local run about an hour, a FinP DP run about 25 min, a FinP main run 25 (FedAvg) to 55 (FinP
# with its client penalty; FinP_server (PCA) 24 to 38, FinP_server (ALA) 38), an RC-DPFL run at the
# paper's setting 53 to 120 min (17 to 36 s a round, by the other lane's load; IFCA 53 to 78, RC-DPFL
# 63, the oracle 59, KM-CDPFL 54 to 79, each client alone with DP-SGD 54 to 73, without DP about 37
# at 11 s a round). FinP's table is complete, and RC-DPFL's MNIST table (2026-11-29's seventh
# session). Left: RC-DPFL on FashionMNIST at the paper's setting, 19 of 21 runs (each client alone
# with DP-SGD and the oracle, seed 0, parked at rounds 166 and 109), about 18 lane-hours (9 hours of
# two lanes; 16 to 21 s a round); on a lent GPU: gpu_session.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
LANES=${LANES:-"1 2"}
LOG=${CPU_QUEUE_LOG:-runs/cpu_queue}  # (CPU_QUEUE_LOG, CPU_QUEUE_EXP, CPU_QUEUE_KEEP: the script's test)
mkdir -p "$LOG"
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled
exp=${CPU_QUEUE_EXP:-"nice -n 15 python -m fedfdp.experiments"}
keep() { [ "${CPU_QUEUE_KEEP:-1}" = 1 ] || return 0
         python docs/complete_runs/index.py add --src "$1" --dest "docs/complete_runs/$2" | tail -n 2
         python docs/complete_runs/index.py write; }

# One job a line: "<harness arguments> | <finished runs to keep: source, destination under docs/complete_runs>"
queue() {
  echo "paper-table6 --dataset fmnist --seeds 0 1 2 --methods local_dp --jobs 1 --out runs/paper | runs/paper/table6 table6_fmnist"
  echo "paper-table5 --dataset fmnist --seeds 0 1 2 --methods local_dp --columns 'Dir(0.5)' 'Dir(1.0)' --jobs 1 --out runs/paper | runs/paper/table5 table5_fmnist"
  # the MNIST column only: <method>/seed<k>, named local_dp and local
  echo "paper-table4 --dataset mnist --seeds 0 1 2 --methods local_dp local --jobs 1 --out runs/paper | runs/paper/table4/mnist table4_mnist"
  echo "paper-table5 --dataset fmnist --seeds 0 1 2 --methods local --columns 'Dir(0.5)' 'Dir(1.0)' --jobs 1 --out runs/paper | runs/paper/table5 table5_fmnist"
  echo "finp-table --dataset fmnist_cnn --rows dp --seeds 0 1 2 --out runs/finp_cnn | runs/finp_cnn finp_fmnist"
  echo "finp-table --dataset fmnist_cnn --rows alone --seeds 0 1 2 --out runs/finp_cnn | runs/finp_cnn finp_fmnist"
  for row in baseline finp_client finp_server_pca finp_pca finp_server_ala finp_ala; do  # FinP's main rows
    for seed in 0 1 2; do
      echo "finp-table --dataset fmnist_cnn --rows $row --seeds $seed --out runs/finp_cnn | runs/finp_cnn finp_fmnist"
    done
  done
  for method in dpfedavg ifca rcdpfl oracle kmcdpfl local local_nodp; do
    for seed in 0 1 2; do  # one seed a job: each run is copied to docs/complete_runs as it lands
      echo "rcdpfl-table --dataset mnist_paper --methods $method --seeds $seed --out runs/rcdpfl_paper | runs/rcdpfl_paper rcdpfl_mnist"
    done
  done
  for seed in 0 1 2; do  # FashionMNIST at the paper's setting: a seed's whole table before the next seed
    for method in rcdpfl dpfedavg local oracle ifca kmcdpfl local_nodp; do
      echo "rcdpfl-table --dataset fmnist_paper --methods $method --seeds $seed --out runs/rcdpfl_paper_fmnist | runs/rcdpfl_paper_fmnist rcdpfl_fmnist"
    done
  done
}

# A lane: take the first job no lane has claimed, run it, keep its runs; until the queue is done.
lane() {
  local n=0 line
  while IFS= read -r line; do
    n=$((n + 1))
    mkdir "$LOG/claims/$n" 2> /dev/null || continue  # atomic: another lane has it
    echo "$(date -u +%FT%TZ) lane $1: job $n: ${line%%|*}"
    eval "$exp ${line%%|*}" || echo "$(date -u +%FT%TZ) lane $1: job $n ended with status $?"
    eval "keep ${line#*|}"
  done < <(queue)
  echo "$(date -u +%FT%TZ) lane $1: the queue is done"
}

if [ "${1:-}" = list ]; then
  queue | nl -w3 -s'  '
  exit 0
fi

# stop parks with index.py (torch), the lanes run the harnesses: both need the project's python
python -c "import torch, fedfdp" 2> /dev/null || {
  echo "error: cpu_queue.sh: $(command -v python || echo python) cannot import torch and fedfdp: activate the project's venv first (. .venv/bin/activate)" >&2
  exit 1; }

if [ "${1:-}" = stop ]; then
  groups=()
  for pidfile in "$LOG"/lane*.pid; do
    [ -e "$pidfile" ] || continue
    pgid=$(ps -o pgid= -p "$(cat "$pidfile")" 2>/dev/null | tr -d ' ') || true
    [ -n "$pgid" ] && groups+=("$pgid") && kill -TERM -- "-$pgid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  echo "stopping ${#groups[@]} lane(s): each running fit ends its round and checkpoints"
  for _ in $(seq "${STOP_WAIT:-900}"); do  # the slowest round measured here: about 40 s
    alive=0
    for pgid in "${groups[@]}"; do pgrep -g "$pgid" > /dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  if [ "$alive" = 1 ]; then
    echo "error: lanes still running after ${STOP_WAIT:-900} s (process groups ${groups[*]}): not parked" >&2
    exit 1
  fi
  python docs/complete_runs/index.py park
  exit 0
fi

# runs/ is not committed: a fresh checkout gets the committed finished runs back first, so the
# harnesses skip them (index.py restore keeps every run directory that exists)
for pidfile in "$LOG"/lane*.pid; do  # one set of lanes at a time: the claims are theirs
  if [ -e "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2> /dev/null; then
    echo "error: a lane is running already (pid $(cat "$pidfile"), $pidfile): stop the lanes first with" \
         "bash $0 stop" >&2
    exit 1
  fi
done
rm -rf "$LOG/claims" && mkdir -p "$LOG/claims"
[ "${CPU_QUEUE_KEEP:-1}" = 1 ] && { python docs/complete_runs/index.py restore | grep -c '^restored' \
  | sed 's/^/restored committed runs: /' || true; }
export LOG exp  # the lanes' shells read them
for lane in $LANES; do
  # the lane's shell writes its own pid: it leads the lane's process group (setsid), which `stop` signals
  rm -f "$LOG/lane$lane.pid"
  setsid nohup bash -c "echo \$\$ > '$LOG/lane$lane.pid'; $(declare -f keep queue lane); lane $lane" \
    > "$LOG/lane$lane.log" 2>&1 < /dev/null &
  for _ in $(seq 100); do [ -s "$LOG/lane$lane.pid" ] && break; sleep 0.1; done  # `stop` right after finds it
  echo "lane $lane: pid $(cat "$LOG/lane$lane.pid" 2> /dev/null || echo "$!"), log $LOG/lane$lane.log"
done
