#!/usr/bin/env python3
"""memtune on a GPU against transformers + PEFT (PyTorch eager, SDPA), in one run.

    python3 bench/gpu_vs_hf.py [--models 1b,8b] [--memtune build-torch-wheel/memtune]
                               [--work DIR] [--json FILE] [--steps N]

For a GPU machine with a memtune built against CUDA (scripts/torch_wheel_build.sh) and a
Python with torch, transformers and peft (the lent H100's image). For each model, random
weights in Hugging Face format written by `memtune init-model --config` (a Llama-3.2-1B-shaped
and a Llama-3-8B-shaped config), the same random token ids, LoRA r 16 / alpha 32 on every
linear layer, bf16, with gradient checkpointing off and on:
  - memtune LoRA (model.torch_dtype bfloat16 with training.bf16: the frozen base, the
    activations and the products in bf16; fp32 adapters multiplying in bf16 under the
    Trainer's autocast, as the peer's),
  - memtune QLoRA (NF4 + double quantization, bf16 compute, the rest of the model in bf16),
  - transformers + peft bf16 LoRA (AutoModelForCausalLM in bf16, attn_implementation sdpa,
    the forward under torch.autocast(bf16) as the Trainer's bf16=True runs it (PEFT's fp32
    adapters then multiply in bf16), torch.optim.AdamW on the adapters), each in a process
    of its own (results before 2026-11-27 ran both sides' adapters in fp32, without autocast);
tokens/s (median of the steps after warm-up), peak GPU memory (memtune: its budget's peak;
the peer: torch.cuda.max_memory_allocated) and MFU against the bf16 matmul peak measured by
this run. Then the 8B-shaped QLoRA under memory.device_limit=24GiB. The table and the
issue's ratios print at the end, then each memtune run's estimated peak (train.log's
`memory plan:` line, the memory model's) beside the peak it measured; --json keeps
everything. A memtune run that fails is its row's cell (its log's tail in the JSON): the
other runs still go.

`--smoke` runs the memtune half on a tiny model on the CPU (no GPU, no peer): how this
script is checked on a machine without a GPU. On a lent GPU machine, whose calls end after
10 minutes, split the work: `--models 1b` in one call, `--models 8b --ckpt none` and
`--models 8b --ckpt all` (which adds the 24 GiB run) in others, --work on a disk that stays.
"""
import argparse
import datetime
import json
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = [p + "_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")]
LORA_R, LORA_ALPHA = 16, 32

MODELS = {
    # Llama-3.2-1B's shape (tied embeddings) and Llama-3-8B's.
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tie=True,
               seq=1024, micro_batch=4, accum=2),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tie=False,
               seq=1024, micro_batch=2, accum=2),
    # --smoke: the memtune half on the CPU.
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=172, vocab=512, tie=False,
                 seq=64, micro_batch=2, accum=2),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def run(cmd, env=None, timeout=None):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def hf_config(m):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m["hidden"],
        "intermediate_size": m["intermediate"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["kv_heads"],
        "head_dim": m["hidden"] // m["heads"], "vocab_size": m["vocab"], "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": m["tie"], "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def write_tokens(path, vocab, count, seed):
    """llm.c's token file: 256 int32 header (magic, version, count), then the ids: uint16
    (magic 20240520, version 1) when they fit, else uint32 (llm.c's 20240801, version 7; a
    vocabulary of 128256 does not fit 16 bits), both as data/token_file.h reads them."""
    rng = random.Random(seed)
    wide = vocab > 65536
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240801 if wide else 20240520, 7 if wide else 1, count, *([0] * 253)))
        ids = [rng.randrange(vocab) for _ in range(count)]
        f.write(struct.pack(f"<{count}{'I' if wide else 'H'}", *ids))


def read_tokens(path):
    with open(path, "rb") as f:
        header = struct.unpack("<256i", f.read(1024))
        count = header[2]
        width = "I" if header[0] == 20240801 else "H"
        return list(struct.unpack(f"<{count}{width}", f.read(count * (4 if width == "I" else 2))))


def flops_per_token(m):
    """Model FLOPs of one trained LoRA token: the frozen base's forward and input-gradient
    products, the adapters' three, causal attention as half of T x T; recomputation not counted."""
    h, i, L, V, T = m["hidden"], m["intermediate"], m["layers"], m["vocab"], m["seq"]
    kv = m["kv_heads"] * (h // m["heads"])
    proj = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down (in, out)
    linear = 2 * (L * sum(a * b for a, b in proj) + h * V)
    attn = 2 * 2 * L * h * T / 2
    lora = 2 * L * sum(LORA_R * (a + b) for a, b in proj)
    return 2 * linear + 3 * attn + 3 * lora


def memtune_run(args, name, m, mode, ckpt, model_dir, tokens, device, extra=None):
    out = os.path.join(args.work, f"run-{name}-{mode}-{ckpt}{'-' + extra['tag'] if extra else ''}")
    shutil.rmtree(out, ignore_errors=True)
    bf16 = device != "cpu"
    cfg = {
        # On the GPU a bf16 model, as the peer loads it (AutoModelForCausalLM in bf16).
        "model": {"name_or_path": model_dir, "torch_dtype": "bfloat16" if bf16 else "float32"},
        "lora": {"r": LORA_R, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0, "target_modules": TARGETS},
        "runtime": {"device": device},
        "training": {
            "output_dir": out, "per_device_train_batch_size": m["micro_batch"],
            "gradient_accumulation_steps": m["accum"], "gradient_checkpointing": ckpt == "all",
            "learning_rate": 1e-4, "max_steps": args.steps, "logging_steps": 1, "save_steps": 0,
            "weight_decay": 0.0, "warmup_steps": 0, "bf16": bf16,
        },
        "data": {"train_file": tokens, "format": "tokens", "max_seq_length": m["seq"]},
        "memory": {"grow_after_steps": 1000},
    }
    if mode == "qlora":
        cfg["model"]["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                               "bnb_4bit_use_double_quant": True,
                                               "bnb_4bit_compute_dtype": "bfloat16" if bf16 else "float32"}
    if extra:
        cfg["memory"].update(extra.get("memory", {}))
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)  # JSON is YAML
    start = time.time()
    run([args.memtune, "train", path], timeout=3000)
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    timed = [r for r in rows if r["step"] > args.warmup] or rows
    key = next(iter(rows[0]["memory"]))
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "peak_gib": max(r["memory"][key]["peak"] for r in rows) / 2**30,
        "estimate_gib": estimated_peak_gib(os.path.join(out, "train.log")),
        "micro_batch": rows[-1]["micro_batch"], "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
        "events": [e for r in rows for e in r["events"]], "wall_s": time.time() - start,
    }


def estimated_peak_gib(train_log):
    """The memory model's peak for the run's first plan, from train.log's `memory plan:` line
    (None where the log has none)."""
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    with open(train_log) as f:
        m = re.search(r"memory plan: estimated peak ([0-9.]+) (B|KiB|MiB|GiB|TiB) at", f.read())
    return float(m.group(1)) * units[m.group(2)] / 2**30 if m else None


def peer_main(a):
    """One transformers + peft run (a process of its own: its own CUDA memory); a JSON line."""
    import torch
    import peft
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").cuda()
    if a.ckpt == "all":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                       target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    ids = torch.tensor(read_tokens(a.tokens), dtype=torch.long)
    B, T, acc = a.micro_batch, a.seq, a.accum
    times, losses, at = [], [], 0
    for _ in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(acc):
            rows = []
            for _ in range(B):
                rows.append(ids[at:at + T])
                at += T
            x = torch.stack(rows).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):  # the Trainer's bf16=True
                loss = model(input_ids=x, labels=x).loss
            (loss / acc).backward()
            total += loss.item() / acc
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(total)
    timed = times[a.warmup:] or times
    print(json.dumps({"tokens_per_s": B * T * acc / statistics.median(timed),
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "first_loss": losses[0], "final_loss": losses[-1], "autocast": "bf16",
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                   "peft": peft.__version__}}))


def matmul_peak_main():
    """The GPU's bf16 matmul rate at a large square shape, TFLOP/s (the MFU yardstick)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    print(json.dumps({"bf16_tflops": 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12,
                      "gpu": torch.cuda.get_device_name(0)}))


def peer_run(args, m, ckpt, model_dir, tokens):
    p = run([sys.executable, os.path.abspath(__file__), "--peer", "--model", model_dir, "--tokens", tokens,
             "--ckpt", ckpt, "--micro-batch", m["micro_batch"], "--accum", m["accum"], "--seq", m["seq"],
             "--steps", args.steps, "--warmup", args.warmup], timeout=3000)
    return json.loads(p.stdout.strip().splitlines()[-1])


def attempt(what, run_it, describe):
    """run_it() (a peer or memtune run); a run that fails (out of memory, a crash) becomes
    {"error": its output's tail} so that its row says so and the other runs still go."""
    try:
        r = run_it()
    except SystemExit as e:
        log(f"{what} failed: {str(e)[-1500:]}")
        return {"error": str(e)[-2000:]}
    log(f"{what}: {describe(r)}")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,8b")
    ap.add_argument("--memtune", default=os.path.join(ROOT, "build-torch-wheel", "memtune"))
    ap.add_argument("--work", default="/tmp/memtune-gpu-vs-hf")
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ckpt", default="none,all", help="gradient checkpointing settings to run: none, all")
    ap.add_argument("--smoke", action="store_true", help="the memtune half, tiny model, on the CPU")
    # The peer's own process (internal).
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--matmul-peak", action="store_true", help=argparse.SUPPRESS)
    for k in ("model", "tokens"):
        ap.add_argument("--" + k, help=argparse.SUPPRESS)
    for k in ("micro-batch", "accum", "seq"):
        ap.add_argument("--" + k, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_main(args)
    if args.matmul_peak:
        return matmul_peak_main()
    if not os.path.exists(args.memtune):
        raise SystemExit(f"{args.memtune} is missing: build memtune first (scripts/torch_wheel_build.sh)")
    os.makedirs(args.work, exist_ok=True)
    names = ["tiny"] if args.smoke else args.models.split(",")
    device = "cpu" if args.smoke else "cuda:0"
    peak = None if args.smoke else json.loads(run([sys.executable, os.path.abspath(__file__), "--matmul-peak"])
                                              .stdout.strip().splitlines()[-1])
    if peak:
        log(f"{peak['gpu']}: bf16 matmul {peak['bf16_tflops']:.0f} TFLOP/s")
    rows = []

    def keep():  # after every row, so a call cut off by its time limit keeps the rows it finished
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "matmul": peak, "steps": args.steps,
                           "warmup": args.warmup, "rows": rows}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)  # never a half-written file

    for name in names:
        m = MODELS[name]
        model_dir = os.path.join(args.work, f"model-{name}")
        cfg_path = os.path.join(args.work, f"config-{name}.json")
        with open(cfg_path, "w") as f:
            json.dump(hf_config(m), f)
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            log(f"{name}: memtune init-model --config {cfg_path}")
            run([args.memtune, "init-model", "--config", cfg_path, "--out", model_dir, "--seed", "1"], timeout=3000)
        tokens = os.path.join(args.work, f"tokens-{name}.bin")
        write_tokens(tokens, m["vocab"], m["seq"] * m["micro_batch"] * m["accum"] * (args.steps + 1) + 1, 7)
        for ckpt in args.ckpt.split(","):
            row = {"model": name, "checkpointing": ckpt, "seq": m["seq"], "micro_batch": m["micro_batch"],
                   "accum": m["accum"]}
            if not args.smoke:
                row["peer"] = attempt(f"{name} ckpt={ckpt} peer", lambda: peer_run(args, m, ckpt, model_dir, tokens),
                                      lambda r: f"{r['tokens_per_s']:.0f} tok/s, {r['peak_gib']:.1f} GiB")
            for mode in ("lora", "qlora"):
                r = attempt(f"{name} ckpt={ckpt} memtune {mode}",
                            lambda: memtune_run(args, name, m, mode, ckpt, model_dir, tokens, device),
                            lambda r: f"{r['tokens_per_s']:.0f} tok/s, {r['peak_gib']:.2f} GiB")
                if peak and "error" not in r:
                    r["mfu"] = r["tokens_per_s"] * flops_per_token(m) / (peak["bf16_tflops"] * 1e12)
                row[mode] = r
            if peak and "tokens_per_s" in row.get("peer", {}):
                row["peer"]["mfu"] = row["peer"]["tokens_per_s"] * flops_per_token(m) / (peak["bf16_tflops"] * 1e12)
            rows.append(row)
            keep()
        if (name == "8b" or args.smoke) and "all" in args.ckpt.split(","):
            # The seeds' consumer card: QLoRA inside 24 GiB, every layer checkpointed.
            limit = "24GiB" if name == "8b" else "64MiB"
            r = attempt(f"{name} QLoRA under {limit}",
                        lambda: memtune_run(args, name, m, "qlora", "all", model_dir, tokens, device,
                                            extra={"tag": "limit", "memory": {"device_limit": limit}}),
                        lambda r: f"{r['tokens_per_s']:.0f} tok/s, {r['peak_gib']:.2f} GiB, "
                                  f"micro-batch {r['micro_batch']}")
            r["device_limit"] = limit
            rows.append({"model": name, "checkpointing": "all", "limited": r})
            keep()

    result = {"date": datetime.date.today().isoformat(), "matmul": peak, "steps": args.steps,
              "warmup": args.warmup, "rows": rows}
    print("| model | ckpt | peer tok/s | peer GiB | LoRA tok/s (x peer) | LoRA GiB | QLoRA tok/s (x peer) | "
          "QLoRA GiB (x peer) | MFU peer / LoRA / QLoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "limited" in row:
            r = row["limited"]
            got = (f"{r['tokens_per_s']:.0f} tok/s, {r['peak_gib']:.2f} GiB, micro-batch {r['micro_batch']}"
                   if "error" not in r else "failed (the JSON has its log's tail)")
            print(f"| {row['model']} | all | QLoRA under {r['device_limit']}: {got} | | | | | | |")
            continue
        peer = row.get("peer", {})
        pt = peer.get("tokens_per_s")

        def ratio(x):
            return f" ({x / pt:.2f}x)" if pt else ""

        def mfu(r):
            return f"{100 * r['mfu']:.0f} %" if "mfu" in r else "-"

        def speed(r):
            return f"{r['tokens_per_s']:.0f}{ratio(r['tokens_per_s'])}" if "tokens_per_s" in r else "failed"

        def gib(r, of_peer=False):
            if "peak_gib" not in r:
                return "-"
            return f"{r['peak_gib']:.2f}" + (f" ({r['peak_gib'] / peer['peak_gib']:.2f}x)"
                                             if of_peer and "peak_gib" in peer else "")

        lo, ql = row["lora"], row["qlora"]
        print(f"| {row['model']} | {row['checkpointing']} | {f'{pt:.0f}' if pt else '-'} | {gib(peer)} | "
              f"{speed(lo)} | {gib(lo)} | {speed(ql)} | {gib(ql, True)} | {mfu(peer)} / {mfu(lo)} / {mfu(ql)} |")
    # The memory model against the run: train.log's estimated peak for the first plan beside
    # the peak the run measured (the CUDA caching allocator's, on a GPU).
    print()
    print("| model | ckpt | run | estimated peak GiB | measured peak GiB | estimate / measured |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        runs = [("QLoRA under " + row["limited"]["device_limit"], row["limited"])] if "limited" in row else \
            [("LoRA", row["lora"]), ("QLoRA", row["qlora"])]
        for label, r in runs:
            est, got = r.get("estimate_gib"), r.get("peak_gib")
            if est is None or not got:
                continue
            print(f"| {row['model']} | {row['checkpointing']} | {label} | {est:.2f} | {got:.2f} | {est / got:.3f} |")
    keep()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
