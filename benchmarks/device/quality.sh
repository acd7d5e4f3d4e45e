#!/usr/bin/env bash
# The quality benchmark in one device call: the peer's wheels installed, then
# `python -m benchmarks.quality` stage by stage, its files packed into $OUT after each stage (so
# a call stopped at its time limit still returns what it finished).
#   here:  the peer's wheels (speculators 0.9.0 and what it needs) in .whl/, its scripts in benchmarks/peer/
#   there: bash benchmarks/device/quality.sh STAGE...     (carry .whl and the work dir)
# a STAGE is target, data, peer, measure, ours@VARIANT (VARIANT as --variant takes it: name[:key=value,...])
# or peer@NAME:FLAGS (--peer-variant) or measure@DRAFT,... (--drafts: judge these alone; side by side with bg:, then
# a plain measure prints the whole table from their files); a STAGE prefixed "bg:" runs in the background beside the next ones
# (quality screening on one GPU: its training times then do not count), "wait" waits for them;
# QUALITY_ARGS="--recipe train_prompts=3072 ..." passes more options to every stage; the long-context variant:
# WORK=.quality-long QUALITY_ARGS=--long bash benchmarks/device/quality.sh target data ours@whole ours@short measure
# Presets, one command each (a device call of at most 10 minutes runs one; between them carry the work directory
# as `cat target.tgz.* | tar xz` and `cat results.tgz.* | tar xz` unpack it there: target/ (in parts under 16 MiB too: the
# DeepSeek-shaped target is 24 MB), quality.json and the replies; the long bench's data stage writes
# its sequences again from the target's tokenizer):
#   long-trained, long-trained-drafts, long-trained-seeds: the long bench's target trained until its held-out loss
#     stops falling (TARGET_SECONDS at most, 420 by default) and its data; then whole, short, mix, window and plain
#     trained side by side and judged at T = 0 and T = 1; then the same with train.seed 1 (the table of all printed)
#   mla-trained, mla-trained-drafts, mla-trained-seeds: the same on the DeepSeek-V3-shaped target, drafts mla and gqa
#     (equal size) and mla-published and gqa-published (the published Kimi drafts' shapes)
#   vision: `python -m benchmarks.vision_quality`'s whole bench in one call, in .quality-vision (no peer, no wheels): the
#     Kimi-K2.5-shaped target trained to caption pictures, its replies, the text / vllm / sglang drafts trained side
#     by side, each judged on image prompts and on text prompts at T = 0 and T = 1 (planned: about 7 minutes on one
#     H100, 150 s of it the target's training)
set -uo pipefail
LONG_TRAINED="--long --judge t0,probabilistic --recipe target_patience=3 --recipe target_steps=20000
  --recipe target_seconds=${TARGET_SECONDS:-420} --recipe draft_seeds=2"
MLA_TRAINED="--recipe target_kind=deepseek --judge t0,probabilistic --recipe target_patience=3 --recipe target_steps=20000
  --recipe target_seconds=${TARGET_SECONDS:-300} --recipe train_prompts=2048 --recipe long_prompts=2
  --recipe long_reply_len=64 --recipe draft_seeds=2"
arms() {   # SUFFIX ARM...: each arm trained in the background, then judged in the background JUDGES at a time, then the table
  local suffix=$1 a n=0; shift
  for a in "$@"; do echo "bg:ours@$a$suffix"; done; echo wait
  for a in "$@"; do echo "bg:measure@$a$suffix"; (( ++n % ${JUDGES:-8} )) || echo wait; done; echo wait measure
}
case "${1:-}" in
  long-trained*) WORK=${WORK:-.quality-long-trained}; QUALITY_ARGS="$LONG_TRAINED ${QUALITY_ARGS:-}"
    drafts="whole short mix window plain"
    JUDGES=${JUDGES:-3} ;;   # a judge of 64 prompts up to 8k deep holds 15-27 GiB: five at once overflowed an H100
  mla-trained*) WORK=${WORK:-.quality-ds-trained}; QUALITY_ARGS="$MLA_TRAINED ${QUALITY_ARGS:-}"
    drafts="mla gqa mla-published gqa-published" ;;
esac
module=benchmarks.quality; module_args=(--peer-script benchmarks/peer/speculators_quality.py)
if [[ ${1:-} == vision ]]; then
  WORK=${WORK:-.quality-vision}; module=benchmarks.vision_quality; module_args=()
  set -- target data $(arms "" text vllm sglang)
fi
case "${1:-}" in
  *-trained) set -- target data ;;
  *-trained-drafts) set -- data $(arms "" $drafts) ;;
  *-trained-seeds) set -- data $(arms -s1 $drafts) ;;
esac
out=${OUT:-/tmp/quality-out}; work=${WORK:-.quality}
mkdir -p "$out" "$work"
if [[ $module == benchmarks.quality ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export QUALITY_CALL=$(date +%s%N)   # the peer's --data-from waits for data extracted in this call
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the versions head log.txt: a call returns 8 files at most, and two benches side by side need each of theirs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$out/log.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/log.txt"
# a file coming back from $OUT is at most 16 MiB: the results travel in parts under it (cat results.tgz.* | tar xz);
# packed after each stage and every 60 s while stages run in the background, so a call cut at its time limit
# still returns what finished
pack() {
  local files
  files=$(cd "$work" && ls -d regen*.jsonl thinking.jsonl prompts*.jsonl quality.json vision_quality.json text.jsonl \
    captions-regen.jsonl images/e* peer*/*.json hidden*/manifest.json peer*/*.safetensors peer*.log eval-*.json \
    ours-*/export/vllm ours-*/bench.json ours-*/metrics.jsonl 2>/dev/null)
  [[ -n $files ]] || return 0   # nothing written yet
  (flock 9
   (cd "$work" && tar czf - --ignore-failed-read $files \
      | split -b 16000k -d - "$out/.parts.") && rm -f "$out"/results.tgz.* && for f in "$out"/.parts.*; do
        mv "$f" "$out/results.tgz.${f##*.parts.}"; done) 9>/tmp/quality-pack.lock
}
(while sleep 60; do pack; done) & packer=$!
stages_done() { local pids; pids=$(jobs -p | grep -vx "$packer"); [[ -z $pids ]] || wait $pids; }
run_stage() {
  local stage=$1 args
  args=(--stages "${stage%%@*}")
  [[ $stage == ours@* ]] && args+=(--variant "${stage#ours@}")
  [[ $stage == peer@* ]] && args+=(--peer-variant "${stage#peer@}")
  [[ $stage == measure@* ]] && args+=(--drafts "${stage#measure@}")
  python3 -m $module --work "$work" "${args[@]}" "${module_args[@]}" ${QUALITY_ARGS:-} \
    2>&1 | grep -v "it/s]\|s/it]\|conv/s]\|step/s]\|s/step]\|seq/s]\|tok/s]" | sed "s|^|[${stage%%:*}] |" | tee -a "$out/log.txt"
}
for stage in "$@"; do
  echo "== stage $stage $(date +%T)"
  if [[ $stage == wait ]]; then stages_done; pack
  elif [[ $stage == bg:* ]]; then run_stage "${stage#bg:}" &
  else run_stage "$stage"; pack
  fi
  [[ $stage != target ]] || (cd "$work" && tar czf - target | split -b 16000k -d - "$out/target.tgz.")
done
stages_done; kill $packer; pack
echo "== done $(date +%T)"
