#!/usr/bin/env bash
# A plain lr grid, the same for RC-DPFL, each client alone with DP-SGD and DPFedAvg, on the shortened
# RC-DPFL settings of docs/results.md (MNIST at eps 5, digits at eps 2): is RC-DPFL's lead over
# training alone an artefact of an lr chosen for the federated methods?
#
# Tuned on validation only: every trial holds 10 % of each client's training records out
# (tune --val-fraction 0.1) and scores the final model's mean validation accuracy over seeds 0
# and 1 (--last 1: the runs evaluate every 10 rounds). The chosen lr then trains seeds 0
# and 1 on the same 90 % (rcdpfl-table with the study's lr and val_fraction), whose test metrics
# are the only test numbers read. Resumable: run it again to continue.
#
#   bash docs/complete_runs/tuning/rcdpfl_lr/grid.sh        # about 1.5 CPU-hours on this machine
set -euo pipefail
cd "$(dirname "$0")/../../../.."
here=docs/complete_runs/tuning/rcdpfl_lr
out=runs/rcdpfl_lr
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE=disabled
exp="nice -n 15 python -m fedfdp.experiments"
for setting in mnist:5 digits:2; do
  dataset=${setting%:*} eps=${setting#*:}
  for method in ${METHODS:-local rcdpfl dpfedavg}; do
    study=$out/${dataset}_$method
    config=$out/configs/${dataset}_${method}_eps$eps.yaml  # the table's config at its eps (rcdpfl-table's make_config)
    mkdir -p "$out/configs" "$here/${dataset}_$method"
    python -c "import sys, yaml; from pathlib import Path; from fedfdp.experiments.rcdpfl import make_config
yaml.safe_dump(make_config(Path(sys.argv[1]), seed=0, epsilon=float(sys.argv[2]), rounds=None), open(sys.argv[3], 'w'), sort_keys=False)" \
      "configs/rcdpfl/${dataset}_$method.yaml" "$eps" "$config"
    $exp tune --config "$config" --trials 5 --sampler grid --space $here/lr_grid.yaml --seeds 0 1 --last 1 \
      --val-fraction 0.1 --study-dir "$study"
    cp "$study/study.db" "$study/trials.txt" "$study/best.json" "$here/${dataset}_$method/"
    lr=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['params']['model.algorithm.init_args.lr'])" \
      "$study/best.json")
    $exp rcdpfl-table --dataset "$dataset" --methods "$method" --seeds 0 1 --epsilons "$eps" \
      --out "$out/${dataset}_${method}_tuned" --override=--model.algorithm.init_args.lr=$lr \
      --override=--data.init_args.val_fraction=0.1 | tee "$here/${dataset}_$method/test_at_chosen_lr.md"
  done
done
