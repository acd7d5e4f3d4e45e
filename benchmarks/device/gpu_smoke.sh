#!/usr/bin/env bash
# GPU smoke check of the whole pipeline on a tiny target: extract -> train (torch kernels, triton eagerly,
# triton as CUDA graphs (the default at this size); 1 GPU) -> export; then compares the paths' losses.
set -euo pipefail
out=${OUT:-/tmp/gpu_smoke}
python - <<'PY'
from eagle3.models import tiny
tiny.make_kimi("/tmp/smoke/target", hidden=256, layers=8, intermediate=512, vocab=2048)
tiny.make_token_data("/tmp/smoke/data.jsonl", vocab=2048, sequences=512, min_len=64, max_len=512)
PY
common="--target.path /tmp/smoke/target --data.path /tmp/smoke/data.jsonl --extract.output_dir /tmp/smoke/hidden
 --train.batch_tokens 8192 --train.max_steps 60 --debug.log_every 20 --train.eval_every 60 --train.lr 3e-3
 --draft.head_dim 128 --draft.num_attention_heads 4 --draft.num_key_value_heads 2"
python extract.py $common
for k in torch triton triton-graph; do
  python train.py $common --debug.kernels ${k%-graph} --debug.cuda_graphs $([ $k = triton-graph ] && echo true || echo false) \
    --train.output_dir /tmp/smoke/train-$k 2>&1 | grep -v "step/s\|s/step"
  tail -n 2 /tmp/smoke/train-$k/metrics.jsonl | cut -c1-400 | tee -a $out/metrics-$k.txt
done
PY_CMP='import json,sys
a=[json.loads(l) for l in open("/tmp/smoke/train-torch/metrics.jsonl")]
b=[json.loads(l) for l in open("/tmp/smoke/train-triton/metrics.jsonl")]
c=[json.loads(l) for l in open("/tmp/smoke/train-triton-graph/metrics.jsonl")]
for x,y,z in zip(a,b,c): print(x["split"], x["step"], "loss0 torch %.4f triton %.4f graph %.4f" % (x["loss"][0], y["loss"][0], z["loss"][0]),
                             "tok/s", *(round(r.get("tokens_per_s",0)) for r in (x,y,z)))'
python -c "$PY_CMP"
