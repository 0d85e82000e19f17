#!/usr/bin/env python3
"""The smallest memory.device_limit at which a plain config still trains, the supervisor's
ladder doing the rest: GPT-2 124M full fine-tuning (memtune's `gpt2` preset, random weights,
seq 256) from a config that sets no saving (no checkpointing, no offload, the default
ladder), against the peak of the same config with no limit, in one run.

    python3 bench/ladder_floor.py [--steps 100] [--search-steps 2] [--json FILE]

1. The config with no limit: its peak (memory_report.txt's largest phase peak, the CPU
   budget allocator's count) and tokens/s. Also micro-batch 1 x 4 with no limit, the
   smallest peak a user gets without a saving.
2. Bisection over memory.device_limit (to --resolution bytes) with --search-steps steps a
   try: a limit passes when the run exits 0. The first step is where the ladder climbs
   (shrink, checkpointing, activation and optimizer offload), so short runs decide it.
3. The floor found, run for --steps steps: it must complete them; its rungs (metrics.jsonl
   events), peak and tokens/s are printed.

Builds nothing: run `bash scripts/build.sh` first.
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
from ladder_rungs import peak_of  # noqa: E402
from train_vs_peer import ROOT, built, cpu_name, log, write_tokens  # noqa: E402

SEQ, VOCAB = 256, 50257


def config(args, out, micro, accumulation, steps, limit):
    cfg = {
        "model": {"name_or_path": "gpt2"},
        "training": {"output_dir": out, "finetune": "full", "per_device_train_batch_size": micro,
                     "gradient_accumulation_steps": accumulation, "max_steps": steps, "logging_steps": 1,
                     "save_steps": 0, "learning_rate": 1e-4},
        "data": {"train_file": args.tokens, "format": "tokens", "max_seq_length": SEQ},
    }
    if limit:
        cfg["memory"] = {"device_limit": str(limit)}
    return cfg


def train(args, name, micro, accumulation, steps, limit=0):
    """(exit code, peak bytes, tokens/s, ladder events) of one run; peak 0 when it failed."""
    out = os.path.join(args.work, name)
    shutil.rmtree(out, ignore_errors=True)
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(config(args, out, micro, accumulation, steps, limit), f, indent=1)
    p = subprocess.run([args.memtune, "train", path], capture_output=True, text=True)
    if p.returncode != 0:
        return p.returncode, 0, 0, []
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    tok_s = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["tokens_per_s"]
    events = [f"step {e['step']}: {e['kind']}: {e['detail']}" for r in rows for e in r.get("events", [])
              if e["kind"] in ("ladder", "shrink", "grow", "grow_failed")]
    return 0, peak_of(os.path.join(out, "memory_report.txt")), tok_s, events


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="steps of the run at the floor")
    p.add_argument("--search-steps", type=int, default=2, help="steps of each bisection try")
    p.add_argument("--micro-batch", type=int, default=4, help="the plain config's per_device_train_batch_size")
    p.add_argument("--resolution", type=int, default=1 << 20, help="bisection stops at this many bytes")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--work", default=os.path.join(ROOT, "build", "bench-floor"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    (args.memtune,) = built(args.build, "memtune")
    os.makedirs(args.work, exist_ok=True)
    args.tokens = os.path.join(args.work, "tokens.bin")
    write_tokens(args.tokens, VOCAB, SEQ * args.micro_batch * (args.steps + 2) + 1, 7)

    cpu, avx512 = cpu_name()
    print(f"# ladder floor, GPT-2 124M full fine-tune, seq {SEQ}, plain config micro-batch {args.micro_batch} x 1, "
          f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {cpu} ({'AVX-512' if avx512 else 'AVX2'}), "
          f"{os.cpu_count()} CPUs", flush=True)
    log("no limit, the plain config")
    rc, free_peak, free_tok, _ = train(args, "free", args.micro_batch, 1, args.search_steps + 1)
    assert rc == 0, "the plain config without a limit failed"
    log("no limit, micro-batch 1")
    rc, mb1_peak, mb1_tok, _ = train(args, "free-mb1", 1, args.micro_batch, args.search_steps + 1)
    assert rc == 0, "micro-batch 1 without a limit failed"

    lo, hi = 0, int(free_peak)  # lo fails (or is untried), hi passes
    tries = []
    while hi - lo > args.resolution:
        mid = (lo + hi) // 2
        rc, peak, _, _ = train(args, "try", args.micro_batch, 1, args.search_steps, mid)
        tries.append({"limit": mid, "exit": rc, "peak_bytes": peak})
        log(f"limit {mid / 2**20:.1f} MiB: exit {rc}" + (f", peak {peak / 2**20:.1f} MiB" if rc == 0 else ""))
        lo, hi = (lo, mid) if rc == 0 else (mid, hi)
    log(f"floor {hi / 2**20:.1f} MiB: {args.steps} steps")
    rc, floor_peak, floor_tok, events = train(args, "floor", args.micro_batch, 1, args.steps, hi)

    print(f"\n| run | memory.device_limit (MiB) | peak (MiB) | vs no limit | tokens/s |\n|---|---|---|---|---|")
    print(f"| plain config ({args.micro_batch} x 1), no limit | none | {free_peak / 2**20:.1f} | 1.00 | {free_tok:.0f} |")
    print(f"| micro-batch 1 x {args.micro_batch}, no limit | none | {mb1_peak / 2**20:.1f} | "
          f"{mb1_peak / free_peak:.2f} | {mb1_tok:.0f} |")
    if rc == 0:
        print(f"| plain config at the floor, {args.steps} steps | {hi / 2**20:.1f} | {floor_peak / 2**20:.1f} | "
              f"{hi / free_peak:.2f} (limit) | {floor_tok:.0f} |")
    else:
        print(f"| plain config at the floor, {args.steps} steps | {hi / 2**20:.1f} | FAILED (exit {rc}) | | |")
    print(f"\nfloor: {hi} bytes; {lo} bytes failed within {args.search_steps} steps. "
          f"Limit / no-limit peak: {hi / free_peak:.3f} (vs micro-batch 1: {hi / mb1_peak:.3f})")
    print("the ladder at the floor:\n" + "\n".join("  " + e for e in events))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "avx512": avx512, "free_peak": free_peak, "free_tokens_per_s": free_tok,
                       "mb1_peak": mb1_peak, "mb1_tokens_per_s": mb1_tok, "floor_limit": hi, "floor_exit": rc,
                       "floor_peak": floor_peak, "floor_tokens_per_s": floor_tok, "floor_steps": args.steps,
                       "events": events, "tries": tries}, f, indent=1)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
