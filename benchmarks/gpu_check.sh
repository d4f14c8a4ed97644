#!/usr/bin/env bash
# GPU check for a one-GPU machine, about 5 minutes: nccl with 1 rank, bf16, the MLP job
# through both data paths, a larger model's samples/s, and DDP's overhead against the same
# model without DDP. Run from the repository root with ddptrain installed:
#   bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-gpu-check}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONPATH="tests/helpers${PYTHONPATH:+:$PYTHONPATH}"  # the DataLoader-path version of the bench job
PY=${PYTHON:-python}

$PY -m ddptrain env | tee "$OUT/env.json"

echo "== nccl, 1 rank, fp32 and bf16, tutorial job"
$PY -m ddptrain train --nproc 1 --device cuda --backend nccl --max-epochs 3 --run-dir "$OUT/nccl-fp32" --resume never
$PY -m ddptrain train --nproc 1 --device cuda --backend nccl --max-epochs 3 --precision bf16 --run-dir "$OUT/nccl-bf16" --resume never

echo "== MLP job: in-memory fast path against the DataLoader path (bf16)"
DDPTRAIN_BENCH_JOB=mlp $PY -m ddptrain train --task ddptrain.bench.jobs:bench_task --nproc 1 --device cuda \
    --max-epochs 3 --batch-size 256 --precision bf16 --run-dir "$OUT/mlp-fast" --resume never
DDPTRAIN_BENCH_JOB=mlp $PY -m ddptrain train --task ddptrain_test_tasks:bench_via_dataloader --nproc 1 --device cuda \
    --max-epochs 3 --batch-size 256 --precision bf16 --workers 4 --run-dir "$OUT/mlp-loader" --resume never

echo "== larger model, and DDP overhead (same model, same loop, with and without DDP)"
$PY - "$OUT" <<'PY'
import json, sys, time, os
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
out = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
def model():
    torch.manual_seed(0)
    width = 4096
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]).cuda()
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
print(json.dumps(result, indent=2))
json.dump(result, open(f"{out}/ddp_overhead.json", "w"), indent=2)
dist.destroy_process_group()
PY

for run in "$OUT"/*/metrics.jsonl; do
    echo "$run: $(tail -n 1 "$run")"
done
