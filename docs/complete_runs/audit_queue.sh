#!/bin/bash
# the tightness page's audit runs (docs/results/audit.md), one after another, at nice 15
cd "$(dirname "$0")/../.." && . .venv/bin/activate && export OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline
mkdir -p runs/audit
a() { local name=$1; shift; [ -f runs/audit/$name/summary.json ] && grep -q '"status": "\(completed\|budget_spent\)' runs/audit/$name/summary.json && return
  nice -n 15 "$@" --run_dir runs/audit/$name --trainer.enable_progress_bar false > runs/audit/$name.out 2>&1; echo "$name rc=$?" >> runs/audit/done.txt; }
POP="--config configs/population/fmnist_client_dp.yaml --model.algorithm.init_args.privacy.init_args.noise_multiplier 1.0 --trainer.callbacks.init_args.target_epsilon 4"
SCAT="--config configs/fmnist_dpfedavg_scatter.yaml --trainer.callbacks.init_args.target_epsilon 8"
a population_eps4 python -m fedfdp.audit $POP
a population_eps4_no_canaries python -m fedfdp.fit $POP
a scatter_eps8 python -m fedfdp.audit $SCAT
a scatter_eps8_no_canaries python -m fedfdp.fit $SCAT
a table4 python -m fedfdp.audit --config configs/fmnist_dpfedavg.yaml
a scatter_eps8_10k python -m fedfdp.audit $SCAT --canaries 10000
