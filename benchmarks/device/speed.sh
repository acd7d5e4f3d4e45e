#!/usr/bin/env bash
# Issue 14's speed figures on the GPU machine, a part per argument (each under a 10-minute call):
#   peer   the peer's step alone (speculators 0.9.0, benchmarks/peer/speculators_step.py: data and
#          verifier about 75 s, its first epoch compiles for 4-5 minutes; 388 to 485 s in all from a
#          cold start: give it the call's whole 600 s; its log streams to $OUT). Followed by `cache`,
#          it leaves its compiled graphs for the next call (below): `peer cache` then `step` is how one
#          H200 holds the step against the peer in one call (494 s, then 336 s with the peer's first
#          epoch down from 4:44 to 0:49). Chaining `peer` then `step` on a machine kept warm does not
#          work: the next call may get a fresh machine
#   cache  packs the compiled-graph caches of the parts before it into $OUT (see below)
#   step   the peer's step, then the full Kimi-size step on layout (a), Triton kernels in bf16 and
#          with train.float8 and train.float8_head (the defaults on an fp8 GPU), the default frozen
#          target head, and the ours/peer ratios, all in this call; no profiles (they cost time).
#          From a cold start it does not fit 10 minutes on one GPU: carry the `cache` of an earlier
#          call, or on nvidia-h200-x2 use PEER_GPU=1, which runs the peer on GPU 1 beside ours on
#          GPU 0: one call of ~7 minutes (6.7 measured; ours is timed while the peer compiles; its
#          timed epoch came after ours in the measured call: not enforced, check peer_step-kimi.log)
#   step-a the step on layout (a) alone: Triton with train.float8, with train.float8_head too, and in
#          bf16, with profile tables (STEP_KERNELS=... to time fewer)
#   sweep  the TTT attention's config sweep: each kernel's candidates one by one (none started after 330 s)
#   attention  the TTT attention bench at shapes a and c
#   step-b the same step on layout (b): the torch path, Triton in bf16 and with train.float8
#   fp8    the casts and GEMMs of train.float8 at the step's shapes (python -m benchmarks.float8)
#   rows   the row spread and RMSNorm kernels against torch's (python -m benchmarks.rows)
#   moe    the Kimi MoE layer alone
#   moe-qwen3  the Qwen3-235B-A22B MoE layer alone (hidden 4096, 128 bf16 experts of 1536, top-8)
#   moe-formats  the Kimi MoE layer with its routed experts stored int4, fp8 (128 x 128 blocks) and bf16: tokens/s,
#          % of peak and agreement with the same experts dequantized up front (about 3 minutes on one H100)
#   vision Kimi-K2.5's vision tower + projector at the published sizes: ms and peak memory per item (a 448 x 448
#          image, a 1080 x 1920 one, a 720p video chunk of 4 frames); about a minute
#   moe-long  one 131,072-token sequence through 4 real-width Kimi layers, chunks of 16,384 / 65,536 / whole
#   moe-long-fp32  the same layers in float32 over 32,768 tokens, chunks of 8,192 / whole: far closer than bf16 (both
#          differ by rounding that routing flips amplify); about a minute
#   step-mla  the Kimi-size step with the GQA and the MLA draft, `auto` kernels, one call (about 4 minutes)
#   step-long the Kimi-size step with one 16,384- then one 32,768-token sequence per micro-batch on one GPU
#          (about 4 minutes; longer sequences need train.context_parallel over several GPUs: node.sh)
#   kernels  the TTT attention (shapes a, c) and loss benches, then the MoE layer
#   here:  the peer's wheels in .whl/ (see benchmarks/peer/)    there: bash benchmarks/device/speed.sh PART...
# Compiled graphs travel between calls: every part runs with torch's inductor and Triton caches in
# /tmp/peer-cache; `cache` packs them into $OUT/peer-cache.tgz.NN (15 MiB pieces, 22 MB after the
# peer); copied here into .peercache/ (ignored: `echo /.peercache/ >> .git/info/exclude`) and carried
# (carry [".whl", ".peercache"]), they are unpacked before the first part. They hold the same compiled
# code a cold run builds (the same torch, Triton and GPU), so what is timed does not change.
# Each part's output is written to $OUT/PART.txt as it runs (step, step-a, step-b: also PART.jsonl;
# peer, step: peer_step-kimi.log; step with PEER_GPU: also peer_step.out; step-a: prof.tgz, its profile tables), plus env.txt: a call stopped at its
# limit still returns what it finished. At most 8 files come back from a call: count the parts' files.
set -uo pipefail
out=${OUT:-/tmp/speed-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
export TORCHINDUCTOR_CACHE_DIR=/tmp/peer-cache/inductor TRITON_CACHE_DIR=/tmp/peer-cache/triton
if compgen -G ".peercache/peer-cache.tgz.*" >/dev/null; then
  cat .peercache/peer-cache.tgz.* | tar xzf - -C /tmp && echo "peer cache: $(du -sh /tmp/peer-cache | cut -f1) unpacked" | tee -a "$out/env.txt"
fi
quiet() { grep --line-buffered -v "it/s]\|s/it]\|step/s]\|s/step]"; }
for part in "$@"; do
  echo "== $part $(date +%T)"
  case $part in
    step)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
      PYTHONPATH=/tmp/site python3 -m benchmarks.step_peer --sizes ${SIZES:-kimi} --layouts a \
        --kernels ${STEP_KERNELS:-triton,triton-fp8-head} --steps 3 --warmup 2 --dir /tmp/bd --json "$out/step.jsonl" \
        ${PEER_GPU:+--peer-gpu "$PEER_GPU"} 2>&1 | quiet | tee "$out/step.txt" ;;
    peer)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
      PYTHONPATH=/tmp/site python3 benchmarks/peer/speculators_step.py 2>&1 | quiet | tee "$out/peer.txt" ;;
    step-a)
      rm -rf /tmp/prof
      python3 -m benchmarks.step_lab --layouts a --kernels ${STEP_KERNELS:-triton-fp8,triton-fp8-head,triton} --steps 3 --warmup 2 --dir /tmp/bd \
        --json "$out/step-a.jsonl" --profile-dir /tmp/prof 2>&1 | quiet | tee "$out/step-a.txt"
      tar czf "$out/prof.tgz" -C /tmp prof ;;   # one file back for all the kernel tables
    step-b)
      python3 -m eagle3.bench --layouts b --kernels torch,triton,triton-fp8 --steps 3 --warmup 2 --dir /tmp/bd \
        --json "$out/step-b.jsonl" 2>&1 | quiet | tee "$out/step-b.txt" ;;
    cache) tar czf - -C /tmp peer-cache | split -b 15M -d - "$out/peer-cache.tgz." && ls -l "$out"/peer-cache.tgz.* ;;
    fp8) python3 -m benchmarks.float8 2>&1 | quiet | tee "$out/fp8.txt" ;;
    rows) python3 -m benchmarks.rows 2>&1 | quiet | tee "$out/rows.txt" ;;
    moe) python3 -m benchmarks.moe --parts layer 2>&1 | quiet | tee "$out/moe.txt" ;;
    moe-qwen3) python3 -m benchmarks.moe --model qwen3 --parts layer 2>&1 | quiet | tee "$out/moe-qwen3.txt" ;;
    moe-formats) python3 -m benchmarks.moe --parts layer --formats int4,fp8,bf16 2>&1 | quiet | tee "$out/moe-formats.txt" ;;
    vision) python3 -m benchmarks.vision --json "$out/vision.jsonl" 2>&1 | quiet | tee "$out/vision.txt" ;;
    moe-long) python3 -m benchmarks.moe --parts long 2>&1 | quiet | tee "$out/moe-long.txt" ;;
    moe-long-fp32) python3 -m benchmarks.moe --parts long --long-dtype float32 --long-tokens 32768 --long-chunks 8192,0 \
      2>&1 | quiet | tee "$out/moe-long-fp32.txt" ;;
    step-mla)
      python3 -m eagle3.bench --sizes kimi --mla --layouts a --kernels auto --steps 3 --warmup 2 --dir /tmp/bd \
        --json "$out/step-mla.jsonl" 2>&1 | quiet | tee "$out/step-mla.txt" ;;
    step-long)
      python3 -m eagle3.bench --sizes kimi --seq-lens 16384,32768 --layouts a --kernels auto --steps 3 --warmup 2 \
        --dir /tmp/bd --json "$out/step-long.jsonl" 2>&1 | quiet | tee "$out/step-long.txt" ;;
    sweep) python3 -m benchmarks.attention_sweep --seconds 330 2>&1 | quiet | tee "$out/sweep.txt" ;;
    attention) python3 -m eagle3.bench attention --shapes a,c 2>&1 | quiet | tee "$out/attention.txt" ;;
    kernels)
      { python3 -m eagle3.bench attention --shapes a,c; python3 -m eagle3.bench loss; python3 -m benchmarks.moe --parts layer; } \
        2>&1 | quiet | tee "$out/kernels.txt" ;;
    *) echo "unknown part $part: expected peer, cache, step, step-a, step-b, step-mla, step-long, fp8, rows, moe, moe-qwen3, moe-formats, moe-long, moe-long-fp32, sweep, attention or kernels"; exit 2 ;;
  esac
done
echo "== done $(date +%T)"
