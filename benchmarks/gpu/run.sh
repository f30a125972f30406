#!/usr/bin/env bash
# padfree's GPU checks, in one call to the GPU machine (every step has its own timeout and is skipped when time
# runs short). From the repo root, after `bash benchmarks/gpu/prepare.sh` here:
#   bash benchmarks/gpu/run.sh                 (carry: .whl .devdata) the packing checks and training speed
#   ONLY=drafter bash benchmarks/gpu/run.sh    the drafter runs: speed and acceptance length at a real size
#   ONLY=all bash benchmarks/gpu/run.sh        both, in order, as far as the deadline allows
#   ONLY=spcp bash benchmarks/gpu/run.sh       SP/CP on packed rows with NCCL (needs 2 GPUs; written, not yet run)
# Everything it prints goes to $OUT/log.txt too; results land in $OUT (8 files at most, the limit is 8).
#
# Local dry run (no GPU; the venv already has the peers, cp312 wheels do not install on 3.11):
#   OUT=/tmp/gpuout DEVICE=cpu QUICK=1 WHEELS=0 PY=/work/main/.venv/bin/python bash benchmarks/gpu/run.sh
#   OUT=/tmp/gpuout DEVICE=cpu QUICK=1 WHEELS=0 ONLY=drafter PY=/work/main/.venv/bin/python bash benchmarks/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpuout}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}     # 1: tiny model, few steps (plumbing test on a CPU)
WHEELS=${WHEELS:-1}   # 0: use the peers already installed
SITE=${SITE:-/tmp/site}
ONLY=${ONLY:-packing} # packing (the checks and training speed), drafter, all, or spcp
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
say() { echo; echo "=== [$(date -u +%H:%M:%S), ${SECONDS}s] $*"; }
DEADLINE=${DEADLINE:-540}  # seconds: every step ends by then, inside the device's 600 s per command
step() {  # step SECONDS NAME CMD...: run with a timeout, report the exit status, never stop the script
  local limit=$1 name=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 20 ]; then say "$name: skipped (${SECONDS}s spent)"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "$name (timeout ${limit}s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "--- $name: exit $rc$([ $rc = 124 ] && echo ' (timed out)')"
  return 0
}

say "setup"
if [ "$WHEELS" = 1 ] && ls .whl/*.whl > /dev/null 2>&1; then
  timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || echo "wheel install failed: peers that need them will say so"
  export PYTHONPATH="$PWD/src:$SITE"
else
  export PYTHONPATH="$PWD/src"
fi
echo "PYTHONPATH=$PYTHONPATH"
nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
"$PY" - <<'PY'
import importlib, platform
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| available", torch.cuda.is_available(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for m in ("transformers", "padfree", "trl", "lhotse", "datasets", "torchdata", "pyarrow", "fsspec", "dill"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m} {getattr(mod, '__version__', '?')} from {mod.__file__}")
    except Exception as exc:
        print(f"  {m}: NOT importable ({type(exc).__name__}: {exc})")
try:
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    print("  varlen_attn", inspect.signature(varlen_attn))
except Exception as exc:
    print("  varlen_attn: none", exc)
PY

tmp=$(mktemp -d)
if [ "$ONLY" != drafter ] && [ "$ONLY" != spcp ]; then
# (i) packing correctness on the device: packed row vs documents alone, fp32 and bf16, and the leaky control
say "check-packing (parallel; one JSON line each in check_packing.jsonl)"
CP="$OUT/check_packing.jsonl"
: > "$CP"
i=0
pids=()
for spec in "tiny-llama float32 padfree_varlen" "tiny-llama bfloat16 padfree_varlen" \
  "tiny-qwen2 bfloat16 padfree_varlen" "tiny-mistral bfloat16 padfree_varlen" \
  "tiny-llama bfloat16 leaky" "tiny-llama float32 leaky"; do
  set -- $spec
  i=$((i + 1))
  (timeout --kill-after=10 120 "$PY" -m padfree check-packing --model "$1" --dtype "$2" --attn "$3" \
    --device "$DEVICE" --json > "$tmp/$i.json" 2> "$tmp/$i.err"
   echo "$? $spec" > "$tmp/$i.rc") &
  pids+=($!)
done
wait "${pids[@]}"  # not a bare `wait`: that would also wait for the tee behind the log
for j in $(seq 1 $i); do
  cat "$tmp/$j.rc"; cat "$tmp/$j.json"; tail -5 "$tmp/$j.err"
  cat "$tmp/$j.json" >> "$CP"
done
echo "(expected: exit 0 for padfree_varlen, exit 1 = LEAK for leaky)"

# grouped-query heads (repeat_kv / enable_gqa) and a sliding window through the fused kernel, with backward
step 150 "varlen kernel: GQA, sliding window, backward" "$PY" - "$DEVICE" "$CP" <<'PY'
import json, sys, time
import torch
import padfree.torch.attention as pa
from padfree.checks.packing import check_packing
device, out = sys.argv[1], sys.argv[2]
rows = []
for model, over in [("tiny-llama", {"num_key_value_heads": 2}), ("tiny-mistral", {"sliding_window": 16}),
                    ("tiny-mistral", {"sliding_window": 16, "num_key_value_heads": 1})]:
    for dtype in ("bfloat16", "float32"):
        t = time.time()
        r = check_packing(model, "padfree_varlen", overrides=over, device=device, dtype=dtype)
        row = {"model": model, "overrides": over, "dtype": dtype, "path": r.path, "max_logit_diff": r.max_logit_diff,
               "leaked": r.leaked, "seconds": round(time.time() - t, 2)}
        print(json.dumps(row)); rows.append(row)
# a training step through the kernel: gradients of packed == gradients of the documents one by one
from padfree.models import build_model
net = build_model("tiny-llama", attn_implementation=pa.NAME, num_key_value_heads=2).to(device)
lens = [37, 5, 90, 18]
gen = torch.Generator().manual_seed(0)
docs = [torch.randint(0, 32000, (n,), generator=gen).to(device) for n in lens]
cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
kind = "cuda" if device.startswith("cuda") else "cpu"
def grads(fn):
    net.zero_grad(set_to_none=True)
    with torch.autocast(kind, dtype=torch.bfloat16):
        loss = fn()
    loss.backward()
    return torch.cat([p.grad.float().reshape(-1) for p in net.parameters() if p.grad is not None])
pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
g_packed = grads(lambda: net(input_ids=torch.cat(docs)[None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                             max_length_q=max(lens), max_length_k=max(lens)).logits.float().square().mean() * sum(lens))
path = pa.last_path()
g_alone = grads(lambda: sum(net(input_ids=d[None]).logits.float().square().mean() * d.numel() for d in docs))
rel = ((g_packed - g_alone).norm() / g_alone.norm()).item()
row = {"check": "bf16 gradients packed vs alone (GQA)", "path": path, "relative_l2_diff": rel, "ok": rel < 5e-2}
print(json.dumps(row)); rows.append(row)
with open(out, "a") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
PY

# (iii) training throughput of every strategy on the GPU, bf16 autocast
if [ "$QUICK" = 1 ]; then
  MODEL=(--model-set hidden_size=64 --model-set intermediate_size=128 --model-set num_hidden_layers=1
    --model-set num_attention_heads=2 --model-set num_key_value_heads=2 --vocab-size 512)
  RUN=(--budget 4096 --steps 2 --warmup 1 --pool 2000 --threads 2)
else
  # ~170M parameters (8 layers of 1024, 16 heads, 32K vocabulary): big enough that a 16K-token micro-batch
  # is matrix work, not kernel launches
  MODEL=(--model-set hidden_size=1024 --model-set intermediate_size=2816 --model-set num_hidden_layers=8
    --model-set num_attention_heads=16 --model-set num_key_value_heads=16)
  RUN=(--budget 16384 --steps 30 --warmup 3 --repeats 2 --pool 20000 --threads 8)
fi
# (every peer: transformers' BatchRebalanceSampler `hf_batch_rebalance` too)
step 300 "bench bf16, every strategy and peer" "$PY" -m padfree bench .devdata/seed_mix.mistral_v1.npy \
  --device "$DEVICE" --dtype bfloat16 "${MODEL[@]}" "${RUN[@]}" --out "$OUT" --name train_speed_gpu

# (iv) dynamic rank balancing: 2 ranks sharing the GPU (gloo collectives on the host), static and dynamic
# assignment interleaved step by step, equal ranks and one rank 1.5x slower (it sleeps half of each measured
# compute time); timed with the device synchronized. The markdown table goes to the log, the JSON to $OUT.
if [ "$QUICK" = 1 ]; then
  DYN=(--steps 2 --warmup 1 --scenarios slow_rank --strategies packed)
else
  DYN=(--budget 4096 --steps 16 --warmup 6 --scenarios equal_ranks,slow_rank --model-set hidden_size=512
    --model-set intermediate_size=1376 --model-set num_hidden_layers=4 --model-set num_attention_heads=8
    --model-set num_key_value_heads=8 --model-set vocab_size=32000)
fi
step 150 "dynamic balance, 2 ranks on one device" "$PY" benchmarks/dynamic_balance.py --quick \
  --device "$DEVICE" "${DYN[@]}" --out "$tmp/dyn" --name dynamic_balance_gpu
cp "$tmp"/dyn/dynamic_balance_gpu.json "$OUT"/ 2>/dev/null

# (v) the project's tests on this machine (CPU paths, torch 2.11 / transformers 5.17), a quick subset
# the family sweep on the device: hybrids through transformers' fused kernels where installed (fla from .whl;
# causal-conv1d / mamba-ssm need a CUDA build and are absent unless the image has them), per document otherwise;
# every family must come out exact or refused, never a silent leak (the probe runs on the GPU in the model's path)
step 150 "family sweep on the GPU (hybrids, fused kernels where installed)" "$PY" -m padfree check-packing \
  --families lfm2,lfm3,qwen3_5_text,qwen3_next,olmo_hybrid,mamba,bamba,nemotron_h,granitemoehybrid,jamba,minimax,recurrent_gemma,rwkv,zaya,llama,gpt_oss,mixtral \
  --device "$DEVICE"
step 120 "pytest subset" "$PY" -m pytest -q -x -p no:cacheprovider -n 4 tests/torch/test_attention.py \
  tests/checks/test_packing_check.py tests/torch/test_gpu_paths.py

# optional: the same in float32 for padded sorted vs packed (per-document SDPA there), when time is left
if [ $((DEADLINE - SECONDS)) -gt 100 ]; then
  step 120 "bench fp32, sorted vs packed" "$PY" -m padfree bench .devdata/seed_mix.mistral_v1.npy \
    --device "$DEVICE" --dtype float32 "${MODEL[@]}" "${RUN[@]}" --steps 15 --repeats 1 \
    --strategies sorted,packed --out "$tmp/fp32" --name train_speed_gpu_fp32
  cp "$tmp"/fp32/train_speed_gpu_fp32.json "$tmp"/fp32/train_speed_gpu_fp32.md "$OUT"/ 2>/dev/null
else
  say "skipped the fp32 bench (${SECONDS}s spent)"
fi
fi  # ONLY != drafter

if [ "$ONLY" != packing ] && [ "$ONLY" != spcp ]; then
# (vi) drafters at a real size (a public target's config, random weights for the speed run; bf16 autocast, the
# drafters' flex attention): draft positions per second of packed plans vs random padded vs length-sorted
# batches (benchmarks/drafter_speed.py, seconds synchronized on the device), then acceptance length per training
# second (benchmarks/drafter_quality.py: a Qwen3-0.6B-shaped target trained briefly on the bundled chats, DFlash
# drafters per batching, decoded by the dflash package). Both JSON go into one file, drafter_gpu.json; their
# tables into the log.
if [ "$QUICK" = 1 ]; then
  DSPEED=(--quick --micro 2 --per-file 20 --hidden 64 --layers 4 --vocab 512)
  DQUAL=(--smoke --methods dflash)
else
  DSPEED=(--target-config qwen3-0.6b --budget 16384 --micro 6 --per-file 150 --imbalance-budget 16384)
  DQUAL=(--gpu --methods dflash --seconds 40 --seeds 2 --evals 4)
fi
LENGTHS=()  # the seed_mix lengths for the modeled imbalance (prepare.sh puts them in .devdata)
[ -f .devdata/seed_mix.mistral_v1.npy ] && LENGTHS=(--lengths .devdata/seed_mix.mistral_v1.npy)
step 200 "drafter speed (bf16, flex attention)" "$PY" benchmarks/drafter_speed.py --device "$DEVICE" \
  --dtype bfloat16 --data fixtures/samples/*.jsonl.gz --tokenizer fixtures/tokenizers/llama_sp32k.model \
  "${LENGTHS[@]}" "${DSPEED[@]}" --out "$tmp/dspeed" --name drafter_speed_gpu
step 330 "drafter quality (acceptance length per training second)" "$PY" benchmarks/drafter_quality.py \
  --device "$DEVICE" --dtype bfloat16 --workers 1 "${DQUAL[@]}" --out "$tmp/dqual" --name drafter_quality_gpu
"$PY" - "$tmp" "$OUT/drafter_gpu.json" <<'PY'
import json, pathlib, sys
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
merged = {}
for key, path in (("speed", tmp / "dspeed/drafter_speed_gpu"), ("quality", tmp / "dqual/drafter_quality_gpu")):
    partial = path.parent / (path.name + ".partial.json")
    if path.with_suffix(".json").exists():
        merged[key] = json.loads(path.with_suffix(".json").read_text())
        merged[key].pop("raw", None)
        print(path.with_suffix(".md").read_text())
    elif partial.exists():  # cut short: the arms it finished
        merged[key] = {"partial": json.loads(partial.read_text())}
        print(f"({key}: cut short, {len(merged[key]['partial']['raw'])} finished arms kept)")
    else:
        merged[key] = None
        print(f"(no {key} result)")
out.write_text(json.dumps(merged, indent=1) + "\n")
PY
[ "$ONLY" = drafter ] && cp "$tmp"/dqual/drafter_quality_gpu.png "$OUT"/ 2>/dev/null  # (8 files at most)
fi  # ONLY != packing
if [ "$ONLY" = spcp ]; then
# (vii) sequence / context parallelism on packed rows over NCCL: what padfree checks on 2 CPU ranks with gloo
# (check-packing --sp 2 / --cp 2, tests/test_hf_sp.py) and what it refuses because it cannot check it here:
# accelerate's cp_size (torch context_parallel: one causal mask over the packed row) and sp_size (DeepSpeed ALST).
# Needs 2 GPUs (skipped on one); one JSON line per check in sp_cp_gpu.jsonl.
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
SPCP="$OUT/sp_cp_gpu.jsonl"
: > "$SPCP"
if [ "$NGPU" -ge 2 ]; then
  for mode in torch-cp alst; do
    step 150 "SP/CP on packed rows: $mode (2 GPUs, NCCL)" "$PY" -m torch.distributed.run --standalone \
      --nproc_per_node 2 benchmarks/gpu/sp_cp_checks.py "$mode" "$SPCP"
  done
else
  say "SP/CP GPU checks skipped: $NGPU GPU(s), they need 2"
fi
step 120 "padfree SP/CP exactness on 2 CPU ranks (gloo), for the record" "$PY" -m pytest -q -x -p no:cacheprovider \
  tests/torch/test_sp_cp_attention.py
fi  # ONLY = spcp
say "done in ${SECONDS}s; files in $OUT:"
ls -la "$OUT"
sleep 1  # let tee write the last lines of log.txt
