#!/usr/bin/env python3
"""What the memory supervisor costs: the time to recover from an out-of-memory error, and
its overhead on a step that does not run out of memory.

    python3 bench/oom_recovery.py [--steps N] [--json FILE]

Builds nothing: run `bash scripts/build.sh` first. Trains the S model of
bench/train_vs_peer.py (QLoRA, micro-batch 4 x 2, seq 256) with `memtune train`, once
clean and once per phase with an out-of-memory error injected at step K
(memory.inject_oom K:forward, K:backward, K:optimizer; in forward and backward the
allocator throws on the first allocation of that phase, as the CUDA allocator would; the
CPU optimizer phase allocates nothing, so there the error is raised at its start). The supervisor halves the
micro-batch and runs the step's samples again. Recovery time = the duration of step K
less the median step after it (same samples per step, the new micro-batch): the work lost
in the failed attempt plus the clean-up. Overhead = bench_supervisor_overhead's
per-step cost of the supervisor and the memory sampling, against the clean run's median
step.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_vs_peer import MODELS, ROOT, built, llama_config, run, write_tokens  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def step_seconds(metrics_file):
    rows = [json.loads(l) for l in open(metrics_file) if '"tokens_per_s"' in l]
    return {r["step"]: r["tokens"] / r["tokens_per_s"] for r in rows}, rows


def train(args, name, inject):
    out = os.path.join(args.work, f"run-{name}")
    shutil.rmtree(out, ignore_errors=True)
    m = MODELS["S"]
    cfg = {
        "model": {"name_or_path": args.model, "quantization_config": {
            "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "float32"}},
        "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "training": {"output_dir": out, "per_device_train_batch_size": m["micro_batch"],
                     "gradient_accumulation_steps": m["accum"], "max_steps": args.steps, "logging_steps": 1,
                     "save_steps": 0, "learning_rate": 1e-3},
        "data": {"train_file": args.tokens, "format": "tokens", "max_seq_length": m["seq"]},
        "memory": {"inject_oom": inject} if inject else {},
    }
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    run([args.memtune, "train", path])
    return step_seconds(os.path.join(out, "metrics.jsonl"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--oom-step", type=int, default=6, help="the step (1-based) that runs out of memory")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--work", default=os.path.join(ROOT, "build", "bench-oom"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    args.memtune, overhead_bin = built(args.build, "memtune", "bench/bench_supervisor_overhead")
    os.makedirs(args.work, exist_ok=True)
    m = MODELS["S"]
    config = os.path.join(args.work, "config.json")
    with open(config, "w") as f:
        json.dump(llama_config(m), f)
    args.model = os.path.join(args.work, "model")
    run([args.memtune, "init-model", "--config", config, "--out", args.model, "--seed", "1"])
    args.tokens = os.path.join(args.work, "tokens.bin")
    write_tokens(args.tokens, m["vocab"], m["seq"] * m["micro_batch"] * m["accum"] * (args.steps + 2) + 1, 7)

    k = args.oom_step
    clean, clean_rows = train(args, "clean", "")
    clean_step = statistics.median(clean[s] for s in clean if s > 2)
    rows = []
    for phase in PHASES:
        times, metrics = train(args, phase, f"{k - 1}:{phase}")  # inject_oom counts steps from 0
        after = statistics.median(times[s] for s in times if s > k + 1)
        events = [e["kind"] for r in metrics if r["step"] == k for e in r.get("events", [])]
        micro = [r["micro_batch"] for r in metrics if r["step"] == k + 1]
        same_losses = all(abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]) for a, b in zip(metrics, clean_rows))
        rows.append({"phase": phase, "oom_step_s": times[k], "step_after_s": after,
                     "recovery_s": times[k] - after, "recovery_in_steps": (times[k] - after) / after,
                     "events": events, "micro_batch_after": micro[0] if micro else None,
                     "losses_match_clean_run": same_losses})

    overhead = json.loads(run([overhead_bin]).stdout.strip().splitlines()[-1])
    result = {
        "date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
        "clean_step_s": clean_step, "oom_step": k, "rows": rows,
        "supervisor_per_step_us": overhead["per_step_us"],
        "supervisor_overhead_pct": 100 * overhead["per_step_us"] * 1e-6 / clean_step,
    }
    print(f"S QLoRA, micro-batch {m['micro_batch']} x {m['accum']}, {m['seq']} tokens; "
          f"clean step {1000 * clean_step:.0f} ms (median), {result['date']}, {result['cpus']} CPUs")
    print(f"{'OOM in':<10}{'step K ms':>10}{'after ms':>10}{'recovery ms':>12}{'in steps':>9}  micro after  losses = clean")
    for r in rows:
        print(f"{r['phase']:<10}{1000 * r['oom_step_s']:>10.0f}{1000 * r['step_after_s']:>10.0f}"
              f"{1000 * r['recovery_s']:>12.0f}{r['recovery_in_steps']:>9.2f}  {r['micro_batch_after']!s:>11}  "
              f"{r['losses_match_clean_run']}")
    print(f"supervisor overhead on a step without OOM: {overhead['per_step_us']:.1f} us per step = "
          f"{result['supervisor_overhead_pct']:.4f} % of the clean step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
