#!/usr/bin/env bash
# The ranked studies' winners on test: each study's best.yaml (chosen on validation only, 10 clients,
# Dir(0.1)) trained with 3 seeds on each split of SPLITS, then copied into
# docs/complete_runs/ranked_<split>/ and the index rewritten.
#
#   bash docs/complete_runs/tuning/ranked/winners.sh                     # every study and split, seeds 0 1 2
#   STUDIES="local_dp_scatter" SEEDS="0" SPLITS="10:0.1" bash docs/complete_runs/tuning/ranked/winners.sh
#
# A split is CLIENTS:ALPHA (data.init_args.num_clients and the Dirichlet alpha; nothing else of the
# config changes, as between configs/fmnist_*_scatter.yaml and configs/fmnist50_*_scatter.yaml):
# 10:0.1 the studies' own split, 50:0.1 clients with little data, 10:0.5 a less skewed split; the
# last two keep the 10-client Dir(0.1) settings (not tuned again). Finished runs are skipped,
# interrupted ones resumed from their last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
KEEP=docs/complete_runs/tuning/ranked
STUDIES=${STUDIES:-"local_dp_scatter dpfedavg_finetune_scatter dpfedavg_prior_scatter dpfedavg_scatter"}
SEEDS=${SEEDS:-"0 1 2"}
SPLITS=${SPLITS:-"10:0.1 50:0.1 10:0.5"}
OUT=${OUT:-runs/ranked_winners}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=disabled

split_name() {  # 10:0.1 -> fmnist10, 50:0.1 -> fmnist50, 10:0.5 -> fmnist10_dir0p5
  local clients=${1%%:*} alpha=${1##*:}
  if [[ $alpha == 0.1 ]]; then echo "fmnist$clients"; else echo "fmnist${clients}_dir${alpha/./p}"; fi
}

for split in $SPLITS; do
  name=$(split_name "$split")
  for study in $STUDIES; do
    best=$KEEP/$study/best.yaml
    [[ -f $best ]] || { echo "no $best: the study has no finished trial" >&2; continue; }
    config=$OUT/configs/${study}_$name.yaml
    mkdir -p "$(dirname "$config")"
    python - "$best" "${split%%:*}" "${split##*:}" "$config" <<'PY'
import sys, yaml
best = yaml.safe_load(open(sys.argv[1]))
data = best["data"]["init_args"]
data["num_clients"], data["alpha"] = int(sys.argv[2]), float(sys.argv[3])
open(sys.argv[4], "w").write(f"# {sys.argv[1]} (chosen at 10 clients, Dir(0.1), validation only) with "
                             f"{sys.argv[2]} clients, Dir({sys.argv[3]})\n" + yaml.safe_dump(best, sort_keys=False))
PY
    for seed in $SEEDS; do
      dir=$OUT/$name/$name/$study/seed$seed
      if [[ -f $dir/summary.json ]] && grep -q '"status": "\(completed\|budget_spent\)"' "$dir/summary.json"; then
        continue
      fi
      echo "$(date -u +%FT%TZ) $study, $name, seed $seed"
      resume=(); [[ -d $dir/checkpoints ]] && resume=(--ckpt_path last)
      nice -n 15 python -m fedfdp.fit --config "$config" --run_dir "$dir" --seed_everything "$seed" \
        --trainer.enable_progress_bar false --wandb disabled "${resume[@]}" \
        > "$OUT/${name}_${study}_seed$seed.log" 2>&1 || echo "failed: see $OUT/${name}_${study}_seed$seed.log" >&2
    done
  done
  python docs/complete_runs/index.py add --src "$OUT/$name" --dest "docs/complete_runs/ranked_$name" 2>&1 | tail -n 3
done
python docs/complete_runs/index.py write
