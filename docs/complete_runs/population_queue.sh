#!/bin/bash
# The population table's test runs (docs/results/population.md): seeds 0-2 of every tuned row, one after
# another, at nice 15; rerun to continue (finished runs are skipped, interrupted ones resume from their
# last checkpoint). On a fresh checkout run `python docs/complete_runs/index.py restore` first (it puts the
# parked runs back under runs/), and after it `python docs/complete_runs/index.py add --src runs/population
# --dest docs/complete_runs/population_fmnist` (only rows with 3 finished seeds are committed).
cd "$(dirname "$0")/../.." && . .venv/bin/activate && export OMP_WAIT_POLICY=PASSIVE WANDB_MODE=offline
run() {  # run <row> <config> <seed> [overrides...]
  # a committed run is not restored under runs/ (it has no harness.json): look for it where it is committed
  local dir=runs/population/$1/seed$3 committed=docs/complete_runs/population_fmnist/$1/seed$3 cfg=$2 seed=$3; shift 3
  for done in $dir $committed; do
    if [ -f $done/summary.json ] && grep -q '"status": "\(completed\|budget_spent\)' $done/summary.json; then return; fi
  done
  local resume=""; [ -f $dir/checkpoints/last.ckpt ] && resume="--ckpt_path last"
  [ -d $dir ] && [ -z "$resume" ] && mv $dir $dir.stale-$(date +%s)
  mkdir -p $(dirname $dir)
  nice -n 15 python -m fedfdp.fit --config $cfg --run_dir $dir --seed_everything $seed --trainer.enable_progress_bar false \
    $resume "$@" > /dev/null 2>> runs/population/fit.log || echo "failed $dir" >> runs/population/fit.log
}
mkdir -p runs/population
for s in 0 1 2; do
  run client_dp_fixed_eps2 configs/tuned/population_client_dp.yaml $s
  run client_dp_adaptive_eps2 configs/tuned/population_client_dp_adaptive.yaml $s
  run fedavg_nonprivate configs/tuned/population_fedavg.yaml $s
done
for e in 1 4 8; do  # a row's three seeds before the next row's (a row is committed once it has all three)
  for s in 0 1 2; do run client_dp_fixed_eps$e configs/tuned/population_client_dp.yaml $s --trainer.callbacks.init_args.target_epsilon $e; done
  for s in 0 1 2; do run client_dp_adaptive_eps$e configs/tuned/population_client_dp_adaptive.yaml $s --trainer.callbacks.init_args.target_epsilon $e; done
done
