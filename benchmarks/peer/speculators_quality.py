"""Train the peer's (vllm-project/speculators 0.9.0) EAGLE-3 draft on a Llama-family HF target and
pre-tokenized data, on one GPU, with the speculators wheels on PYTHONPATH (see README.md here).

usage: python speculators_quality.py TARGET_DIR DATA_JSONL OUT_DIR [--epochs 4] [--ttt-steps 7]
       [--draft-vocab N] [--lr 3e-4] [--decay 0.8] [--batch-tokens 4096] [--loss-fn kl_div]
Prints the extraction and training wall times and the peer's validation metrics; copies the final draft
(speculators / vLLM layout) to OUT_DIR."""
import argparse, json, os, re, shutil, subprocess, sys, time
from pathlib import Path

import torch
from safetensors.torch import save_file

ap = argparse.ArgumentParser()
ap.add_argument("target"); ap.add_argument("data"); ap.add_argument("out")
ap.add_argument("--epochs", type=int, default=4); ap.add_argument("--ttt-steps", type=int, default=7)
ap.add_argument("--draft-vocab", type=int, default=0); ap.add_argument("--lr", type=float, default=3e-4)
ap.add_argument("--decay", type=float, default=0.8); ap.add_argument("--batch-tokens", type=int, default=4096)
ap.add_argument("--work", default="/tmp/peer_run")
ap.add_argument("--loss-fn", default="kl_div", help="speculators' --loss-fn: kl_div (its default), rkl, jsd, ce, tv, "
                "nla, lk_hybrid, or a JSON dict of weights")
ap.add_argument("--eagle31", action="store_true",
                help="keep speculators' own defaults for the draft's norms (norm_before_residual, norm_before_fc, "
                     "norm_output on: its EAGLE-3.1 defaults) instead of turning them off")
ap.add_argument("--prepare-only", action="store_true", help="stop after writing the peer's data (CPU check)")
ap.add_argument("--data-from", default=None, help="train on another run's data (its --work/data), waiting until that "
                "run has written it, instead of extracting again: peer variants side by side in one call")
a = ap.parse_args()

from transformers import AutoConfig, AutoModelForCausalLM
from datasets import Dataset

work = Path(a.work); data = Path(a.data_from) if a.data_from else work / "data"
shutil.rmtree(work, ignore_errors=True)
cfg = AutoConfig.from_pretrained(a.target)
freq_file = data / "token_freq.pt"   # written last, by a rename: the data is complete once it exists


def extract():
    (data / "hidden_states").mkdir(parents=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tgt = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).to(dev).eval()
    rows = [json.loads(l) for l in open(a.data) if l.strip()]
    L = cfg.num_hidden_layers
    capture = [2, L // 2, L - 3]          # speculators' default: inputs of these layers
    last = {}
    tgt.model.layers[-1].register_forward_hook(lambda m, i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    freq = {}
    t0 = time.time()
    with torch.no_grad():
        for i, r in enumerate(rows):
            x = torch.tensor(r["input_ids"], device=dev)[None]
            o = tgt.model(input_ids=x, output_hidden_states=True)
            hs = torch.stack([o.hidden_states[k][0] for k in capture] + [last["h"][0]], 1)  # [T, 4, H]
            save_file({"hidden_states": hs.to(torch.bfloat16).cpu().contiguous(), "token_ids": x[0].cpu()},
                      str(data / "hidden_states" / f"hs_{i}.safetensors"))
            for t, m in zip(r["input_ids"], r["loss_mask"]):
                if m:
                    freq[t] = freq.get(t, 0) + 1
    print(f"peer extraction: {len(rows)} sequences in {time.time() - t0:.0f}s", flush=True)
    ds = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
                            "seq_len": [len(r["input_ids"]) for r in rows]})
    ds.set_format(type="torch"); ds.save_to_disk(str(data))
    torch.save(freq, data / "token_freq.tmp")
    (data / "call").write_text(os.environ.get("QUALITY_CALL", ""))
    (data / "token_freq.tmp").rename(freq_file)
    del tgt; torch.cuda.empty_cache()


if a.data_from:   # the data the run beside this one extracts in this call (QUALITY_CALL), not a stale one
    for _ in range(360):
        if freq_file.exists() and (data / "call").read_text() == os.environ.get("QUALITY_CALL", ""):
            break
        time.sleep(5)
    else:
        sys.exit(f"peer: no complete data in {data} after 30 minutes")
else:
    extract()
if a.prepare_only:
    print("prepared:", data); sys.exit(0)

vocab = a.draft_vocab or min(32000, cfg.vocab_size)
mask_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.vocab_size - 1
cmd = [sys.executable, "-m", "speculators.train", "--verifier-name-or-path", a.target, "--data-path", str(data),
       "--save-path", str(work / "ckpt"), "--draft-vocab-size", str(vocab), "--ttt-steps", str(a.ttt_steps),
       "--ttt-step-loss-decay", str(a.decay), "--epochs", str(a.epochs), "--lr", str(a.lr), "--optimizer", "adamw",
       "--loss-fn", a.loss_fn,
       "--loss-implementation", "eager", "--scheduler-type", "cosine",
       *([] if a.eagle31 else ["--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output"]),
       "--full-attention-indices", "0",
       "--total-seq-len", str(a.batch_tokens), "--on-missing", "raise", "--num-workers", "4",
       "--mask-token-id", str(mask_id), "--train-data-ratio", "0.98", "--log-dir", str(work / "logs")]
t0 = time.time()
p = subprocess.run(cmd, capture_output=True, text=True)
log = p.stdout + p.stderr
print(f"peer training: rc {p.returncode}, {time.time() - t0:.0f}s", flush=True)
Path(a.out).mkdir(parents=True, exist_ok=True)
(Path(a.out) / "peer_train.log").write_text(log)
if p.returncode:
    print(log[-3000:]); sys.exit(1)
print(" ".join(re.findall(r"val/(?:full_acc|cond_acc)_\d_epoch=[0-9.]+", log)[-2 * a.ttt_steps:]))
final = sorted(work.joinpath("ckpt").rglob("config.json"), key=lambda f: f.stat().st_mtime)[-1].parent
for f in final.iterdir():
    if f.suffix in (".json", ".safetensors"):
        shutil.copy(f, Path(a.out) / f.name)
print("peer draft:", a.out)
