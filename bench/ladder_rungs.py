#!/usr/bin/env python3
"""What each rung of the supervisor's ladder costs: peak device memory and tokens/s at
micro-batch 1 with nothing else, then with every layer checkpointed, + activation offload,
+ 8-bit optimizer state (the optimizer_8bit rung, instead of the next), + optimizer offload,
+ every decoder layer offloaded (LoRA only: full fine-tuning trains
those weights), measured with `memtune train` in one run, side by side.

    python3 bench/ladder_rungs.py [--model M|S|gpt2] [--steps N] [--modes qlora,full] [--json FILE]

Builds nothing: run `bash scripts/build.sh` first. The model is bench/train_vs_peer.py's
(random weights, llm.c token file of random ids, seq 256, micro-batch 1 x 4 per step);
gpt2 is GPT-2 124M, memtune's `gpt2` preset with random weights (use --modes full).
QLoRA: NF4 base, LoRA r 16 on every projection. Full: every weight trained, fp32 AdamW.
Peak: the largest of memory_report.txt's forward, backward and optimizer peaks (the CPU
budget allocator's count; offloaded bytes are outside it, as on a GPU). tokens/s: median
over the steps after the first.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_peer import MODELS as PEER_MODELS, ROOT, built, cpu_name, llama_config, log, run, write_tokens  # noqa: E402

MODELS = dict(PEER_MODELS, gpt2=dict(layers=12, hidden=768, vocab=50257, seq=256, preset="gpt2"))

RUNGS = [
    ("micro-batch 1", {}),
    ("+ checkpoint every layer", {"training": {"gradient_checkpointing": True}}),
    ("+ activation offload", {"training": {"gradient_checkpointing": True, "activation_offload": "checkpoints"}}),
    # memory.on_oom.ladder's optimizer_8bit (only where listed: it changes the numerics), in
    # place of the optimizer offload after it: AdamW's state in bitsandbytes' 8-bit form on the device.
    ("+ 8-bit optimizer state", {"training": {"gradient_checkpointing": True, "activation_offload": "checkpoints",
                                              "optim": "adamw_8bit"}}),
    ("+ optimizer offload", {"training": {"gradient_checkpointing": True, "activation_offload": "checkpoints"},
                             "memory": {"optimizer_offload": "cpu"}}),
    ("+ layer offload", {"training": {"gradient_checkpointing": True, "activation_offload": "checkpoints"},
                         "memory": {"optimizer_offload": "cpu"}, "layers_offloaded": True}),
]


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def peak_of(report):
    peaks = []
    for line in open(report):
        if line.startswith("peak in"):
            value, unit = line.split(":", 1)[1].split()
            peaks.append(float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit])
    return max(peaks)


def train(args, mode, name, rung):
    m = MODELS[args.model]
    out = os.path.join(args.work, f"{mode}-{name}".replace(" ", "_").replace("+", "plus"))
    shutil.rmtree(out, ignore_errors=True)
    lora = mode == "qlora"
    cfg = {
        "model": {"name_or_path": args.model_dir,
                  "quantization_config": {"load_in_4bit": lora, "bnb_4bit_quant_type": "nf4",
                                          "bnb_4bit_compute_dtype": "float32"}},
        "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "training": {"output_dir": out, "finetune": "lora" if lora else "full", "per_device_train_batch_size": 1,
                     "gradient_accumulation_steps": 4, "max_steps": args.steps, "logging_steps": 1,
                     "save_steps": 0, "learning_rate": 1e-4},
        "data": {"train_file": args.tokens, "format": "tokens", "max_seq_length": m["seq"]},
        "memory": {"supervise": False, "on_oom": {"ladder": []}},
    }
    extra = dict(rung)
    if extra.pop("layers_offloaded", False):
        cfg["model"]["device_map"] = {"model.embed_tokens": "cpu", f"model.layers.0-{m['layers'] - 1}": "offload",
                                      "model.norm": "cpu", "lm_head": "cpu"}
    cfg = merge(cfg, extra)
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    run([args.memtune, "train", path])
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    tok_s = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
    return peak_of(os.path.join(out, "memory_report.txt")), tok_s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="M", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", default="qlora,full")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--work", default=os.path.join(ROOT, "build", "bench-ladder"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    (args.memtune,) = built(args.build, "memtune")
    os.makedirs(args.work, exist_ok=True)
    m = MODELS[args.model]
    if "preset" in m:
        args.model_dir = m["preset"]
    else:
        config = os.path.join(args.work, "config.json")
        with open(config, "w") as f:
            json.dump(llama_config(m), f)
        args.model_dir = os.path.join(args.work, "model")
        run([args.memtune, "init-model", "--config", config, "--out", args.model_dir, "--seed", "1"])
    args.tokens = os.path.join(args.work, "tokens.bin")
    write_tokens(args.tokens, m["vocab"], m["seq"] * 4 * (args.steps + 2) + 1, 7)

    cpu, avx512 = cpu_name()
    print(f"# ladder rungs, {args.model} model ({m['layers']} x {m['hidden']}), seq {m['seq']}, micro-batch 1 x 4, "
          f"{datetime.date.today()}, {cpu} ({'AVX-512' if avx512 else 'AVX2'}), {os.cpu_count()} CPUs")
    results = []
    for mode in args.modes.split(","):
        print(f"\n{mode}:\n| rung | peak (MiB) | vs micro-batch 1 | tokens/s | vs micro-batch 1 |\n|---|---|---|---|---|")
        first = None
        for name, rung in RUNGS:
            if rung.get("layers_offloaded") and (mode == "full" or "preset" in m):
                continue  # full: the offloaded layers' weights would be trained (refused); gpt2: Llama's module names
            log(f"{mode}: {name}")
            peak, tok_s = train(args, mode, name, rung)
            first = first or (peak, tok_s)
            print(f"| {name} | {peak / 2**20:.1f} | {peak / first[0]:.2f} | {tok_s:.0f} | {tok_s / first[1]:.2f} |",
                  flush=True)
            results.append({"mode": mode, "rung": name, "peak_bytes": peak, "tokens_per_s": tok_s})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "cpu": cpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
