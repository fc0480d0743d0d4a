#!/usr/bin/env bash
# The device checks of one GPU lease (docs/gpu.md), from the repository root of a copy of the
# working tree on the lent machine. Carried (ignored by git): .gpu/whl/*.whl (the packages the
# machine's image lacks: opacus, jsonargparse, docstring_parser, typeshed_client) and .gpu/data/
# (the FashionMNIST .gz files). Everything it prints goes to $OUT/<step>.log as well.
#
#   bash benchmarks/gpu_session.sh check     # CUDA tests, then the sweep benchmark of configs/fmnist.yaml (8 runs)
#   bash benchmarks/gpu_session.sh studies   # Table VI and V (FedFDP, DP-FedAvg) as sweeps, the 32-run benchmark
#   bash benchmarks/gpu_session.sh table4 S  # Table IV's missing runs as 16 side-by-side fit processes (started
#                                            # once, detached; a later call finds them running or resumes them),
#                                            # waiting at most S seconds, then the finished runs' files to $OUT
#   bash benchmarks/gpu_session.sh finp_cnn S  # FinP's CNN with Adam (finp-table --dataset fmnist_cnn), main, DP and
#                                            # each-client-alone rows x seeds 0 1 2: one detached finp-table per (row, seed)
#                                            # side by side, as table4; at most S seconds, then the runs to $OUT
#   bash benchmarks/gpu_session.sh rcdpfl_paper S [D]  # RC-DPFL at the paper's setting (rcdpfl-table --dataset D,
#                                            # fmnist_paper unless D = mnist_paper): 6 methods and local without DP x seeds 0 1 2,
#                                            # one detached rcdpfl-table per (method, seed), local epochs in lockstep; as finp_cnn
#   bash benchmarks/gpu_session.sh local_rows S  # each client alone with DP-SGD in Tables IV (MNIST), V and VI, and
#                                            # without DP in IV (MNIST) and V: 30 runs as 3 detached paper-table
#                                            # harnesses (finished runs skipped: the CPU may have run some); as table4
set -u
step=${1:?usage: gpu_session.sh check|studies|table4 SECONDS|finp_cnn SECONDS|rcdpfl_paper SECONDS|local_rows SECONDS}
out=${OUT:-/tmp/out}
mkdir -p "$out"
exec > >(tee -a "$out/$step.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD OMP_WAIT_POLICY=PASSIVE WANDB_MODE=disabled PYTHONUNBUFFERED=1
export FEDFDP_DATA_DIR=$PWD/.gpu/data
if [ "$step" = table4 ] || [ "$step" = finp_cnn ] || [ "$step" = rcdpfl_paper ] || [ "$step" = local_rows ]; then
  # the committed finished runs back in runs/, so the harnesses skip them (they are refused as another
  # configuration, trainer.accelerator, and not trained again); not the parked CPU runs: their
  # checkpoints cannot be resumed with --trainer.accelerator gpu, so the GPU runs them afresh
  python3 docs/complete_runs/index.py restore --finished-only | grep -c '^restored' | sed 's/^/restored committed runs: /' || true
  # 16 processes share the GPU: one thread each (16 cores), and each process's caching allocator capped
  # (the third lease lost a run to out-of-memory when 15 processes each cached 4-14 GB)
  export OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True FEDFDP_CUDA_MEMORY_FRACTION=0.055
  cat > /tmp/site/sitecustomize.py <<'PY'
import os
if os.environ.get("FEDFDP_CUDA_MEMORY_FRACTION"):
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(os.environ["FEDFDP_CUDA_MEMORY_FRACTION"]))
PY
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, lightning, opacus; print('torch', torch.__version__, 'lightning', lightning.__version__, 'opacus', opacus.__version__, 'cpus', torch.get_num_threads())"
start=$(date +%s)
if [ "$step" = check ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings -n 8 tests/engine/test_gpu.py tests/engine/test_grouped.py \
    tests/experiments/test_sweep.py tests/engine/test_stacked.py tests/privacy/test_mechanism.py 2>&1 | tail -15
  echo "tests: $(( $(date +%s) - start )) s"
  timeout 240 python3 benchmarks/sweep.py --config configs/fmnist.yaml --runs 8 --rounds 12 --accelerator gpu \
    --out /tmp/bench8 2>&1 | grep -v -E " INFO |^(GPU|TPU|HPU|LOCAL_RANK|💡|\`Trainer)"
  # several local steps in lockstep (the default on a GPU) against client by client: RC-DPFL's
  # DP-FedAvg baseline, 21 clients x 10 steps a round (CPU: 4.4 s a round in lockstep, 3.3 per client)
  for st in true false; do
    timeout 150 python3 -m fedfdp.fit --config configs/rcdpfl/mnist_dpfedavg.yaml --model.num_rounds 6 \
      --model.eval_every 100 --model.stacked_round $st --trainer.accelerator gpu --run_dir /tmp/lockstep_$st \
      --wandb disabled --trainer.enable_progress_bar false > /tmp/lockstep_$st.log 2>&1
    python3 -c "import json; s = json.load(open('/tmp/lockstep_$st/summary.json')); print('stacked_round $st:', round(s['seconds_per_round'], 4), 's/round, eps', s['epsilon'], 'acc', s['final']['accuracy'])"
  done
  # RC-DPFL at the paper's setting: 21 clients x 71 DP steps of RCDPFLCNN a round (the clustered family's
  # local epochs in lockstep against client by client; CPU: about 24 s a round client by client)
  for st in true false; do
    timeout 150 python3 -m fedfdp.fit --config configs/rcdpfl/mnist_paper_rcdpfl.yaml --model.num_rounds 4 \
      --model.eval_every 100 --model.stacked_round $st --trainer.accelerator gpu --run_dir /tmp/rcdpfl_lockstep_$st \
      --wandb disabled --trainer.enable_progress_bar false > /tmp/rcdpfl_lockstep_$st.log 2>&1
    python3 -c "import json; s = json.load(open('/tmp/rcdpfl_lockstep_$st/summary.json')); print('RC-DPFL paper, stacked_round $st:', round(s['seconds_per_round'], 4), 's/round, eps', s['epsilon'])" \
      || tail -5 /tmp/rcdpfl_lockstep_$st.log
  done
  echo "total: $(( $(date +%s) - start )) s"
elif [ "$step" = studies ]; then
  for m in fedfdp dpfedavg; do  # one process per method (each its own sweeps), side by side on the GPU
    ( python3 -m fedfdp.experiments paper-table6 --dataset fmnist --seeds 0 1 2 --methods $m --sweep --out runs/paper \
        --fit-args --trainer.accelerator gpu > "/tmp/table6_$m.log" 2>&1
      python3 -m fedfdp.experiments paper-table5 --dataset fmnist --seeds 0 1 2 --methods $m --columns "Dir(0.5)" "Dir(1.0)" \
        --sweep --out runs/paper \
        --fit-args --trainer.accelerator gpu > "/tmp/table5_$m.log" 2>&1 ) &
  done
  wait
  tail -3 /tmp/table6_*.log /tmp/table5_*.log
  echo "studies: $(( $(date +%s) - start )) s"
  # the finished runs without their checkpoints (what comes back is at most 64 MiB)
  tar -czf "$out/paper_runs.tgz" --exclude=checkpoints --exclude=plots runs/paper
  ls -la "$out"
fi
if [ "$step" = table4 ]; then
  wait_s=${2:?usage: gpu_session.sh table4 SECONDS}
  fit="--fit-args --trainer.accelerator gpu"
  # the harnesses' own PIDs (a pgrep pattern also matches wrappers); started again when a call finds them
  # gone: a paper-table harness skips finished runs and resumes unfinished ones from their last checkpoint
  alive() { [ -f /tmp/table4_$1.pid ] && kill -0 "$(cat /tmp/table4_$1.pid)" 2>/dev/null; }
  alive fmnist || { setsid nohup python3 -m fedfdp.experiments paper-table4 --dataset fmnist --seeds 0 1 2 \
      --methods fedprox_dp feddyn_dp alidpfl --jobs 5 --out runs/paper $fit >> /tmp/table4_fmnist.log 2>&1 < /dev/null &
    echo $! > /tmp/table4_fmnist.pid; }
  alive mnist || { setsid nohup python3 -m fedfdp.experiments paper-table4 --dataset mnist --seeds 0 1 2 \
      --jobs 11 --out runs/paper $fit >> /tmp/table4_mnist.log 2>&1 < /dev/null &
    echo $! > /tmp/table4_mnist.pid; }
  while [ $(( $(date +%s) - start )) -lt "$wait_s" ] && { alive fmnist || alive mnist; }; do sleep 5; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  grep -h -E " done |Error|error:" /tmp/table4_*.log | tail -40
  echo "table4: $(( $(date +%s) - start )) s; finished: $(grep -l -E '"status": "(completed|budget_spent)"' runs/paper/table4/*/*/seed*/summary.json 2>/dev/null | wc -l)"
  tar -czf "$out/table4_runs.tgz" --exclude=checkpoints --exclude=plots --exclude='*.stale-*' runs/paper/table4
  cp /tmp/table4_*.log "$out/" 2>/dev/null
  ls -la "$out"
fi
if [ "$step" = finp_cnn ]; then
  wait_s=${2:?usage: gpu_session.sh finp_cnn SECONDS}
  # measured on the CPU (2026-11-28): a main row's round is 5 local epochs of Adam at batch 64 on
  # HuCNN, about 3,500 steps (110 s a round here, 37 min a run); a DP row's round 10 DP steps a client
  rows="baseline finp_client finp_server_pca finp_pca finp_server_ala finp_ala dpfedavg dpfinp_server_ala dpfinp_ala_b0.1 local local_dp"
  # (no dpfinp_ala: the CNN DP config's own β is 0.1, so it is dpfinp_ala_b0.1 again; finp-table drops it)
  alive() { [ -f /tmp/finp_$1.pid ] && kill -0 "$(cat /tmp/finp_$1.pid)" 2>/dev/null; }
  for row in $rows; do for seed in 0 1 2; do
    alive "${row}_$seed" || { setsid nohup python3 -m fedfdp.experiments finp-table --dataset fmnist_cnn --rows "$row" \
        --seeds "$seed" --out runs/finp_cnn --markdown "/tmp/finp_${row}_$seed.md" >> "/tmp/finp_${row}_$seed.log" 2>&1 \
        < /dev/null & echo $! > "/tmp/finp_${row}_$seed.pid"; }
  done; done
  any_alive() { for f in /tmp/finp_*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && return 0; done; return 1; }
  while [ $(( $(date +%s) - start )) -lt "$wait_s" ] && any_alive; do sleep 5; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  echo "finp_cnn: $(( $(date +%s) - start )) s; finished: $(grep -l -E '"status": "(completed|budget_spent)"' runs/finp_cnn/*/seed*/summary.json 2>/dev/null | wc -l) of 33"
  # after every run has finished, on this machine: python -m fedfdp.experiments finp-table --dataset fmnist_cnn
  #   --rows main,dp,alone --seeds 0 1 2 --out runs/finp_cnn  (skips the finished runs, writes the table)
  tar -czf "$out/finp_cnn_runs.tgz" --exclude=checkpoints --exclude=plots --exclude='*.stale-*' runs/finp_cnn
  cp /tmp/finp_*.log "$out/" 2>/dev/null
  ls -la "$out"
fi
if [ "$step" = rcdpfl_paper ]; then
  wait_s=${2:?usage: gpu_session.sh rcdpfl_paper SECONDS [fmnist_paper|mnist_paper]}
  dataset=${3:-fmnist_paper}  # MNIST's table is complete on the CPU (docs/results/index.md)
  tree=runs/rcdpfl_paper; [ "$dataset" = fmnist_paper ] && tree=runs/rcdpfl_paper_fmnist  # as cpu_queue.sh
  # 21 runs of 200 rounds; a round is 21 clients x 71 (MNIST) or 74 (FashionMNIST) DP steps at b = 32 (the
  # first one full batch), run as lockstep engine passes over the 21 clients on the GPU (11 to 24 s a round on the CPU)
  alive() { [ -f /tmp/rcdpfl_$1.pid ] && kill -0 "$(cat /tmp/rcdpfl_$1.pid)" 2>/dev/null; }
  for method in dpfedavg ifca kmcdpfl rcdpfl oracle local local_nodp; do for seed in 0 1 2; do
    alive "${method}_$seed" || { setsid nohup python3 -m fedfdp.experiments rcdpfl-table --dataset "$dataset" \
        --methods "$method" --seeds "$seed" --nice 0 --out "$tree" \
        --override=--trainer.accelerator=gpu >> "/tmp/rcdpfl_${method}_$seed.log" 2>&1 < /dev/null &
      echo $! > "/tmp/rcdpfl_${method}_$seed.pid"; }
  done; done
  any_alive() { for f in /tmp/rcdpfl_*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && return 0; done; return 1; }
  while [ $(( $(date +%s) - start )) -lt "$wait_s" ] && any_alive; do sleep 5; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  echo "rcdpfl_paper ($dataset): $(( $(date +%s) - start )) s; finished: $(grep -l -E '"status": "(completed|budget_spent)"' "$tree"/runs/*/summary.json 2>/dev/null | wc -l) of 21"
  # after every run has finished, on this machine: python -m fedfdp.experiments rcdpfl-table --dataset $dataset
  #   --methods dpfedavg ifca kmcdpfl rcdpfl oracle local local_nodp majority --seeds 0 1 2 --out $tree (skips them, writes the table)
  tar -czf "$out/rcdpfl_paper_runs.tgz" --exclude=checkpoints --exclude=plots --exclude='*.stale-*' "$tree"
  cp /tmp/rcdpfl_*.log "$out/" 2>/dev/null
  ls -la "$out"
fi
if [ "$step" = local_rows ]; then
  wait_s=${2:?usage: gpu_session.sh local_rows SECONDS}
  # configs/<dataset>_local_dp.yaml at each column of Tables VI (4 eps), V (Dir(0.5), Dir(1.0)) and IV (MNIST),
  # configs/<dataset>_local.yaml (no DP) at V's and IV's; FashionMNIST at eps 3.52, Dir(0.1) is committed
  # (issue23_fmnist10/local_dp and local). About 1.2 min a DP run on the H100
  fit="--fit-args --trainer.accelerator gpu"
  alive() { [ -f /tmp/local_$1.pid ] && kill -0 "$(cat /tmp/local_$1.pid)" 2>/dev/null; }
  alive t6 || { setsid nohup python3 -m fedfdp.experiments paper-table6 --dataset fmnist --seeds 0 1 2 --methods local_dp \
      --jobs 12 --out runs/paper $fit >> /tmp/local_t6.log 2>&1 < /dev/null & echo $! > /tmp/local_t6.pid; }
  alive t5 || { setsid nohup python3 -m fedfdp.experiments paper-table5 --dataset fmnist --seeds 0 1 2 --methods local_dp local \
      --columns "Dir(0.5)" "Dir(1.0)" --jobs 12 --out runs/paper $fit >> /tmp/local_t5.log 2>&1 < /dev/null & echo $! > /tmp/local_t5.pid; }
  alive t4 || { setsid nohup python3 -m fedfdp.experiments paper-table4 --dataset mnist --seeds 0 1 2 --methods local_dp local \
      --jobs 6 --out runs/paper $fit >> /tmp/local_t4.log 2>&1 < /dev/null & echo $! > /tmp/local_t4.pid; }
  while [ $(( $(date +%s) - start )) -lt "$wait_s" ] && { alive t6 || alive t5 || alive t4; }; do sleep 5; done
  echo "local_rows: $(( $(date +%s) - start )) s; finished: $(grep -l -E '"status": "(completed|budget_spent)"' runs/paper/table*/*/local{,_dp}/seed*/summary.json 2>/dev/null | wc -l) of 30"
  tar -czf "$out/local_rows.tgz" --exclude=checkpoints --exclude=plots --exclude='*.stale-*' runs/paper
  cp /tmp/local_t*.log "$out/" 2>/dev/null
  ls -la "$out"
fi
