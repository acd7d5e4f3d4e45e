"""`python -m eagle3.bench quality`: our draft against the peer's on a small **real** target, judged
by real speculative decoding on held-out prompts.

Stages (each writes under `--work` and is skipped when its output is already there, so the target
and its data are built once and carried to the calls that train and measure):

- `target`: a Llama-family model of a few million parameters trained from scratch on a fixed
  offline corpus (the `.py` files of Python's standard library, always on the machine), with a
  byte-level BPE tokenizer trained on the same corpus; written in the Hugging Face layout
  (config.json, model.safetensors, tokenizer.json) so that both trainers read it.
- `data`: prompts cut from the corpus; their continuations regenerated greedily by the target
  (`python -m eagle3 generate`); 64+ prompts from files kept out of the draft data for judging.
- `ours`: extraction + training + export with our trainer, once per `--variant` (recipe levers).
- `peer`: speculators (the peer's own script, `--peer-script`) on the same target, data and recipe.
- `measure`: real tau of every draft with the same decoder (`eagle3.evaluate.real_decoding`):
  chain speculative decoding, greedy, with the lossless check against the target's own output.

    python -m eagle3.bench quality --work runs/quality --stages target,data
    python -m eagle3.bench quality --work runs/quality --stages ours,peer,measure --peer-script bench/peer/speculators_quality.py
    python -m eagle3.bench quality --tiny --work /tmp/q      # the same code at toy size on the CPU
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import random
import re
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from eagle3.bench.timing import wall_s
from eagle3.files import atomic_write_text, strict_json
from eagle3.ops import apply_rope, llama_inv_freq, rms_norm, rope_cos_sin

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Recipe:
    """Everything that fixes the benchmark: corpus, target, data and the draft recipe of both trainers."""
    seed: int = 0
    max_files: int = 0                # corpus files (sorted by path); 0 = all
    holdout_every: int = 20           # every n-th file gives the judging prompts, never draft data
    vocab: int = 2048
    hidden: int = 256                 # the target: a Llama of 7.3M parameters
    layers: int = 8                   # aux layers [1, 3, 4] (ours) = inputs of [2, 4, 5] (vLLM, peer)
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    seq_len: int = 512
    batch_seqs: int = 128
    target_steps: int = 1500          # x batch_seqs x seq_len: 98M tokens, 28 passes over the corpus
    target_lr: float = 3e-3
    prompt_len: int = 128
    reply_len: int = 192              # new tokens per regenerated reply
    train_prompts: int = 3072         # 983k tokens of draft data (1024 left every draft far from trained)
    eval_prompts: int = 64
    eval_new_tokens: int = 128
    generate_batch: int = 256
    draft_vocab: int = 256            # the draft's side from here on, the same for both trainers
    epochs: int = 4
    ttt_steps: int = 7
    loss_decay: float = 0.8
    lr: float = 3e-4
    batch_tokens: int = 4096
    eval_fraction: float = 0.02       # the peer trains on 98% of the sequences


TINY = Recipe(max_files=40, vocab=384, hidden=64, layers=8, heads=1, kv_heads=1, intermediate=128, seq_len=64,
              batch_seqs=8, target_steps=20, prompt_len=24, reply_len=16, train_prompts=40, eval_prompts=4,
              eval_new_tokens=12, generate_batch=16, draft_vocab=128, epochs=1, batch_tokens=512, holdout_every=5)


# --- corpus and tokenizer ----------------------------------------------------------------------

def corpus_files(recipe: Recipe) -> list[Path]:
    """The standard library's .py files (tests included), sorted by path: the same list wherever
    the same Python version runs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.parts))
    return files[:recipe.max_files] if recipe.max_files else files


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def encode(tok, texts: list[str]) -> list[torch.Tensor]:
    """One int32 tensor per file, each ending in the end-of-text token."""
    eos = tok.token_to_id(EOS)
    return [torch.tensor(e.ids + [eos], dtype=torch.int32) for e in tok.encode_batch(texts)]


# --- the target: a Llama trained from scratch, saved under the Hugging Face names ----------------

class Attention(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        d = r.hidden // r.heads
        self.heads, self.kv_heads, self.head_dim = r.heads, r.kv_heads, d
        self.q_proj = nn.Linear(r.hidden, r.heads * d, bias=False)
        self.k_proj = nn.Linear(r.hidden, r.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(r.hidden, r.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(r.heads * d, r.hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.gate_proj = nn.Linear(r.hidden, r.intermediate, bias=False)
        self.up_proj = nn.Linear(r.hidden, r.intermediate, bias=False)
        self.down_proj = nn.Linear(r.intermediate, r.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight.to(x.dtype), 1e-5)


class Block(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(r.hidden), Norm(r.hidden)
        self.self_attn, self.mlp = Attention(r), MLP(r)

    def forward(self, h, cos, sin):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    def __init__(self, r: Recipe):
        super().__init__()
        self.embed_tokens = nn.Embedding(r.vocab, r.hidden)
        self.layers = nn.ModuleList(Block(r) for _ in range(r.layers))
        self.norm = Norm(r.hidden)


class Llama(nn.Module):
    """Module names equal the Hugging Face Llama tensor names (`model.layers.0.self_attn.q_proj...`)."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.model = Body(r)
        self.lm_head = nn.Linear(r.hidden, r.vocab, bias=False)
        self.register_buffer("inv_freq", llama_inv_freq(r.hidden // r.heads, 10000.0, None), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:   # GPT-2 style: residual projections scaled down with depth
                std = 0.02 / math.sqrt(2 * r.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]."""
        cos, sin = rope_cos_sin(torch.arange(ids.shape[1], device=ids.device), self.inv_freq)
        h = self.model.embed_tokens(ids)
        for block in self.model.layers:
            h = block(h, cos, sin)
        return self.lm_head(self.model.norm(h))


def hf_config(r: Recipe, eos: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": r.hidden,
            "intermediate_size": r.intermediate, "num_hidden_layers": r.layers, "num_attention_heads": r.heads,
            "num_key_value_heads": r.kv_heads, "head_dim": r.hidden // r.heads, "vocab_size": r.vocab,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
            "bos_token_id": eos, "eos_token_id": eos, "attention_bias": False, "mlp_bias": False}


def lm_batches(stream: torch.Tensor, r: Recipe, g: torch.Generator):
    """Random windows [B, seq_len + 1] of the token stream, forever."""
    while True:
        starts = torch.randint(0, stream.numel() - r.seq_len - 1, (r.batch_seqs,), generator=g)
        yield torch.stack([stream[s:s + r.seq_len + 1] for s in starts.tolist()]).long()


def train_target(r: Recipe, stream: torch.Tensor, judging: torch.Tensor, device: torch.device) -> tuple[Llama, dict]:
    """The target learns from every file (a pretrained model has seen its prompts' sources too); its
    loss on a window of the judging files says how well it knows them, not how it generalises."""
    torch.manual_seed(r.seed)
    model = Llama(r).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=r.target_lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    warmup = max(1, r.target_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / r.target_steps)))))
    batches = lm_batches(stream, r, torch.Generator().manual_seed(r.seed))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    from tqdm import tqdm
    bar = tqdm(range(r.target_steps), desc="target", unit="step")
    for _ in bar:
        x = next(batches).to(device, non_blocking=True)
        with autocast:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    with torch.no_grad(), autocast:
        x = next(lm_batches(judging, r, torch.Generator().manual_seed(r.seed + 1))).to(device)
        held = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).item()
    return model, {"train_loss": loss.item(), "judging_files_loss": held,
                   "params": sum(p.numel() for p in model.parameters())}


def split_files(r: Recipe, ids: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(draft-data files, judging files): every `holdout_every`-th file is kept for judging."""
    judge = [t for i, t in enumerate(ids) if i % r.holdout_every == r.holdout_every - 1]
    rest = [t for i, t in enumerate(ids) if i % r.holdout_every != r.holdout_every - 1]
    return rest, judge


def build_target(r: Recipe, work: Path, device: torch.device) -> dict:
    out = work / "target"
    tmp = work / "target.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    texts = read_texts(corpus_files(r))
    tok = train_tokenizer(texts, r.vocab, tmp)
    ids = encode(tok, texts)
    t_tok = time.perf_counter() - t0
    # the target learns from every file; held-out loss on a window of the judging files
    _, judge = split_files(r, ids)
    model, stats = train_target(r, torch.cat(ids), torch.cat(judge), device)
    eos = tok.token_to_id(EOS)
    (tmp / "config.json").write_text(json.dumps(hf_config(r, eos), indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}))
    weights = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    torch.save(ids, work / "corpus_ids.pt")   # for the data stage; large, so not part of the target
    return {**stats, "files": len(ids), "corpus_tokens": sum(t.numel() for t in ids),
            "tokenizer_s": t_tok, "target_s": time.perf_counter() - t0 - t_tok,
            "python": sys.version.split()[0]}


# --- data: prompts and regenerated replies ------------------------------------------------------

def windows(files: list[torch.Tensor], n: int, length: int, g: random.Random) -> list[list[int]]:
    """n windows of `length` tokens, each inside one file, at random offsets."""
    usable = [t for t in files if t.numel() > length + 1]
    out = []
    while len(out) < n:
        t = usable[g.randrange(len(usable))]
        start = g.randrange(t.numel() - length)
        out.append(t[start:start + length].tolist())
    return out


def build_data(r: Recipe, work: Path, device: str) -> dict:
    from eagle3 import generate
    ids = torch.load(work / "corpus_ids.pt")
    draft_files, judge_files = split_files(r, ids)
    g = random.Random(r.seed)
    seed_lines = [{"input_ids": w, "loss_mask": [0] * r.prompt_len + [1] * r.reply_len}
                  for w in windows(draft_files, r.train_prompts, r.prompt_len + r.reply_len, g)]
    _write_jsonl(work / "seed.jsonl", seed_lines)
    _write_jsonl(work / "prompts.jsonl", [{"input_ids": w} for w in windows(judge_files, r.eval_prompts,
                                                                           r.prompt_len, g)])
    cfg = our_config(r, work, work / "unused", {
        "data.path": work / "seed.jsonl", "generate.output_path": work / "regen.jsonl",
        "generate.max_new_tokens": r.reply_len, "generate.batch_size": r.generate_batch,
        "generate.device": device, "generate.dtype": "float32", "generate.stop_token_ids": "[]"})
    return {"generate_s": wall_s(lambda: generate.run(cfg))[0], "sequences": len(seed_lines),
            "tokens": len(seed_lines) * (r.prompt_len + r.reply_len), "judging_prompts": r.eval_prompts}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


# --- our trainer ---------------------------------------------------------------------------------

def our_config(r: Recipe, work: Path, run_dir: Path, overrides: dict | None = None):
    """The recipe as our config: same epochs, K, decay, lr, batch tokens, draft vocab as the peer."""
    from eagle3 import config as config_mod
    base = {"target.path": work / "target", "data.path": work / "regen.jsonl",
            "extract.output_dir": work / "hidden", "vocab.draft_vocab_size": r.draft_vocab,
            "train.output_dir": run_dir, "train.max_steps": 0, "train.epochs": r.epochs,
            "train.ttt_steps": r.ttt_steps, "train.loss_decay": r.loss_decay, "train.lr": r.lr,
            "train.batch_tokens": r.batch_tokens, "train.eval_fraction": r.eval_fraction, "train.seed": r.seed,
            "train.log_every": 50, "train.eval_every": 100000, "train.checkpoint_every": 100000,
            "train.resume": "auto", "export.formats": '["vllm"]', "export.speculative_tokens": r.ttt_steps,
            **(overrides or {})}
    return config_mod.load(None, [x for k, v in base.items() for x in (f"--{k}", str(v))])


def parse_variant(text: str) -> tuple[str, dict]:
    """"name" or "name:section.key=value,section.key=value" -> (name, overrides); a value may be a
    list ("target.aux_layer_ids=[1,3,6]": commas inside brackets do not split)."""
    name, _, rest = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("peer"):
        raise SystemExit(f"error: --variant {text!r}: the name must be letters, digits, '_', '.' or '-', "
                         "not starting with 'peer' (the peer's drafts are named so)")
    pairs = [p.split("=", 1) for p in re.split(r",(?![^\[]*\])", rest) if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"error: --variant {text!r}: expected name:section.key=value,...")
    return name, dict(pairs)


# a variant that changes one of these changes the hidden states: it gets shards of its own
EXTRACTION_KEYS = ("target.", "data.", "extract.")


@contextlib.contextmanager
def locked(work: Path):
    """One process at a time: stages run side by side (the device driver's `bg:` stages) share `work`."""
    with open(work / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def extract_once(r: Recipe, work: Path, hidden: Path, overrides: dict, device: str) -> float | None:
    """Extract into `hidden` unless a complete extraction is there (one process at a time); its
    seconds, or None."""
    from eagle3 import extraction
    manifest = hidden / "manifest.json"
    with locked(work):
        if manifest.exists() and json.loads(manifest.read_text()).get("complete"):
            return None
        cfg = our_config(r, work, work / "unused", {"extract.device": device, **overrides, "extract.output_dir": hidden})
        return wall_s(lambda: extraction.run(cfg))[0]


def run_ours(r: Recipe, work: Path, variants: list[str], device: str) -> dict:
    from eagle3 import checkpoint as ckpt_io
    from eagle3 import training
    out = {}
    if (seconds := extract_once(r, work, work / "hidden", {}, device)) is not None:
        out["extract_s"] = seconds
    for text in variants:
        name, overrides = parse_variant(text)
        run_dir = work / f"ours-{name}"
        if (run_dir / "export" / "vllm" / "config.json").exists():
            continue
        shaping = {k: v for k, v in overrides.items() if k.startswith(EXTRACTION_KEYS)}
        hidden = work / (f"hidden-{name}" if shaping else "hidden")
        if shaping and (seconds := extract_once(r, work, hidden, shaping, device)) is not None:
            out[f"extract_s/{name}"] = seconds
        cfg = our_config(r, work, run_dir, {"train.device": device, **overrides, "extract.output_dir": hidden})
        # a run killed by the call's time limit resumes: its time then covers only the rest
        resumed = ckpt_io.latest(run_dir)
        out[f"train_s/{name}"] = wall_s(lambda: training.run(cfg))[0]
        (run_dir / "bench.json").write_text(json.dumps({"variant": text, "train_s": out[f"train_s/{name}"],
                                                        "resumed_from": str(resumed) if resumed else None}))
    return out


# --- the peer ------------------------------------------------------------------------------------

def run_peer(r: Recipe, work: Path, script: Path, variant: str | None = None) -> dict:
    """The peer on the recipe, into `peer/`; a variant "name:--flag ..." passes its flags to the peer's
    script and trains into `peer-name/` (e.g. `eagle31:--eagle31`, speculators' own norm defaults)."""
    name, _, flags = (variant or "").partition(":")
    if flags and not name:
        raise SystemExit(f"error: --peer-variant {variant!r}: flags need a name (name:--flag ...)")
    label = f"peer-{name}" if name else "peer"
    if (work / label / "config.json").exists():
        return {}
    cmd = [sys.executable, str(script), str(work / "target"), str(work / "regen.jsonl"), str(work / label),
           "--epochs", str(r.epochs), "--ttt-steps", str(r.ttt_steps), "--draft-vocab", str(r.draft_vocab),
           "--lr", str(r.lr), "--decay", str(r.loss_decay), "--batch-tokens", str(r.batch_tokens),
           "--work", str(work / f"{label}_run"), *flags.split()]
    wall, p = wall_s(lambda: subprocess.run(cmd, capture_output=True, text=True))
    log = p.stdout + p.stderr
    (work / f"{label}.log").write_text(log)
    if p.returncode:
        raise SystemExit(f"error: the peer failed (rc {p.returncode}); its log: {work / f'{label}.log'}\n{log[-3000:]}")
    found = {k: float(v) for k, v in re.findall(r"peer (extraction|training): (?:rc \d+, )?.*?(\d+)s", log)}
    result = {"peer_wall_s": wall, "peer_extract_s": found.get("extraction"), "peer_train_s": found.get("training"),
              "variant": variant}
    (work / label / "bench.json").write_text(strict_json(result))
    return {f"{k}/{name}" if name else k: v for k, v in result.items() if k != "variant"}


# --- measure -------------------------------------------------------------------------------------

def drafts(work: Path) -> dict[str, Path]:
    found = {p.name.removeprefix("ours-"): p / "export" / "vllm" for p in sorted(work.glob("ours-*"))
             if (p / "export" / "vllm" / "config.json").exists()}
    for p in sorted(work.glob("peer*")):
        if (p / "config.json").exists():
            found[p.name] = p
    return found


def measure(r: Recipe, work: Path, device: str) -> dict:
    from eagle3.evaluate import real_decoding
    cfg = our_config(r, work, work / "unused", {"evaluate.device": device, "evaluate.dtype": "float32",
                                                "evaluate.max_new_tokens": r.eval_new_tokens,
                                                "evaluate.k": r.ttt_steps})
    greedy_cache: dict = {}
    results = {}
    for name, path in drafts(work).items():
        report = real_decoding(cfg, path, work / "prompts.jsonl", greedy_cache=greedy_cache,
                               out=work / f"eval-{name}.json")
        bench = path / "bench.json" if name.startswith("peer") else path.parent.parent / "bench.json"
        results[name] = {**{k: report[k] for k in ("real_accept_len", "per_position_acceptance", "rounds",
                                                   "mismatches", "prompts", "new_tokens")},
                         **(json.loads(bench.read_text()) if bench.exists() else {})}
    return results


def table(results: dict) -> str:
    peer = results.get("peer", {}).get("real_accept_len")
    lines = ["| draft | real tau | vs peer | mismatches | acceptance at positions 1..k | train s |",
             "|---|---:|---:|---:|---|---:|"]
    for name, m in results.items():
        ratio = f"{m['real_accept_len'] / peer:.3f}" if peer else "-"
        train = m.get("train_s") or m.get("peer_train_s")
        positions = " ".join(f"{a:.2f}" for a in m["per_position_acceptance"])
        seconds = (f"{train:.0f}" + (" (resumed)" if m.get("resumed_from") else "")) if train else "-"
        lines.append(f"| {name} | {m['real_accept_len']:.3f} | {ratio} | {m['mismatches']} | {positions} | {seconds} |")
    return "\n".join(lines)


STAGES = ("target", "data", "ours", "peer", "measure")


def check_recipe(built: dict | None, asked: dict, work: Path) -> None:
    """Stages skip what --work already holds, so everything there must come from the same recipe."""
    changed = {k: (built[k], v) for k, v in asked.items() if built is not None and built.get(k, v) != v}
    if changed:
        raise SystemExit(f"error: {work / 'quality.json'}: {work} was built with another recipe ("
                         + ", ".join(f"{k}: {a!r} there, {b!r} asked" for k, (a, b) in changed.items())
                         + "); use another --work")


def with_changes(r: Recipe, changes: list[str]) -> Recipe:
    """The recipe with `key=value` changes, each converted to the field's type."""
    fields = {f.name: f.type for f in dataclasses.fields(Recipe)}
    values = {}
    for change in changes:
        key, eq, value = change.partition("=")
        if not eq or key not in fields:
            raise SystemExit(f"error: --recipe {change!r}: expected key=value with key one of {', '.join(fields)}")
        values[key] = {"int": int, "float": float}[fields[key]](value)
    return dataclasses.replace(r, **values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.bench quality", description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="runs/quality", help="where every stage reads and writes")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    parser.add_argument("--variant", action="append", default=None,
                        help="our recipe variant, name[:section.key=value,...]; repeatable (default: base)")
    parser.add_argument("--peer-script", default="bench/peer/speculators_quality.py",
                        help="the peer's quality script (speculators 0.9.0 training on a Llama target)")
    parser.add_argument("--peer-variant", default=None,
                        help="name:--flag ...: the peer with these flags of its script, into peer-name/")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    parser.add_argument("--recipe", action="append", default=[],
                        help="change one Recipe field, key=value (e.g. train_prompts=3072); repeatable")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if unknown := set(stages) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}; expected {', '.join(STAGES)}")
    r = with_changes(TINY if args.tiny else Recipe(), args.recipe)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    summary_path = work / "quality.json"
    built = json.loads(summary_path.read_text()) if summary_path.exists() else {}   # written whole, atomically
    check_recipe(built.get("recipe"), dataclasses.asdict(r), work)
    new: dict = {"recipe": dataclasses.asdict(r)}
    if "target" in stages and not (work / "target" / "config.json").exists():
        new["target"] = build_target(r, work, torch.device(device))
    if "data" in stages and not (work / "regen.jsonl").exists():
        new["data"] = build_data(r, work, device)
    if "ours" in stages:
        new["ours"] = run_ours(r, work, args.variant or ["base"], device)
    if "peer" in stages:
        new["peer"] = run_peer(r, work, Path(args.peer_script), args.peer_variant)
    if "measure" in stages:
        new["results"] = measure(r, work, device)
        print(table(new["results"]))
    with locked(work):   # merged into what processes beside this one wrote meanwhile
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        for key, value in new.items():
            if key in ("ours", "peer"):
                summary.setdefault(key, {}).update(value)
            else:
                summary[key] = value
        atomic_write_text(summary_path, strict_json(summary, indent=1))
    print(strict_json({k: v for k, v in summary.items() if k != "recipe"}, indent=1))
