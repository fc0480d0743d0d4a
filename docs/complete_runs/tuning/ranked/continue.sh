#!/usr/bin/env bash
# Continue the ranked 10-client ScatterNet studies (docs/results.md, "Rankings"): 64 finished trials
# each, TPE past its 10 random start-up trials, validation only (test never read).
#
#   bash docs/complete_runs/tuning/ranked/continue.sh            # all four studies, 4 trials a turn
#   STUDIES="local_dp_scatter" STEP=2 bash docs/complete_runs/tuning/ranked/continue.sh
#
# The studies run in runs/tune/ranked/<study>/ (trial run directories, not committed). After every
# turn of STEP trials the study's record is copied to $KEEP/<study>/ (default: this folder):
# study.db, which `tune` continues from in any checkout, trials.txt (one line per trial),
# best.yaml / best.json and search_space.yaml. A study copied here and absent from runs/ is
# restored from its study.db first, so a new session goes on where the last one stopped.
# The turns go round the studies, so they grow together.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
KEEP=${KEEP:-docs/complete_runs/tuning/ranked}
STEP=${STEP:-4}
TARGET=${TARGET:-64}
STUDIES=${STUDIES:-"local_dp_scatter dpfedavg_finetune_scatter dpfedavg_prior_scatter dpfedavg_scatter"}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=disabled

finished() {  # finished (complete or failed) trials in a study.db, 0 without one
  python - "$1" <<'PY'
import sqlite3, sys
from pathlib import Path
db = Path(sys.argv[1])
if not db.exists():
    print(0)
else:
    con = sqlite3.connect(db)
    print(con.execute("select count(*) from trials where state in ('COMPLETE', 'FAIL')").fetchone()[0])
PY
}

while :; do
  progressed=0
  for study in $STUDIES; do
    dir=runs/tune/ranked/$study
    mkdir -p "$dir" "$KEEP/$study"
    if [[ ! -f $dir/study.db && -f $KEEP/$study/study.db ]]; then
      cp "$KEEP/$study/study.db" "$dir/study.db"
    fi
    done_now=$(finished "$dir/study.db")
    (( done_now >= TARGET )) && continue
    want=$(( done_now + STEP < TARGET ? done_now + STEP : TARGET ))
    echo "$(date -u +%FT%TZ) $study: $done_now finished, continuing to $want"
    nice -n 15 python -m fedfdp.experiments tune --config "configs/fmnist_${study}.yaml" \
      --space "configs/search_spaces/ranked/fmnist_${study}.yaml" --study-dir "$dir" --study-name "$study" \
      --trials "$want" --objective "val_accuracy+val_accuracy_worst" --val-fraction 0.1 --last 5 \
      --fit-args --model.eval_train_splits false || true  # the objective reads validation only: no train-split evaluation
    for f in study.db trials.txt best.yaml best.json search_space.yaml; do
      if [[ -f $dir/$f ]]; then cp "$dir/$f" "$KEEP/$study/$f"; fi
    done
    if (( $(finished "$dir/study.db") > done_now )); then
      progressed=1
    else  # no trial ended: a broken setup, not a reason to loop; the other studies go on
      echo "$(date -u +%FT%TZ) $study: no trial ended in this turn; left out (see $dir/trial*/fit.log)" >&2
      STUDIES=${STUDIES//$study/}
    fi
  done
  (( progressed )) || break
done
echo "$(date -u +%FT%TZ) done: every study left holds $TARGET finished trials${STUDIES:+ ($STUDIES)}"
