#!/usr/bin/env bash
# The GPU check for a one-GPU machine, about 6 minutes, every part timed and kept going when one
# fails: ddptrain's defaults on a GPU machine, nccl in fp32/bf16/fp16, FSDP2 and --compile on
# CUDA, a rank SIGKILLed and resumed (weights compared with an uninterrupted run, fp16's
# GradScaler and FSDP included), the host syncs of a step and where they are, failures (more
# ranks than GPUs, a raising rank, a NaN), ddptrain against the hand-written loop on the GPU
# (ddptrain bench --device cuda), and DDP's own overhead. Run from the
# repository root (ddptrain from src/, no install needed):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# GPU_CHECK_DEVICE=cpu rehearses the script on a machine without a GPU (gloo, the same steps).
set -uo pipefail
OUT=${1:-gpu-check}
RUNS=${GPU_CHECK_RUNS:-/tmp/gpu-check-runs}
DEV=${GPU_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD/src:$PWD/tests/helpers${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
TRAIN=("$PY" -m ddptrain train --no-progress)  # resumes (--resume auto): the restarted attempt's flags
BENCH=()
[ "$DEV" = cpu ] && TRAIN+=(--device cpu --nproc 1) && BENCH+=(--smoke)
DDP=("${TRAIN[@]}" --resume never)

# step NAME SECONDS CMD...: runs CMD with a time limit, its output into the log; one line here.
step() {
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s%N)
    echo "=== $name: $*" >>"$LOG"
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    printf '%-26s exit %-3s %6s ms\n' "$name" "$rc" "$((($(date +%s%N) - started) / 1000000))"
}

# same_weights A B: the final weights of two run dirs, bitwise or by their largest difference.
same_weights() {
    "$PY" - "$RUNS/$1" "$RUNS/$2" <<'PY'
import sys, torch
a, b = (torch.load(f"{d}/model.pt", weights_only=True) for d in sys.argv[1:])
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
same = all(torch.equal(a[k], b[k]) for k in a)
print(f"  weights {sys.argv[1].rsplit('/', 1)[-1]} vs {sys.argv[2].rsplit('/', 1)[-1]}: "
      f"{'bitwise equal' if same else f'NOT equal, largest difference {diff:.3g}'}")
PY
}

# part NAME: whether GPU_CHECK_PARTS (space-separated; unset: every part) names this part.
part() { [ -z "${GPU_CHECK_PARTS:-}" ] || [[ " $GPU_CHECK_PARTS " == *" $1 "* ]]; }

{ nvidia-smi -L; "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"; } 2>&1 | tee -a "$LOG"
part env && step env 60 "$PY" -m ddptrain env

if part precisions; then
echo "== defaults on this machine (no device flags) and the three precisions"
step defaults 120 "$PY" -m ddptrain train --max-epochs 2 --run-dir "$RUNS/defaults" --resume never --no-progress
sed -n '/^=== defaults/,$p' "$LOG" | grep -m 1 "^training"
for precision in fp32 bf16 fp16; do
    step "tutorial-$precision" 120 "${DDP[@]}" --max-epochs 3 --precision "$precision" --run-dir "$RUNS/$precision"
done
for run in fp32 bf16 fp16; do echo "  $run: $(grep -h train_loss "$RUNS/$run/metrics.jsonl" | tail -n 1 | cut -c1-220)"; done

fi

echo "== a rank SIGKILLed at step 50 and resumed (--max-restarts 1) against an uninterrupted run"
kill_and_resume() {  # NAME TASK FLAGS...
    local name=$1 task=$2
    shift 2
    step "$name-whole" 180 "${DDP[@]}" --task "$task" --max-epochs 3 --save-every 20 --run-dir "$RUNS/$name-whole" "$@"
    # The run dir emptied, then --resume auto: the check must see a resume, never a fresh start
    # (its first run on an H200 passed --resume never, under which a restart then began again).
    rm -rf "$RUNS/$name-killed" "$RUNS/$name-marker"
    KILL_RANK=0 KILL_STEP=50 KILL_MARKER="$RUNS/$name-marker" KILL_ONCE_SAVED="$RUNS/$name-killed/snapshots" \
        step "$name-killed" 240 "${TRAIN[@]}" --task "$task" --max-epochs 3 --save-every 20 --max-restarts 1 \
        --run-dir "$RUNS/$name-killed" "$@"
    [ -f "$RUNS/$name-marker" ] || echo "  NOT KILLED: the marker is missing"
    sed -n "/^=== $name-killed/,\$p" "$LOG" | grep -m 1 "^resumed from\|fresh start" | cut -c1-200
    same_weights "$name-whole" "$name-killed"
}
part resume && kill_and_resume resume-fp32 ddptrain_test_tasks:kill_at_step
part resume && kill_and_resume resume-fp16 ddptrain_test_tasks:kill_at_step --precision fp16
part fsdp && kill_and_resume resume-fsdp-bf16 ddptrain_test_tasks:kill_at_step --strategy fsdp --precision bf16

if part syncs; then
echo "== host syncs: CUDA's sync debug mode over 2 epochs of 64 steps (where each sync is asked for)"
step host-syncs 120 "${DDP[@]}" --task precision_tasks:host_syncs_counted --max-epochs 2 --run-dir "$RUNS/syncs"
sed -n '/^=== host-syncs/,/^=== /p' "$LOG" | grep -o "host sync at [^ ]*" | cut -d" " -f4 | sort | uniq -c | sort -rn | head -n 12

fi

echo "== FSDP2 on a 34M-parameter MLP, and --compile"
part fsdp && step fsdp-34m-bf16 180 "${DDP[@]}" --task ddptrain_test_tasks:mlp_34m --strategy fsdp --precision bf16 \
    --max-epochs 1 --run-dir "$RUNS/fsdp-34m"
part compile && step compile 240 "${DDP[@]}" --task ddptrain_test_tasks:mlp_regression --compile --max-epochs 2 --run-dir "$RUNS/compile"
for run in fsdp-34m compile; do [ -f "$RUNS/$run/metrics.jsonl" ] && echo "  $run: $(grep -h train_loss "$RUNS/$run/metrics.jsonl" | tail -n 1 | cut -c1-220)"; done

if part failures; then
echo "== failures on this device: more ranks than GPUs, a raising rank, a NaN"
step too-many-ranks 120 "$PY" -m ddptrain train --nproc 2 --device "$DEV" --max-epochs 1 --run-dir "$RUNS/two" \
    --resume never --no-progress
[ "$DEV" = cuda ] && sed -n '/^=== too-many-ranks/,$p' "$LOG" | sed -n '2,5p' | cut -c1-300
FAIL_RANK=0 FAIL_STEP=30 step raising-rank 120 "${DDP[@]}" --task ddptrain_test_tasks:fail_on_rank --max-epochs 1 \
    --run-dir "$RUNS/raise"
sed -n '/^=== raising-rank/,$p' "$LOG" | grep -m 3 "ddptrain\|Error" | cut -c1-300
step nan 120 "${DDP[@]}" --task ddptrain_test_tasks:nan_sample --max-epochs 1 --run-dir "$RUNS/nan"
sed -n '/^=== nan/,$p' "$LOG" | grep -m 2 "ddptrain:" | cut -c1-300

fi

if part bench; then
echo "== ddptrain against the hand-written loop on this device"
# shellcheck disable=SC2086  # GPU_CHECK_BENCH: the bench's own flags, split on purpose
step bench 300 "$PY" -m ddptrain bench --device "$DEV" --nproc 1 --epochs tutorial=0,mlp=0,gpt2=0,fsdp=0 \
    --out "$OUT/bench" ${GPU_CHECK_BENCH:---jobs tutorial,mlp,gpt2,fsdp --contenders loop,ddptrain,ddptrain-no-fr --reps 2} \
    "${BENCH[@]}"
sed -n '/^job /,/^ddptrain-skip/p' "$LOG" | cut -c1-150
fi

if [ "$DEV" = cuda ] && part overhead; then
echo "== DDP's own overhead: the same model and loop with and without DDP (8 x Linear(4096), bf16)"
step ddp-overhead 120 "$PY" - "$OUT" <<'PY'
import json, sys, time, os
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())]).cuda()
def rate(net, steps=60, batch=512):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randn(batch, 4096, device="cuda")
    for i in range(steps + 10):
        if i == 10:
            torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x).float().pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t)
plain, wrapped = [], []
for rep in range(3):
    plain.append(rate(model()))
    wrapped.append(rate(DDP(model(), device_ids=[0], gradient_as_bucket_view=True)))
result = {"plain_samples_per_s": sorted(plain)[1], "ddp_samples_per_s": sorted(wrapped)[1]}
result["ddp_over_plain"] = result["ddp_samples_per_s"] / result["plain_samples_per_s"]
print(json.dumps(result))
json.dump(result, open(f"{sys.argv[1]}/ddp_overhead.json", "w"), indent=2)
dist.destroy_process_group()
PY
tail -n 1 "$OUT/ddp_overhead.json" 2>/dev/null; grep '"ddp_over_plain"' "$LOG" | tail -n 1
fi
