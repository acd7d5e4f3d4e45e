"""Peer anchor for the training step: speculators (release wheel, carried in .whl/) training an EAGLE-3
draft of one of the step bench's sizes (default Kimi-K2.5's: hidden 7168, 64 q / 8 kv heads,
intermediate 18432, draft vocab 32000, target vocab 163840; K = 7) on synthetic hidden states, one GPU.
Prints its return code and epoch lines; its full log (the per-step `profile/step_ms` the step bench's
`peer_tokens_per_s` reads) goes to ($OUT or /tmp)/peer_step.log as it runs.
usage (GPU machine, speculators' wheels on PYTHONPATH):
    python speculators_step.py [--shape JSON] [--samples N] [--epochs 2]
JSON: the step bench's size dict (hidden, vocab, heads, kv_heads, head_dim, inter, draft_vocab, seqs,
seq_len, user). Its first epoch compiles (4-5 minutes at Kimi size); the second is the steady one. Run
again on the same machine with the same shape it reuses its data and trains from scratch."""
import argparse, json, os, re, shutil, subprocess, sys, time
from pathlib import Path

import torch
from safetensors.torch import save_file

KIMI = dict(hidden=7168, vocab=163840, heads=64, kv_heads=8, head_dim=128, inter=18432, draft_vocab=32000,
            seqs=4, seq_len=4096, user=512)
ap = argparse.ArgumentParser()
ap.add_argument("--shape", type=json.loads, default=KIMI)
ap.add_argument("--samples", type=int, default=0, help="sequences (default: 12 steps per epoch)")
ap.add_argument("--epochs", type=int, default=2)
a = ap.parse_args()
s = a.shape
n = a.samples or 12 * s["seqs"]
H, V, T = s["hidden"], s["vocab"], s["seq_len"]
ids_range = min(V - 1, 40000)   # the last id is the mask token
work = Path("/tmp/peer_step")
ver, data = work / "verifier", work / "data"
# speculators resumes by default: a rerun trains afresh, reusing the data the last one wrote for this shape
shutil.rmtree(work / "ckpt", ignore_errors=True)
ready = work / f"data-ready-{n}-{abs(hash(json.dumps(s, sort_keys=True))) % 10 ** 8}"
if not ready.exists():
    for old in work.glob("data-ready-*"):
        old.unlink()
    shutil.rmtree(data, ignore_errors=True)
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    ver.mkdir(parents=True, exist_ok=True)
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
               "intermediate_size": s["inter"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
               "head_dim": s["head_dim"], "num_hidden_layers": 32, "vocab_size": V, "rms_norm_eps": 1e-5,
               "rope_theta": 50000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
               "hidden_act": "silu", "bos_token_id": V - 3, "eos_token_id": V - 2}, open(ver / "config.json", "w"))
    g = torch.Generator(device="cuda").manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().cpu(),
               "lm_head.weight": (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().cpu(),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}, str(ver / "model.safetensors"))
    from datasets import Dataset
    ids_all = []
    for i in range(n):
        ids = torch.randint(0, ids_range, (T,), device="cuda", generator=g)
        hs = torch.randn(T, 4, H, device="cuda", generator=g).bfloat16()
        save_file({"hidden_states": hs.cpu(), "token_ids": ids.cpu()}, str(data / "hidden_states" / f"hs_{i}.safetensors"))
        ids_all.append(ids.cpu().tolist())
    ds = Dataset.from_dict({"input_ids": ids_all, "loss_mask": [[0] * s["user"] + [1] * (T - s["user"])] * n,
                            "seq_len": [T] * n})
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    torch.save({t: ids_range - t for t in range(ids_range)}, data / "token_freq.pt")
    ready.touch()
cmd = [sys.executable, "-m", "speculators.train", "--verifier-name-or-path", str(ver), "--data-path", str(data),
       "--save-path", str(work / "ckpt"), "--draft-vocab-size", str(s["draft_vocab"]), "--ttt-steps", "7",
       "--ttt-step-loss-decay", "0.8", "--epochs", str(a.epochs), "--lr", "1e-4", "--optimizer", "adamw",
       "--loss-implementation", "eager", "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
       "--full-attention-indices", "0", "--total-seq-len", str(s["seqs"] * T), "--on-missing", "raise",
       "--num-workers", "8", "--mask-token-id", str(V - 1), "--train-data-ratio", "0.95", "--log-dir", str(work / "logs"),
       "--checkpoint-freq", "100"]
t0 = time.time()
log_path = Path(os.environ.get("OUT", "/tmp"), "peer_step.log")   # written as it runs: a cut call still has it
with open(log_path, "w") as f:
    p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
log = log_path.read_text()
print("rc", p.returncode, f"{time.time() - t0:.0f}s")
for line in log.splitlines():
    if re.search(r"Epoch \d+ 100%|CUDA out of memory|Error", line):
        print(line.strip()[:200])
print(torch.cuda.get_device_name())
