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
import shutil
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


def train(config, optim, steps, out_dir, extra=()):
    shutil.rmtree(out_dir, ignore_errors=True)  # each seed's run from scratch (memtune refuses another run's checkpoints)
    subprocess.run([MEMTUNE, "train", config, "training.optim=" + optim, "training.max_steps=%d" % steps,
                    "training.logging_steps=1", "training.output_dir=" + out_dir, *extra], cwd=ROOT,
                   capture_output=True, text=True, check=True)
    rows, evals = [], []
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                rows.append(r)
            if "eval_loss" in r:
                evals.append(r["eval_loss"])
    mem = next(iter(rows[-1]["memory"].values()))
    return {
        "losses": [r["loss"] for r in rows],
        "allocated": mem["allocated"],
        "peak": max(next(iter(r["memory"].values()))["peak"] for r in rows),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[1:]),
        "eval_loss": evals[-1] if evals else None,
    }


def held_out_split(config, k, tmp):
    """The config's data.train_file split into (train, eval) files under tmp: the last k documents held out."""
    import re
    with open(os.path.join(ROOT, config)) as f:
        m = re.search(r"^\s*train_file:\s*(\S+)", f.read(), re.M)
    if not m:
        sys.exit(f"--held-out: {config} names no data.train_file to split")
    with open(os.path.join(ROOT, m.group(1))) as f:
        docs = [line for line in f if line.strip()]
    if not 0 < k < len(docs):
        sys.exit(f"--held-out {k}: {m.group(1)} has {len(docs)} documents; hold out between 1 and {len(docs) - 1}")
    train_path, eval_path = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "eval.jsonl")
    with open(train_path, "w") as f:
        f.writelines(docs[:-k])
    with open(eval_path, "w") as f:
        f.writelines(docs[-k:])
    return train_path, eval_path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--config", default="configs/quickstart-base.yaml")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--runs", help="keep each option's run in DIR/OPTION (default: a temporary directory)")
    ap.add_argument("--held-out", type=int, default=0, metavar="K",
                    help="hold the train_file's last K documents out as data.eval_file, evaluated at the end")
    ap.add_argument("--seeds", type=int, default=1, help="runs per option, seeds 0..N-1, compared by their means")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not os.path.exists(MEMTUNE):
        sys.exit("build/memtune is missing: run bash scripts/build.sh")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = os.path.abspath(a.runs) if a.runs else tmp
        extra = []
        if a.held_out:
            train_path, eval_path = held_out_split(a.config, a.held_out, tmp)
            extra = ["data.train_file=" + train_path, "data.eval_file=" + eval_path, "training.eval_steps=%d" % a.steps]
        for optim in a.options.split(","):
            states, trainable = estimate(a.config, optim)
            seeds = []
            for seed in range(a.seeds):
                seeded = extra + (["model.init_seed=%d" % seed, "training.seed=%d" % seed] if a.seeds > 1 else [])
                name = optim if a.seeds == 1 else "%s-seed%d" % (optim, seed)
                seeds.append(train(a.config, optim, a.steps, os.path.join(runs, name), seeded))
            r = dict(seeds[0])
            if a.seeds > 1:  # the means over seeds; each seed's figures under "seeds"
                r["losses"] = [statistics.mean(l) for l in zip(*(x["losses"] for x in seeds))]
                r["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in seeds)
                if seeds[0]["eval_loss"] is not None:
                    r["eval_loss"] = statistics.mean(x["eval_loss"] for x in seeds)
                r["seeds"] = seeds
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
        e8, e32 = results["adamw_8bit"]["eval_loss"], base["eval_loss"]
        if e8 is not None and e32 is not None:
            print(f"8-bit vs 32-bit: held-out eval loss at the end {e8:.4f} vs {e32:.4f} ({100 * (e8 - e32) / e32:+.2f} %)")
        if a.seeds > 1:
            for optim in ("adamw_torch", "adamw_8bit"):
                per = results[optim]["seeds"]
                print(f"  {optim} per seed: last-10 loss " + ", ".join(f"{statistics.mean(x['losses'][-10:]):.4f}" for x in per) +
                      ("; eval " + ", ".join(f"{x['eval_loss']:.4f}" for x in per) if per[0]["eval_loss"] is not None else ""))
        if a.runs:
            print(f"curves side by side: {MEMTUNE} report {os.path.join(runs, 'adamw_8bit')} "
                  f"--compare {os.path.join(runs, 'adamw_torch')}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "steps": a.steps, "held_out": a.held_out, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
