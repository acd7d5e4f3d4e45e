#!/usr/bin/env bash
# Issue 15's GPU figures on nvidia-h200-x2: online training's target placements against offline
# extraction + training, for the same 262,144 tokens (8 steps x 2 ranks x 16,384), on the real-width
# 4-layer Kimi-layout target (1 dense + 3 MoE layers, int4 experts) with the Kimi-size draft. A part
# per argument, each `python -m benchmarks.online --placements PART --ranks 2` (the bench launches
# `torchrun --standalone --nproc_per_node 2` itself, one launch per phase, and records each rank's
# time and peak memory):
#   offline   extraction on 2 ranks (4 shards of 65,536 tokens, 15 GB), then training on the shards
#   stream    online, every layer read from the checkpoint for each micro-batch
#   resident  online, the whole target kept on each GPU after the first pass
#   staged    online, layers 0-1 on GPU 0 and 2-3 on GPU 1, every micro-batch through both
#   table     the markdown table of every row in $OUT/online.jsonl so far (rows from earlier calls:
#             copy their online.jsonl into $OUT first, or cat them together here afterwards)
# The first part on a fresh machine writes the target to /tmp/online (35.1 GB: layer 0 1.0 GB, each MoE
# layer 9.8 GB, embedding and head 4.7 GB; made on the GPU, serialised by safetensors on one CPU
# thread); later parts, and later calls while the machine is still warm, reuse it. Nothing to carry.
# Durations measured on nvidia-h200-x2 (2026-12-01): writing the target 41-42 s (0.85 GB/s); offline 164 s
# (extraction 58, training 106), resident 101 s, staged 115 s, stream 118 s, each with its launches, start-up
# and final checkpoint; call 1 `bash benchmarks/device/online.sh offline resident table` took 341 s, call 2
# `bash benchmarks/device/online.sh staged stream table` 304 s (on a fresh machine, the target written again).
# Disk: target 35.1 GB + shards 15 GB + one 10 GB checkpoint at a time (each placement's removed once
# measured) of the 128 GiB. Output, as it runs (a call stopped at its limit returns what finished):
# $OUT/online.txt (the log), $OUT/online.jsonl (one row per finished placement), $OUT/env.txt.
set -uo pipefail
out=${OUT:-/tmp/online-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())" | tee -a "$out/env.txt"
df -h /tmp | tee -a "$out/env.txt"
quiet() { grep --line-buffered -v "it/s]\|s/it]\|step/s]\|s/step]\|tok/s]"; }
limit=${PART_LIMIT:-560}   # a hung part must not take the rest of the call
for part in "$@"; do
  echo "== $part $(date +%T)" | tee -a "$out/online.txt"
  case $part in
    offline|stream|resident|staged)
      timeout -k 20 "$limit" python3 -m benchmarks.online --placements "$part" --ranks 2 --dir /tmp/online \
        --json "$out/online.jsonl" 2>&1 | quiet | tee -a "$out/online.txt"
      rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || echo "== $part FAILED rc=$rc $(date +%T)" | tee -a "$out/online.txt" ;;
    table) python3 -m benchmarks.online --table "$out/online.jsonl" | tee -a "$out/online.txt" ;;
    *) echo "unknown part $part: expected offline, stream, resident, staged or table"; exit 2 ;;
  esac
done
echo "== done $(date +%T)" | tee -a "$out/online.txt"
