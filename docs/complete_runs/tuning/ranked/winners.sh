#!/usr/bin/env bash
# The ranked studies' winners on test: each study's best.yaml (validation only) trained with 3 seeds
# at 10 clients, and with the same settings at 50 clients (data.init_args.num_clients: 50, as configs/fmnist50_*),
# then copied into docs/complete_runs/ranked_fmnist{10,50}/ and the index rewritten.
#
#   bash docs/complete_runs/tuning/ranked/winners.sh                     # every study, seeds 0 1 2
#   STUDIES="local_dp_scatter" SEEDS="0" CLIENTS="10" bash docs/complete_runs/tuning/ranked/winners.sh
#
# Finished runs are skipped (fedfdp.fit refuses a finished run directory; the runner skips it).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
KEEP=docs/complete_runs/tuning/ranked
STUDIES=${STUDIES:-"local_dp_scatter dpfedavg_finetune_scatter dpfedavg_prior_scatter dpfedavg_scatter"}
SEEDS=${SEEDS:-"0 1 2"}
CLIENTS=${CLIENTS:-"10 50"}
OUT=${OUT:-runs/ranked_winners}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=disabled

for clients in $CLIENTS; do
  for study in $STUDIES; do
    best=$KEEP/$study/best.yaml
    [[ -f $best ]] || { echo "no $best: the study has no finished trial" >&2; continue; }
    config=$best
    if [[ $clients != 10 ]]; then  # the 10-client winner's settings on the 50-client split
      config=$OUT/configs/${study}_fmnist$clients.yaml
      mkdir -p "$(dirname "$config")"
      python - "$best" "$clients" "$config" <<'PY'
import sys, yaml
best = yaml.safe_load(open(sys.argv[1]))
best["data"]["init_args"]["num_clients"] = int(sys.argv[2])  # the only difference of the fmnist50 configs
open(sys.argv[3], "w").write(f"# {sys.argv[1]} (chosen at 10 clients, validation only) with {sys.argv[2]} clients\n"
                             + yaml.safe_dump(best, sort_keys=False))
PY
    fi
    for seed in $SEEDS; do
      dir=$OUT/c$clients/fmnist$clients/$study/seed$seed
      if [[ -f $dir/summary.json ]] && grep -q '"status": "\(completed\|budget_spent\)"' "$dir/summary.json"; then
        continue
      fi
      echo "$(date -u +%FT%TZ) $study, $clients clients, seed $seed"
      nice -n 15 python -m fedfdp.fit --config "$config" --run_dir "$dir" --seed_everything "$seed" \
        --trainer.enable_progress_bar false --wandb disabled $( [[ -d $dir ]] && echo --ckpt_path last ) \
        > "$OUT/fmnist${clients}_${study}_seed$seed.log" 2>&1 || echo "failed: see $OUT/fmnist${clients}_${study}_seed$seed.log" >&2
    done
  done
done
for clients in $CLIENTS; do
  python docs/complete_runs/index.py add --src "$OUT/c$clients" --dest "docs/complete_runs/ranked_fmnist$clients" 2>&1 \
    | grep "fmnist$clients" || true
done
python docs/complete_runs/index.py write
