#!/usr/bin/env python3
"""Optimizer options side by side: device bytes of optimizer state per trainable parameter,
the measured step memory, the loss after N steps and the speed.

    python3 bench/optim_bench.py [--steps N] [--config FILE] [--options A,B] [--runs DIR] [--json FILE]

Builds nothing: run `bash scripts/build.sh` first. For each training.optim it runs
`memtune estimate --json` (the "optimizer states" component over the trainable parameters)
and `memtune train` for N steps (default 150: the quickstart's full-training stage,
configs/quickstart-base.yaml, on the CPU), and prints the estimate, the allocated bytes the
budget allocator counts after a step, its peak, the mean loss of the last 10 steps, the last
loss and the median tokens/s. With --runs the runs' output_dirs are kept there (one per
option), and the `memtune report` command that draws the 8-bit and 32-bit curves side by
side is printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMTUNE = os.path.join(ROOT, "build", "memtune")
OPTIONS = ["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd"]


def estimate(config, optim):
    out = subprocess.run([MEMTUNE, "estimate", config, "--json", "training.optim=" + optim], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    j = json.loads(out[out.find("{"): out.rfind("}") + 1])
    states = next(c["bytes"] for c in j["components"] if c["name"] == "optimizer states")
    return states, j["trainable_parameters"]


def train(config, optim, steps, out_dir):
    subprocess.run([MEMTUNE, "train", config, "training.optim=" + optim, "training.max_steps=%d" % steps,
                    "training.logging_steps=1", "training.output_dir=" + out_dir], cwd=ROOT,
                   capture_output=True, text=True, check=True)
    rows = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                rows.append(r)
    mem = next(iter(rows[-1]["memory"].values()))
    return {
        "losses": [r["loss"] for r in rows],
        "allocated": mem["allocated"],
        "peak": max(next(iter(r["memory"].values()))["peak"] for r in rows),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", default="configs/quickstart-base.yaml")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--runs", help="keep each option's run in DIR/OPTION (default: a temporary directory)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.exists(MEMTUNE):
        sys.exit("build/memtune is missing: run bash scripts/build.sh")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = os.path.abspath(a.runs) if a.runs else tmp
        for optim in a.options.split(","):
            states, trainable = estimate(a.config, optim)
            r = train(a.config, optim, a.steps, os.path.join(runs, optim))
            r.update(estimated_state_bytes=states, trainable_parameters=trainable,
                     state_bytes_per_param=states / trainable)
            results[optim] = r
    base = results.get("adamw_torch")
    print(f"{a.config}, {a.steps} steps, CPU")
    print(f"{'optim':<18} {'state B/param':>13} {'allocated':>12} {'peak':>12} {'loss last10':>11} "
          f"{'last loss':>9} {'tok/s':>7} {'vs torch':>8}")
    for optim, r in results.items():
        last10 = statistics.mean(r["losses"][-10:])
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"{optim:<18} {r['state_bytes_per_param']:>13.3f} {r['allocated']:>12,} {r['peak']:>12,} "
              f"{last10:>11.4f} {r['losses'][-1]:>9.4f} {r['tokens_per_s']:>7.0f} {rel:>8}")
    if base and "adamw_8bit" in results:
        l32 = statistics.mean(base["losses"][-10:])
        l8 = statistics.mean(results["adamw_8bit"]["losses"][-10:])
        print(f"8-bit vs 32-bit: mean loss of the last 10 steps {l8:.4f} vs {l32:.4f} ({100 * (l8 - l32) / l32:+.2f} %)")
        if a.runs:
            print(f"curves side by side: {MEMTUNE} report {os.path.join(runs, 'adamw_8bit')} "
                  f"--compare {os.path.join(runs, 'adamw_torch')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "steps": a.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
