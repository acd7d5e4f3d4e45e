#!/usr/bin/env bash
# Issues 16 and 49: figures on nvidia-h200-x8 (one 8-GPU node), a part per argument:
#   scale-a  the training-step bench (Kimi-size draft, layout a, KERNELS: triton-fp8-head, the default on an
#            H200) under torchrun on 8 GPUs (NPROC, default 8), then on 1 GPU, same shards, same call; then
#            `python -m benchmarks.node scaling`: N-GPU over 1-GPU tokens/s (the bar on 8: >= 7.6x, on 2
#            issue 14's 1.95x), every parameter bit-equal across the N ranks, host syncs per step
#   scale-b  the same on layout b
#   extract  extract.py on 1 rank, then under torchrun on 8, on the online bench's real-width 4-layer
#            Kimi-layout target (16 shards of 65,536 tokens: two per rank on 8, so the steady rate,
#            start-up left out, is measured too): the node's extraction tokens/s and its shards against
#            1 rank's (same plan, bit-equal files, the largest difference per tensor)
#   resume   train.py on 8 ranks (toy Kimi-layout target and draft, 40 steps, a checkpoint every 5):
#            uninterrupted twice (the run-to-run floor), and SIGKILLed (torchrun and its workers) once
#            step 10's checkpoint is complete, then rerun: its final weights against the uninterrupted
#   long     issue 49's step with one long sequence per micro-batch, split over the ranks by train.context_parallel
#            (16k tokens a rank: 16,384 to 131,072 tokens a sequence on NPROC GPUs, 8 ranks for 128k), Kimi-size
#            draft, layout a, `auto` kernels: tokens/s and peak GiB per GPU ($OUT/long.jsonl)
# Expected durations (estimates: nothing of this has run on 8 GPUs yet):
#   scale-a, scale-b  ~5 min each: the 8-rank run first writes 56 shards of 0.94 GB (7 per rank: 3 timed
#            steps, 2 warm-up, the profiled and the sync-checked one; ~52 GB with their sha256, 1.5-2.5 min),
#            then each run ~1.5 min (start-up, autotuning, 7 steps); the 1-GPU run reuses the shards,
#            which are removed at the end of the part (disk: 235 GiB)
#   extract  ~8 min: the target (35.1 GB, 1-2 min, or reused from /tmp/online), 1 rank extracting
#            16 shards (~17 s each: the layers streamed from the page cache, the 3.7 GB shard written and
#            hashed), 8 ranks two shards each (~50 s with start-up), the comparison on the GPU (~30 s)
#   long     ~6 min (an estimate): the shards of each length (128k: ~7.5 GB each, 8 of them), then 2 timed steps
#            a length
#   resume   ~3 min: the shards (in this process, seconds), 4 launches of 8 ranks of ~30-40 s each
# so: call 1 `bash benchmarks/device/node.sh resume scale-a` (~8 min; resume first: scale-a's estimate is
# the shakier), call 2 `scale-b` (~5 min), call 3 `extract` (~8 min). Each part runs under
# `timeout` (PART_LIMIT seconds, default 560) and a failed part is marked "== PART FAILED rc=N".
# Output, as it runs: $OUT/node.txt (the log), $OUT/scale-{1,NPROC}.jsonl (the step bench's rows),
# $OUT/extract.jsonl, $OUT/resume.jsonl, $OUT/long.jsonl, $OUT/env.txt: 7 files.
set -uo pipefail
out=${OUT:-/tmp/node-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
kernels=${KERNELS:-triton-fp8-head}
n=${NPROC:-8}   # scale-a/scale-b/long on fewer GPUs: NPROC=2 on nvidia-h200-x2 (issue 14's 2-GPU scaling)
[ "$n" -ge 2 ] 2>/dev/null || { echo "NPROC=$n: expected a number of GPUs, 2 or more"; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$out/env.txt"
df -h /tmp | tee -a "$out/env.txt"
quiet() { grep --line-buffered -v "it/s]\|s/it]\|step/s]\|s/step]\|tok/s]"; }
limit=${PART_LIMIT:-560}
run() { timeout -k 20 "$limit" "$@"; }
failed() { echo "== $part FAILED rc=$1 $(date +%T)" | tee -a "$out/node.txt"; }
for part in "$@"; do
  echo "== $part $(date +%T)" | tee -a "$out/node.txt"
  case $part in
    scale-a|scale-b)
      layout=${part#scale-}
      step=(-m eagle3.bench --layouts "$layout" --kernels "$kernels" --steps 3 --warmup 2 --dir /tmp/bd)
      { run python3 -m torch.distributed.run --standalone --nproc_per_node "$n" "${step[@]}" --json "$out/scale-$n.jsonl" &&
        run python3 "${step[@]}" --json "$out/scale-1.jsonl" &&
        python3 -m benchmarks.node scaling "$out/scale-1.jsonl" "$out/scale-$n.jsonl"; } 2>&1 | quiet | tee -a "$out/node.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || failed "$rc"
      rm -rf "/tmp/bd/data-$layout" ;;
    extract)
      run python3 -m benchmarks.node extract --ranks 1,8 --shards 16 --dir /tmp/online --json "$out/extract.jsonl" \
        2>&1 | quiet | tee -a "$out/node.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || failed "$rc"
      rm -rf /tmp/online/hidden-* ;;
    long)
      lens=$(python3 -c "print(','.join(str(16384 * r) for r in (1, 2, 4, 8) if r <= $n))")
      run python3 -m torch.distributed.run --standalone --nproc_per_node "$n" -m eagle3.bench --sizes kimi --layouts a \
        --kernels auto --seq-lens "$lens" --tokens-per-rank 16384 --steps 2 --warmup 2 --dir /tmp/bd \
        --json "$out/long.jsonl" 2>&1 | quiet | tee -a "$out/node.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || failed "$rc"
      rm -rf /tmp/bd ;;
    resume)
      run python3 -m benchmarks.node resume --ranks 8 --steps 40 --every 5 --kill-at 10 --dir /tmp/resume \
        --json "$out/resume.jsonl" 2>&1 | quiet | tee -a "$out/node.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || failed "$rc" ;;
    *) echo "unknown part $part: expected scale-a, scale-b, long, extract or resume"; exit 2 ;;
  esac
done
echo "== done $(date +%T)" | tee -a "$out/node.txt"
