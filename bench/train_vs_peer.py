#!/usr/bin/env python3
"""memtune's training speed and memory against the PyTorch eager peer, in one run.

    python3 bench/train_vs_peer.py [--models S,M,gpt2] [--repeat N] [--json FILE] [--work DIR]

Builds nothing: run `bash scripts/build.sh` first. For each model and mode it writes a
Hugging Face model (`memtune init-model --config`), a file of random token ids (llm.c's
format), a YAML config, runs `memtune train` under /usr/bin/time, and reads its
metrics.jsonl; then it runs ../shared/bench/peer_lora.py (Debian's python3-torch, the same
model and LoRA in PyTorch eager) on the same shapes, and bench_matmul_peak for this
machine's fp32 matmul peak. Figures: tokens/s (median over the steps after warm-up),
memtune's budget-allocator peak and both processes' peak RSS, model-FLOPs utilisation
against the measured peak, and the ratios the performance issue sets targets for. With
--repeat N the peer and memtune runs alternate N times and each figure is the median of
the N runs; the speed ratio is the median of the N per-repeat ratios (each memtune run over
the peer run just before it: shared machines drift, and neighbours in time share a phase),
its spread printed beside it.

Models (the issue's): S = 4 layers, hidden 256, 4 heads, intermediate 688, vocab 8000,
seq 256, micro-batch 4, accumulation 2; M = 12 / 768 / 12 / 2048 / 32000, seq 256,
micro-batch 2, accumulation 2; gpt2 = GPT-2 124M, full fine-tune at B=4, T=64, against
llm.c's CPU trainer (train_gpt2.c) run in the same session: with --llmc DIR (a checkout with
`make train_gpt2` built and ../shared/bench/make_llmc_inputs.py's files in it, as
../shared/bench/README.md says) memtune trains llm.c's own weights (llmc_to_hf.py) on its
token file with its settings (AdamW lr 1e-4 constant, no weight decay), the two runs
alternating; without it, memtune's figure alone. LoRA r 16, alpha 32 on
q,k,v,o,gate,up,down. With --dora, memtune's DoRA (lora.use_dora) on a dense and on an NF4
base too, rows dora and qdora: the peer has no DoRA, so their ratio is to memtune's own LoRA
(lora and qlora) in the same repeat, the price of the magnitudes.
"""
import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(os.path.dirname(ROOT), "shared", "bench", "peer_lora.py")
SHARED_BENCH = os.path.dirname(PEER)

MODELS = {
    "S": dict(layers=4, hidden=256, heads=4, intermediate=688, vocab=8000, seq=256, micro_batch=4, accum=2,
              steps=12, warmup=2),
    "M": dict(layers=12, hidden=768, heads=12, intermediate=2048, vocab=32000, seq=256, micro_batch=2, accum=2,
              steps=6, warmup=2),
}
TARGETS = [q + "_proj" for q in ("q", "k", "v", "o", "gate", "up", "down")]
LORA_R, LORA_ALPHA = 16, 32


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def cpu_name():
    """This machine's CPU for a figure's header: its model name and whether it has AVX-512."""
    info = open("/proc/cpuinfo").read()

    def field(key):
        return next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.split(":")[0].strip() == key), None)

    name = field("model name") or "unknown CPU"
    if field("cpu family"):  # the core's generation, which the model name of a VM may not say
        name += f" (family {field('cpu family')} model {field('model')})"
    return name, "avx512f" in info


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def built(build_dir, *names):
    """Paths of built programs under build_dir; stops with a hint when one is missing."""
    paths = [os.path.join(build_dir, n) for n in names]
    for f in paths:
        if not os.path.exists(f):
            raise SystemExit(f"{f} is missing: run `bash scripts/build.sh` first")
    return paths


def peak_rss_mib(stderr):
    for line in stderr.splitlines()[::-1]:
        if line.startswith("MAXRSS "):
            return int(line.split()[1]) / 1024.0
    return None


def llama_config(m):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m["hidden"],
        "intermediate_size": m["intermediate"], "num_hidden_layers": m["layers"],
        "num_attention_heads": m["heads"], "num_key_value_heads": m["heads"], "vocab_size": m["vocab"],
        "max_position_embeddings": max(2048, m["seq"]), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }


def write_tokens(path, vocab, count, seed):
    """llm.c's token file: 256 int32 header (magic, version, count), then uint16 ids."""
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *(rng.randrange(vocab) for _ in range(count))))


def flops_per_token(m, mode):
    """Model FLOPs of one trained token: the products the math needs, causal attention
    counted as half of T x T, nothing counted twice for recomputation (checkpointing)."""
    h, i, L, V, T = m["hidden"], m["intermediate"], m["layers"], m["vocab"], m["seq"]
    proj = [(h, h)] * 4 + [(h, i), (h, i), (i, h)]  # q k v o gate up down (in, out)
    linear = 2 * (L * sum(a * b for a, b in proj) + h * V)  # forward, head included
    attn = 2 * 2 * L * h * T / 2  # Q K^T and P V over the causal half
    lora = 2 * L * sum(LORA_R * (a + b) for a, b in proj)
    if mode == "full":  # backward: grad input and grad weight
        return 3 * linear + 3 * attn
    # frozen base: backward forms grad input only; the adapters get both
    return 2 * linear + 3 * attn + 3 * lora


def memtune_run(name, m, mode, ckpt, args, model_dir, tokens, training=None):
    out = os.path.join(args.work, f"run-{name}-{mode}-{ckpt}")
    shutil.rmtree(out, ignore_errors=True)
    cfg = {
        "model": {"name_or_path": model_dir, "torch_dtype": "float32"},
        "training": {
            "output_dir": out, "finetune": "full" if mode == "full" else "lora",
            "per_device_train_batch_size": m["micro_batch"], "gradient_accumulation_steps": m["accum"],
            "gradient_checkpointing": ckpt == "all", "learning_rate": 1e-3, "max_steps": m["steps"],
            "logging_steps": 1, "save_steps": 0, "weight_decay": 0.0, "warmup_steps": 0,
        },
        "data": {"train_file": tokens, "format": "tokens", "max_seq_length": m["seq"]},
    }
    cfg["training"].update(training or {})
    if mode != "full":
        cfg["lora"] = {"r": LORA_R, "lora_alpha": LORA_ALPHA, "target_modules": TARGETS,
                       "use_dora": mode in ("dora", "qdora")}
    if mode in ("qlora", "qdora"):
        cfg["model"]["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                               "bnb_4bit_use_double_quant": True,
                                               "bnb_4bit_compute_dtype": "float32"}
    path = out + ".yaml"
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)  # JSON is YAML
    p = run(["/usr/bin/time", "-f", "MAXRSS %M", args.memtune, "train", path])
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"tokens_per_s"' in l]
    timed = [r for r in rows if r["step"] > m["warmup"]]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "budget_peak_mib": max(r["memory"]["cpu"]["peak"] for r in rows) / 2**20,
        "peak_rss_mib": peak_rss_mib(p.stderr),
        "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
    }


def median_of(runs):
    """Each numeric figure's median over the runs (the first run's other fields), and each
    run's tokens/s in order (tokens_per_s_runs): which side an outlying pair came from."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in runs)
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return out


def peer_run(m, ckpt, env=None):
    cmd = ["/usr/bin/python3", PEER, "--layers", m["layers"], "--hidden", m["hidden"], "--heads", m["heads"],
           "--intermediate", m["intermediate"], "--vocab", m["vocab"], "--seq", m["seq"], "--micro-batch",
           m["micro_batch"], "--accum", m["accum"], "--steps", m["steps"], "--warmup", m["warmup"],
           "--checkpointing", ckpt, "--threads", os.cpu_count() or 1, "--lora-r", LORA_R,
           "--lora-alpha", LORA_ALPHA]
    out = json.loads(run([str(c) for c in cmd], env=env).stdout.strip().splitlines()[-1])
    return {"tokens_per_s": out["tokens_per_s"], "peak_rss_mib": out["peak_rss_mib"],
            "first_loss": out["first_loss"], "final_loss": out["final_loss"]}


def llmc_run(llmc):
    """llm.c's train_gpt2 for 10 steps through ../shared/bench/run_llmc.py (its JSON line)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    p = run(["/usr/bin/python3", os.path.join(SHARED_BENCH, "run_llmc.py"), "--llmc", llmc], env=env)
    return json.loads(p.stdout.strip().splitlines()[-1])


def uses_avx512(binary):
    """Whether a compiled program touches AVX-512's registers (llm.c built with -march=native on an
    AVX-512 CPU does; with -mno-avx512f it runs AVX2 as an AVX2-only machine would): None when
    objdump is missing."""
    if shutil.which("objdump") is None:
        return None
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True, text=True).stdout
    return "%zmm" in out


def gpt2_row(args):
    """GPT-2 124M full fine-tune at B=4, T=64: memtune against llm.c, alternating per repeat."""
    m = dict(layers=12, hidden=768, heads=12, intermediate=3072, vocab=50257, seq=64, micro_batch=4, accum=1,
             steps=10, warmup=2)
    model_dir = os.path.join(args.work, "model-gpt2")
    shutil.rmtree(model_dir, ignore_errors=True)
    extra = {}
    if args.llmc:
        train_bin = os.path.join(args.llmc, "train_gpt2")
        ckpt = os.path.join(args.llmc, "gpt2_124M.bin")
        tokens = os.path.join(args.llmc, "dev", "data", "tinyshakespeare", "tiny_shakespeare_train.bin")
        for f in (train_bin, ckpt, tokens):
            if not os.path.exists(f):
                raise SystemExit(f"{f} is missing: build llm.c and make its inputs as "
                                 f"{os.path.join(SHARED_BENCH, 'README.md')} says")
        # The same weights and tokens as llm.c, its optimizer settings: the same work.
        run(["/usr/bin/python3", os.path.join(SHARED_BENCH, "llmc_to_hf.py"), ckpt, model_dir])
        # llm.c trains without dropout; transformers' GPT-2 default (absent keys) is 0.1.
        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        hf_config.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=1)
        extra = {"learning_rate": 1e-4, "lr_scheduler_type": "constant"}
    else:
        run([args.memtune, "init-model", "--preset", "gpt2", "--out", model_dir, "--seed", "1"])
        tokens = os.path.join(args.work, "tokens-gpt2.bin")
        write_tokens(tokens, m["vocab"], m["seq"] * m["micro_batch"] * (m["steps"] + 2) + 1, 7)
    llmcs, runs = [], []
    for rep in range(args.repeat):
        if args.llmc:
            llmcs.append(llmc_run(args.llmc))
            log(f"gpt2 llm.c: {llmcs[-1]['tokens_per_s']:.1f} tok/s, {llmcs[-1]['peak_rss_mib']:.0f} MiB")
        runs.append(memtune_run("gpt2", m, "full", "none", args, model_dir, tokens, extra))
        log(f"gpt2 memtune: {runs[-1]['tokens_per_s']:.1f} tok/s, RSS {runs[-1]['peak_rss_mib']:.0f} MiB")
    r = median_of(runs)
    r.update(model="gpt2-124M", mode="full", checkpointing="none", runs=len(runs))
    if llmcs:
        pairs = [mt["tokens_per_s"] / lc["tokens_per_s"] for mt, lc in zip(runs, llmcs)]
        r.update(llm_c=median_of(llmcs), speed_vs_llm_c=statistics.median(pairs), speed_vs_llm_c_pairs=pairs,
                 llm_c_avx512=uses_avx512(os.path.join(args.llmc, "train_gpt2")))
        r["rss_vs_llm_c"] = r["peak_rss_mib"] / r["llm_c"]["peak_rss_mib"]
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="S,M,gpt2", help="comma-separated: S, M, gpt2")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--work", default=os.path.join(ROOT, "build", "bench-train"))
    p.add_argument("--repeat", type=int, default=1, help="alternating runs per figure (median)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--llmc", help="llm.c checkout with train_gpt2 built and its inputs made (the gpt2 yardstick)")
    p.add_argument("--dora", action="store_true", help="also DoRA on the dense and the NF4 base (rows dora, qdora)")
    args = p.parse_args()
    args.memtune, peak_bin = built(args.build, "memtune", "bench/bench_matmul_peak")
    have_peer = os.path.exists(PEER) and subprocess.run(["/usr/bin/python3", "-c", "import torch"],
                                                        capture_output=True).returncode == 0
    if not have_peer:
        log(f"peer not runnable ({PEER} or python3-torch missing): memtune's figures only")
    os.makedirs(args.work, exist_ok=True)

    peak = json.loads(run([peak_bin]).stdout.strip().splitlines()[-1])
    log(f"fp32 matmul peak: {peak['peak_gflops']} GFLOP/s ({peak['threads']} threads; ATen kernels "
        f"{peak.get('aten_cpu_capability')}, OpenBLAS core {peak.get('blas_core')}, memtune's "
        f"{peak.get('memtune_kernels')})")
    # The peer multiplies with the OpenBLAS kernels memtune runs: memtune sets OPENBLAS_CORETYPE
    # where OpenBLAS falls back to kernels narrower than the CPU's (runtime/threads.h
    # blas_core_for_cpu), and the peer's PyTorch loads the same OpenBLAS.
    peer_env = None
    if "OPENBLAS_CORETYPE" not in os.environ and peak.get("blas_core") not in (None, "not OpenBLAS"):
        peer_env = dict(os.environ, OPENBLAS_CORETYPE=peak["blas_core"])
    rows = []
    wanted = args.models.split(",")
    for name, m in MODELS.items():
        if name not in wanted:
            continue
        model_dir = os.path.join(args.work, f"model-{name}")
        with open(os.path.join(args.work, f"config-{name}.json"), "w") as f:
            json.dump(llama_config(m), f)
        run([args.memtune, "init-model", "--config", os.path.join(args.work, f"config-{name}.json"),
             "--out", model_dir, "--seed", "1"])
        tokens = os.path.join(args.work, f"tokens-{name}.bin")
        write_tokens(tokens, m["vocab"], m["seq"] * m["micro_batch"] * m["accum"] * (m["steps"] + 2) + 1, 7)
        modes = ["lora", "qlora"] + (["full"] if name == "S" else []) + (["dora", "qdora"] if args.dora else [])
        for ckpt in ("none", "all"):
            peers, runs = [], {mode: [] for mode in modes}
            for rep in range(args.repeat):
                if have_peer:
                    peers.append(peer_run(m, ckpt, peer_env))
                    log(f"{name} peer ckpt={ckpt}: {peers[-1]['tokens_per_s']:.0f} tok/s, "
                        f"{peers[-1]['peak_rss_mib']:.0f} MiB")
                for mode in modes:
                    runs[mode].append(memtune_run(name, m, mode, ckpt, args, model_dir, tokens))
                    log(f"{name} {mode} ckpt={ckpt}: {runs[mode][-1]['tokens_per_s']:.0f} tok/s, "
                        f"RSS {runs[mode][-1]['peak_rss_mib']:.0f} MiB")
            peer = median_of(peers) if peers else None
            for mode in modes:
                r = median_of(runs[mode])
                r.update(model=name, mode=mode, checkpointing=ckpt, runs=len(runs[mode]),
                         mfu=r["tokens_per_s"] * flops_per_token(m, mode) / (peak["peak_gflops"] * 1e9))
                if mode in ("dora", "qdora"):  # against memtune's LoRA on the same base, repeat by repeat
                    plain = runs["lora" if mode == "dora" else "qlora"]
                    r["speed_vs_lora_pairs"] = [d["tokens_per_s"] / p["tokens_per_s"] for d, p in zip(runs[mode], plain)]
                    r["speed_vs_lora"] = statistics.median(r["speed_vs_lora_pairs"])
                elif peer:
                    r["peer"] = peer
                    # The speed ratio of each repeat's adjacent pair (peer, then memtune), then
                    # their median: neighbours in time share the machine's phase, which drifts.
                    pairs = [mt["tokens_per_s"] / pr["tokens_per_s"] for mt, pr in zip(runs[mode], peers)]
                    r["speed_vs_peer"] = statistics.median(pairs)
                    r["speed_vs_peer_pairs"] = pairs
                    r["speed_vs_peer_of_medians"] = r["tokens_per_s"] / peer["tokens_per_s"]
                    r["rss_vs_peer"] = r["peak_rss_mib"] / peer["peak_rss_mib"]
                rows.append(r)

    if "gpt2" in wanted:
        rows.append(gpt2_row(args))

    cpu, avx512 = cpu_name()
    result = {
        "date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
        "cpu": cpu, "avx512": avx512, "aten_cpu_capability": peak.get("aten_cpu_capability"),
        "blas_core": peak.get("blas_core"), "memtune_kernels": peak.get("memtune_kernels"),
        "matmul_peak_gflops": peak["peak_gflops"], "matmul_shapes": peak["shapes"], "rows": rows,
    }
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


def print_table(res):
    print(f"memtune vs PyTorch eager peer, {res['date']}, {res['cpus']} CPUs, {res.get('cpu')} "
          f"({'with' if res.get('avx512') else 'without'} AVX-512; kernels: ATen {res.get('aten_cpu_capability')}, "
          f"OpenBLAS {res.get('blas_core')}, memtune {res.get('memtune_kernels')}), fp32 matmul peak "
          f"{res['matmul_peak_gflops']:.0f} GFLOP/s")
    print(f"{'model':<10}{'mode':<7}{'ckpt':<6}{'tok/s':>8}{'peer':>8}{'ratio':>7}{'pairs':>12}{'MFU':>6}"
          f"{'budget MiB':>11}{'RSS MiB':>9}{'peer RSS':>9}{'RSS ratio':>10}")
    for r in res["rows"]:
        peer = r.get("peer")
        if peer:
            ref, ratio, prss, rratio = (f"{peer['tokens_per_s']:.0f}", f"{r['speed_vs_peer']:.2f}",
                                        f"{peer['peak_rss_mib']:.0f}", f"{r['rss_vs_peer']:.2f}")
        elif "llm_c" in r:
            ref, ratio = f"{r['llm_c']['tokens_per_s']:.1f}", f"{r['speed_vs_llm_c']:.2f}"
            prss, rratio = f"{r['llm_c']['peak_rss_mib']:.0f}", f"{r['rss_vs_llm_c']:.2f}"
        elif "speed_vs_lora" in r:
            ref, ratio, prss, rratio = "LoRA", f"{r['speed_vs_lora']:.2f}", "-", "-"
        else:
            ref = ratio = prss = rratio = "-"
        mfu = f"{100 * r['mfu']:.0f}%" if "mfu" in r else "-"
        pairs = r.get("speed_vs_peer_pairs") or r.get("speed_vs_llm_c_pairs") or r.get("speed_vs_lora_pairs")
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
        print(f"{r['model']:<10}{r['mode']:<7}{r['checkpointing']:<6}{r['tokens_per_s']:>8.0f}{ref:>8}{ratio:>7}"
              f"{spread:>12}{mfu:>6}{r['budget_peak_mib']:>11.0f}{r['peak_rss_mib']:>9.0f}{prss:>9}{rratio:>10}")


if __name__ == "__main__":
    main()
