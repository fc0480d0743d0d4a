#!/usr/bin/env bash
# Continue the ranked 10-client ScatterNet studies (docs/results.md, "Rankings"): 64 scored trials
# each (a failed trial, an infeasible point of the space, does not count), TPE past its 10 random start-up trials, validation only (test never read).
#
#   bash docs/complete_runs/tuning/ranked/continue.sh            # all four studies, 4 trials a turn
#   STUDIES="local_dp_scatter" STEP=2 bash docs/complete_runs/tuning/ranked/continue.sh
#   STUDIES="local_dp_scatter" JOBS=2 bash docs/complete_runs/tuning/ranked/continue.sh   # 2 trials at a time
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
JOBS=${JOBS:-1}  # trials at a time in a study (tune --jobs): TPE then suggests a trial before the running one has ended
STUDIES=${STUDIES:-"local_dp_scatter dpfedavg_finetune_scatter dpfedavg_prior_scatter dpfedavg_scatter"}
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=disabled

finished() {  # "COMPLETE ENDED": scored trials, and scored plus failed ones (0 0 without a study.db)
  python - "$1" <<'PY'
import sqlite3, sys
from pathlib import Path
db = Path(sys.argv[1])
if not db.exists():
    print(0, 0)
else:
    con = sqlite3.connect(db)
    count = lambda states: con.execute(f"select count(*) from trials where state in ({states})").fetchone()[0]
    print(count("'COMPLETE'"), count("'COMPLETE', 'FAIL'"))
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
    read -r complete ended < <(finished "$dir/study.db")
    (( complete >= TARGET )) && continue  # TARGET scored trials: a failed one (an infeasible point) is not one
    more=$(( TARGET - complete < STEP ? TARGET - complete : STEP ))
    want=$(( ended + more ))  # tune's --trials counts the failed trials too
    echo "$(date -u +%FT%TZ) $study: $complete scored ($ended ended), continuing to $want ended"
    nice -n 15 python -m fedfdp.experiments tune --config "configs/fmnist_${study}.yaml" \
      --space "configs/search_spaces/ranked/fmnist_${study}.yaml" --study-dir "$dir" --study-name "$study" \
      --trials "$want" --jobs "$JOBS" --objective "val_accuracy+val_accuracy_worst" --val-fraction 0.1 --last 5 \
      --fit-args --model.eval_train_splits false || true  # the objective reads validation only: no train-split evaluation
    for f in study.db trials.txt best.yaml best.json search_space.yaml; do
      if [[ -f $dir/$f ]]; then cp "$dir/$f" "$KEEP/$study/$f"; fi
    done
    read -r _ ended_now < <(finished "$dir/study.db")
    if (( ended_now > ended )); then
      progressed=1
    else  # no trial ended: a broken setup, not a reason to loop; the other studies go on
      echo "$(date -u +%FT%TZ) $study: no trial ended in this turn; left out (see $dir/trial*/fit.log)" >&2
      STUDIES=${STUDIES//$study/}
    fi
  done
  (( progressed )) || break
done
echo "$(date -u +%FT%TZ) done: every study left holds $TARGET scored trials${STUDIES:+ ($STUDIES)}"
