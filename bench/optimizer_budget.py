#!/usr/bin/env python3
"""The smallest device budget each optimizer option trains GPT-2 124M in, measured: a full
fine-tune at micro-batch 4 x 64 tokens (the supervisor off, so nothing else gives way),
`memory.device_limit` searched by bisection to 8 MiB for adamw_torch, adamw_8bit,
paged_adamw_8bit, adafactor and adamw_torch with memory.optimizer_offload: cpu; beside each,
the tokens/s of an unconstrained run of the same option against adamw_torch's, in one run.

    python3 bench/optimizer_budget.py [--steps N] [--speed-only] [--options A,B] [--json FILE]

--speed-only measures the tokens/s alone (a few minutes instead of most of an hour): for a
change that moves speed and not memory.

Builds nothing: run `bash scripts/build.sh` first. The model is memtune's `gpt2` preset
(random weights); the data an llm.c token file of random ids. A budget "trains" when
`memtune train` completes its steps under it (exit 0); anything else (exit 3: out of memory)
does not.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_peer import ROOT, built, cpu_name, log, write_tokens  # noqa: E402

OPTIONS = [
    ("adamw_torch", {}),
    ("adamw_8bit", {"training": {"optim": "adamw_8bit"}}),
    ("paged_adamw_8bit", {"training": {"optim": "paged_adamw_8bit"}}),
    ("adafactor", {"training": {"optim": "adafactor"}}),
    ("adamw_torch + optimizer_offload", {"memory": {"optimizer_offload": "cpu"}}),
]
MIB = 2**20


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def train(args, name, extra, steps, limit_mib=None):
    out = os.path.join(args.work, name.replace(" ", "_").replace("+", "plus") + (f"-{limit_mib}" if limit_mib else ""))
    shutil.rmtree(out, ignore_errors=True)
    cfg = {
        "model": {"name_or_path": "gpt2"},
        "training": {"output_dir": out, "finetune": "full", "optim": "adamw_torch", "per_device_train_batch_size": 4,
                     "gradient_accumulation_steps": 1, "max_steps": steps, "logging_steps": 1, "save_steps": 0,
                     "learning_rate": 1e-4},
        "data": {"train_file": args.tokens, "format": "tokens", "max_seq_length": 64},
        "memory": {"supervise": False},
    }
    if limit_mib:
        cfg["memory"]["device_limit"] = f"{limit_mib}MiB"
    cfg = merge(cfg, extra)
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    r = subprocess.run([args.memtune, "train", path], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    shutil.rmtree(out, ignore_errors=True)
    return statistics.median(x["tokens_per_s"] for x in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]


def smallest(args, name, extra):
    lo, hi = 256, 4096  # MiB: fails at lo (checked), trains at hi (checked)
    if train(args, name, extra, args.budget_steps, lo) is not None:
        return lo
    if train(args, name, extra, args.budget_steps, hi) is None:
        return None
    while hi - lo > 8:
        mid = (lo + hi) // 2
        ok = train(args, name, extra, args.budget_steps, mid) is not None
        log(f"{name}: {mid} MiB {'trains' if ok else 'does not'}")
        lo, hi = (lo, mid) if ok else (mid, hi)
    return hi


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="steps of the unconstrained runs (tokens/s)")
    p.add_argument("--budget-steps", type=int, default=2, help="steps of each run of the search")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--work", default=os.path.join(ROOT, "build", "bench-optimizer-budget"))
    p.add_argument("--speed-only", action="store_true", help="tokens/s only, no budget search")
    p.add_argument("--options", default=",".join(n for n, _ in OPTIONS),
                   help="comma-separated names from the list above (adamw_torch, the yardstick, always runs first)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    wanted = set(args.options.split(",")) | {"adamw_torch"}
    unknown = wanted - {n for n, _ in OPTIONS}
    if unknown:
        raise SystemExit(f"--options: unknown {', '.join(sorted(unknown))} (one of {', '.join(n for n, _ in OPTIONS)})")
    (args.memtune,) = built(args.build, "memtune")
    os.makedirs(args.work, exist_ok=True)
    args.tokens = os.path.join(args.work, "tokens.bin")
    write_tokens(args.tokens, 50257, 64 * 4 * (args.steps + 2) + 1, 7)
    cpu, avx512 = cpu_name()
    print(f"# GPT-2 124M full fine-tune, micro-batch 4 x 64, supervisor off; {datetime.datetime.utcnow():%Y-%m-%d %H:%M} "
          f"UTC, {cpu} ({'AVX-512' if avx512 else 'AVX2'}), {os.cpu_count()} CPUs")
    print("| optimizer | smallest device_limit (MiB) | vs adamw_torch | tokens/s | vs adamw_torch |\n|---|---|---|---|---|")
    results, first = [], None
    for name, extra in [o for o in OPTIONS if o[0] in wanted]:
        log(f"{name}: tokens/s")
        tok_s = train(args, name, extra, args.steps)
        budget = None
        if not args.speed_only:
            log(f"{name}: searching the budget")
            budget = smallest(args, name, extra)
        first = first or (budget, tok_s)
        shown = "-" if budget is None else budget
        ratio = "-" if budget is None or first[0] is None else f"{budget / first[0]:.2f}"
        print(f"| {name} | {shown} | {ratio} | {tok_s:.0f} | {tok_s / first[1]:.2f} |", flush=True)
        results.append({"optimizer": name, "smallest_device_limit_mib": budget, "tokens_per_s": tok_s})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
