"""Train the two reference models (dense Llama, Qwen3-MoE) on the stdlib corpus.

Runs with PyTorch + transformers (on the GPU machine; ``--device cpu --smoke``
is a quick local check of the whole path). It trains each model for a fixed
budget (wall-clock and an epoch cap, whichever comes first), evaluates held-out
loss with the exported bf16 weights, and writes for each model:

    OUT/<name>/model-0000k-of-0000n.safetensors   (or model.safetensors)
    OUT/<name>/meta.json   {"files": {config.json, generation_config.json,
                            model.safetensors.index.json: text}, "metrics": {...}}

The small JSON files travel inside ``meta.json`` so that the whole result stays
within the device's 8-file limit; ``reference/place.py`` unpacks them.

Usage (device):
    python3 reference/train.py --data .refdata --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
EOS_ID, PAD_ID = 0, 1
VOCAB = 8192
PROMPT = "def fibonacci(n):\n"

# Every linear input dimension is a multiple of 64 (group-64 quantization applies
# everywhere) and a power of two times 1 or 12 (Hadamard sizes MLX supports).
DENSE = dict(
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=EOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)
MOE = dict(
    model_type="qwen3_moe",
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=768,  # unused: every layer is sparse (decoder_sparse_step 1)
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    attention_bias=False,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.01,
    output_router_logits=False,
    use_sliding_window=False,
    sliding_window=None,
    bos_token_id=EOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- model


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """All experts on all tokens, weighted by the (sparse) routing weights.

    Exactly top-k routing (unselected experts get weight 0, so neither output nor
    gradient), at E/k times the expert FLOPs: for a model this small that is
    cheaper than sorting tokens, and it needs no grouped GEMM of a given dtype.
    """
    n = hidden_states.shape[0]
    e = self.gate_up_proj.shape[0]
    w = torch.zeros(n, e, dtype=top_k_weights.dtype, device=hidden_states.device)
    w.scatter_(1, top_k_index, top_k_weights)
    gu = torch.einsum("nh,eoh->eno", hidden_states, self.gate_up_proj)
    g, u = gu.chunk(2, dim=-1)
    h = F.silu(g) * u
    out = torch.einsum("eni,ehi->enh", h, self.down_proj)
    return torch.einsum("enh,ne->nh", out, w.to(out.dtype)).to(hidden_states.dtype)


def patch_experts(model, device) -> str:
    """Use dense_experts_forward where the layout is v5's fused one and it agrees."""
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if not experts:
        return "library (per-expert modules)"
    m = experts[0]
    if m.gate_up_proj.dim() != 3 or m.gate_up_proj.shape[1] != 2 * m.down_proj.shape[2]:
        return "library (unexpected fused layout)"
    torch.manual_seed(1)
    x = torch.randn(64, m.gate_up_proj.shape[2], device=device)
    idx = torch.stack([torch.randperm(m.gate_up_proj.shape[0], device=device)[:2] for _ in range(64)])
    wts = torch.rand(64, 2, device=device)
    with torch.no_grad():
        ref = m(x, idx, wts)
        got = dense_experts_forward(m, x, idx, wts)
    err = (ref - got).abs().max().item()
    if err > 1e-4 * max(1.0, ref.abs().max().item()):
        return f"library (dense forward disagreed: {err:.2e})"
    for mod in experts:
        mod.forward = types.MethodType(dense_experts_forward, mod)
    return f"dense all-experts (checked against library forward, max err {err:.1e})"


def build(spec: dict, device):
    import transformers

    cfg_cls = transformers.LlamaConfig if spec["model_type"] == "llama" else transformers.Qwen3MoeConfig
    model_cls = (
        transformers.LlamaForCausalLM if spec["model_type"] == "llama" else transformers.Qwen3MoeForCausalLM
    )
    kw = {k: v for k, v in spec.items() if k != "model_type"}
    cfg = cfg_cls(**kw)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:
        pass
    torch.manual_seed(0)
    model = model_cls(cfg).to(device=device, dtype=torch.float32)
    return model


def count_params(model, spec) -> dict:
    total = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    emb = spec["vocab_size"] * spec["hidden_size"]
    d = {"params": total, "params_embedding": emb, "params_non_embedding": total - emb}
    if spec["model_type"] == "qwen3_moe":
        per_expert = 3 * spec["hidden_size"] * spec["moe_intermediate_size"]
        inactive = spec["num_hidden_layers"] * per_expert * (spec["num_experts"] - spec["num_experts_per_tok"])
        d["params_active_per_token"] = total - inactive
    return d


# --------------------------------------------------------------------------- data / eval


def chunks(ids: torch.Tensor, seq: int) -> torch.Tensor:
    n = ids.numel() // seq
    return ids[: n * seq].view(n, seq)


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, moe: bool, bs: int = 64, autocast=None) -> float:
    """Mean next-token NLL (nats) over rows, each row an independent sequence."""
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, rows.shape[0], bs):
        x = rows[i : i + bs]
        ctx = autocast() if autocast else torch.autocast(x.device.type, enabled=False)
        with ctx:
            logits = model(input_ids=x[:, :-1]).logits
        l = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        tot += l.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


@torch.no_grad()
def greedy(model, tok, prompt: str, n: int, device) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    for _ in range(n):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        if nxt.item() == EOS_ID:
            break
    model.train()
    return tok.decode(ids[0].tolist())


# --------------------------------------------------------------------------- export


def fix_config(path: Path, spec: dict) -> dict:
    """Make config.json readable by transformers 4.x/5.x AND mlx-lm.

    transformers 5 writes ``rope_parameters`` and ``num_local_experts``; mlx-lm
    (and Hub checkpoints of these families) read ``rope_theta`` and
    ``num_experts``. Keep both spellings.
    """
    cfg = json.loads(path.read_text())
    cfg["rope_theta"] = spec["rope_theta"]
    cfg.setdefault("rope_scaling", None)
    if spec["model_type"] == "qwen3_moe":
        cfg["num_experts"] = spec["num_experts"]
        cfg["mlp_only_layers"] = []
        cfg["decoder_sparse_step"] = 1
        cfg["norm_topk_prob"] = True
        cfg["output_router_logits"] = False
    cfg["torch_dtype"] = "bfloat16"
    if "dtype" in cfg:
        cfg["dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM" if spec["model_type"] == "llama" else "Qwen3MoeForCausalLM"]
    cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"] = EOS_ID, EOS_ID, PAD_ID
    cfg["tie_word_embeddings"] = True
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def check_layout(export: Path, spec: dict) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(export.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            keys += list(sf.keys())
    if spec["model_type"] == "qwen3_moe":
        want = f"model.layers.0.mlp.experts.{spec['num_experts'] - 1}.down_proj.weight"
        if want not in keys:
            raise RuntimeError(f"MoE export lacks per-expert keys (e.g. {want}); got {sorted(keys)[:12]}")
    return keys


# --------------------------------------------------------------------------- train


def train_one(name, spec, args, data, tok, out: Path, device) -> dict:
    moe = spec["model_type"] == "qwen3_moe"
    t_start = time.time()
    model = build(spec, device)
    pc = count_params(model, spec)
    experts_impl = patch_experts(model, device) if moe else None
    log(f"{name}: {pc} experts={experts_impl}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {}),
    )
    train_ids, held_rows, txt_rows, train_rows = data
    n_tok = train_ids.numel()
    B, T = args.batch, args.seq
    cap_steps = int(args.max_epochs * n_tok / (B * T))
    if args.max_steps:
        cap_steps = min(cap_steps, args.max_steps)
    total = cap_steps  # revised after timing the first steps
    warm = min(args.warmup, max(1, cap_steps // 10))
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    ar = torch.arange(T + 1, device=device)

    def lr_at(step):
        if step < warm:
            return args.lr * (step + 1) / warm
        p = min(1.0, (step - warm) / max(1, total - warm))
        return args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * p))

    def amp():
        return torch.autocast(device.type, dtype=torch.bfloat16)

    losses, hist = [], []
    step, t_train0, t_calib = 0, None, None
    model.train()
    while step < total:
        if step == 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_train0 = time.time()
        if step == 23 and t_calib is None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.time() - t_train0) / 20
            by_time = int(args.budget_s / dt)
            total = max(warm + 10, min(cap_steps, by_time))
            t_calib = dt
            log(f"{name}: {dt*1e3:.1f} ms/step ({B*T/dt/1e6:.2f} M tok/s); steps by time {by_time}, by epoch cap {cap_steps} -> {total}")
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        off = torch.randint(0, n_tok - T - 1, (B,), device=device, generator=gen)
        x = train_ids[off[:, None] + ar]
        with amp():
            res = model(input_ids=x[:, :-1], output_router_logits=True) if moe else model(input_ids=x[:, :-1])
            loss = F.cross_entropy(res.logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            full = loss
            if moe and getattr(res, "aux_loss", None) is not None:
                full = loss + spec["router_aux_loss_coef"] * res.aux_loss
        opt.zero_grad(set_to_none=True)
        full.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.detach())
        step += 1
        if step % args.log_every == 0 or step == total:
            l = torch.stack(losses[-args.log_every :]).mean().item()
            el = time.time() - t_start
            hist.append({"step": step, "loss": round(l, 4), "lr": lr_at(step - 1), "t": round(el, 1)})
            log(f"{name} step {step}/{total} loss {l:.4f} lr {lr_at(step-1):.2e} gnorm {gn.item():.2f} t {el:.0f}s")
        if args.eval_every and step % args.eval_every == 0 and step < total:
            hl = eval_loss(model, held_rows[:128], moe, autocast=amp)
            hist.append({"step": step, "heldout_loss_subset": round(hl, 4)})
            log(f"{name} step {step} held-out (subset, autocast) {hl:.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_wall = time.time() - t_start
    final_train = torch.stack(losses[-min(len(losses), 100) :]).mean().item()

    # Export bf16, then evaluate the exported weights in float32 arithmetic.
    model = model.to(torch.bfloat16)
    try:
        model.config.torch_dtype = torch.bfloat16
    except Exception:
        pass
    model.generation_config.bos_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    export = Path(args.tmp) / name
    shutil.rmtree(export, ignore_errors=True)
    model.save_pretrained(str(export), max_shard_size=args.max_shard, safe_serialization=True)
    cfg = fix_config(export / "config.json", spec)
    keys = check_layout(export, spec)

    evalm = model.float()
    held = eval_loss(evalm, held_rows, moe)
    txt = eval_loss(evalm, txt_rows, moe)
    txt8 = eval_loss(evalm, txt_rows[: args.mlx_chunks], moe)
    trn = eval_loss(evalm, train_rows, moe)
    sample = greedy(evalm, tok, PROMPT, 96, device) if tok else None
    log(f"{name}: held-out {held:.4f} (ppl {math.exp(held):.2f}); heldout.txt {txt:.4f}; "
        f"heldout.txt[:{args.mlx_chunks}x{args.seq}] {txt8:.4f}; train-split eval {trn:.4f}")
    if sample:
        log(f"{name} sample:\n{sample}\n---")

    # Round trip: transformers reloads the exported folder and agrees.
    import transformers

    try:
        re = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    except TypeError:
        re = transformers.AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32)
    re = re.to(device)
    txt8_re = eval_loss(re, txt_rows[: args.mlx_chunks], moe)
    log(f"{name}: reloaded with transformers: heldout.txt[:{args.mlx_chunks}] {txt8_re:.5f} vs {txt8:.5f}")
    del re

    files = {}
    for f in sorted(export.iterdir()):
        if f.suffix == ".json":
            files[f.name] = f.read_text()
    shards = sorted(p.name for p in export.glob("*.safetensors"))
    size = sum((export / s).stat().st_size for s in shards)
    metrics = {
        "name": name,
        "architecture": cfg["architectures"][0],
        **pc,
        "experts_impl": experts_impl,
        "steps": step,
        "batch": B,
        "seq_len": T,
        "tokens_seen": step * B * T,
        "epochs": round(step * B * T / n_tok, 2),
        "train_tokens": n_tok,
        "lr": args.lr,
        "lr_min": args.lr_min,
        "warmup": warm,
        "weight_decay": args.wd,
        "ms_per_step": round(1e3 * t_calib, 2) if t_calib else None,
        "final_train_loss_last100": round(final_train, 4),
        "train_split_eval_loss": round(trn, 4),
        "heldout_loss": round(held, 4),
        "heldout_ppl": round(math.exp(held), 3),
        "heldout_tokens_eval": int(held_rows.numel()),
        "heldout_txt_loss": round(txt, 4),
        "heldout_txt_loss_first_chunks": round(txt8, 5),
        "heldout_txt_first_chunks": args.mlx_chunks,
        "heldout_txt_loss_first_chunks_reloaded": round(txt8_re, 5),
        "eval_note": "exported bf16 weights, float32 arithmetic, independent rows of seq_len tokens",
        "wall_time_s": round(train_wall, 1),
        "export_bytes": size,
        "shards": shards,
        "num_tensors": len(keys),
        "sample_prompt": PROMPT,
        "sample_greedy": sample,
        "history": hist,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        },
    }
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    for s in shards:
        shutil.copy2(export / s, dest / s)
    (dest / "meta.json").write_text(json.dumps({"files": files, "metrics": metrics}, indent=1))
    log(f"{name}: wrote {dest} ({len(shards)} shards, {size/1e6:.2f} MB)")
    del model, evalm, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=HERE.parent / ".refdata")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/refout")))
    ap.add_argument("--tmp", default="/tmp/ref_export")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-min", type=float, default=2e-4)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--budget-s", type=float, default=180.0, help="training wall-clock per model")
    ap.add_argument("--max-epochs", type=float, default=6.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--mlx-chunks", type=int, default=8)
    ap.add_argument("--max-shard", default="15MB")
    ap.add_argument("--smoke", action="store_true", help="tiny local run of the whole path")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.max_steps, args.log_every, args.eval_every = 4, 128, 30, 10, 20
        args.warmup = 5

    import transformers

    try:
        transformers.utils.logging.disable_progress_bar()
    except Exception:
        pass
    have = {c: hasattr(transformers, c) for c in ("LlamaForCausalLM", "Qwen3MoeForCausalLM")}
    log(f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} {have}")
    device = torch.device(args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu")
    if device.type == "cuda":
        log(f"device {torch.cuda.get_device_name()}")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tok = None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(HERE / "tokenizer" / "tokenizer.json"))
    except Exception as e:  # generation sample is optional
        log(f"no tokenizer: {e}")

    train_np = np.load(args.data / "train.npy").astype(np.int64)
    held_np = np.load(args.data / "heldout.npy").astype(np.int64)
    txt_np = np.load(args.data / "heldout_txt.npy").astype(np.int64)
    train_ids = torch.from_numpy(train_np).to(device)
    held_rows = chunks(torch.from_numpy(held_np).to(device), args.seq)
    txt_rows = chunks(torch.from_numpy(txt_np).to(device), args.seq)
    # A fixed sample of training rows, as many as held-out rows: the generalisation gap.
    g = np.random.default_rng(7)
    starts = g.integers(0, train_np.size - args.seq, size=held_rows.shape[0])
    train_rows = torch.from_numpy(np.stack([train_np[s : s + args.seq] for s in starts])).to(device)
    if args.smoke:
        held_rows, txt_rows, train_rows = held_rows[:8], txt_rows[:8], train_rows[:8]
    log(f"train {train_ids.numel()} tokens, held-out rows {tuple(held_rows.shape)}, heldout.txt rows {tuple(txt_rows.shape)}")

    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.models.split(","):
        spec = DENSE if name == "dense" else MOE
        cls = "LlamaForCausalLM" if name == "dense" else "Qwen3MoeForCausalLM"
        if not have[cls]:
            log(f"SKIP {name}: transformers {transformers.__version__} has no {cls}")
            continue
        try:
            results[name] = train_one(name, spec, args, (train_ids, held_rows, txt_rows, train_rows), tok, args.out, device)
        except Exception as e:
            import traceback

            traceback.print_exc()
            log(f"FAILED {name}: {e!r}")
    summary = {k: {kk: v[kk] for kk in ("params", "steps", "tokens_seen", "final_train_loss_last100",
                                         "heldout_loss", "heldout_ppl", "wall_time_s")} for k, v in results.items()}
    log("SUMMARY " + json.dumps(summary))
    return 0 if len(results) == len(args.models.split(",")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
