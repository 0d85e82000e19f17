"""memtune against the real Hugging Face transformers (scripts/interop_check.sh runs this).

memtune runs here; transformers runs inside the Debian unstable root (judge.py, one
process fed one JSON request per line). Both see the same work directory. Every check
prints one row: group, name, memtune's figure, transformers' figure, PASS/FAIL. The exit
status is 1 when any check fails.

Only the standard library: this runs on the host's python3.
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys

LOSS_RTOL = 1e-5  # fp32 on both sides; differences seen are ~1e-7 (summation order)
BF16_LOSS_RTOL = 1e-3  # bf16 on both sides: transformers' own eager and SDPA attention differ by up to 5e-4
VOCAB = 1024      # examples/tiny-tokenizer has 1019 ids + 5 specials
EOS = 1020
ROWS, SEQ = 6, 32

# Tiny configs of each family memtune supports, as Hugging Face config.json fields. Small
# sliding window and nonzero biases, so a feature that is dropped changes the loss.
BASE_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1019, eos_token_id=EOS,
                  tie_word_embeddings=False)
FAMILIES = {
    "llama": BASE_LLAMA,
    "llama-bias": dict(BASE_LLAMA, attention_bias=True, mlp_bias=True),
    "llama-tied": dict(BASE_LLAMA, tie_word_embeddings=True),
    "llama-rope-linear": dict(BASE_LLAMA, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama-rope-llama3": dict(BASE_LLAMA, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "llama-rope-yarn": dict(BASE_LLAMA, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # dynamic (NTK) within max_position_embeddings (longer sequences: refused, see model_refusals)
    "llama-rope-dynamic": dict(BASE_LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    "mistral": dict(BASE_LLAMA, model_type="mistral", sliding_window=8),
    "qwen2": dict(BASE_LLAMA, model_type="qwen2", use_sliding_window=False, tie_word_embeddings=True),
    # Qwen3: q and k norms per head, heads of 32 over a hidden of 64 (q_proj widens), biases on
    # q, k, v and o.
    "qwen3": dict(BASE_LLAMA, model_type="qwen3", head_dim=32, attention_bias=True, use_sliding_window=False,
                  tie_word_embeddings=True),
    # Gemma: (1 + weight) norms, sqrt(hidden)-scaled embeddings, GeGLU, heads of 32 over a hidden
    # of 64. Gemma 3 adds q and k norms, four norms a layer, a sliding layer (window 4) with its own
    # rotary base beside a full one with linear scaling, and an attention scale of 24^-0.5.
    "gemma": dict(BASE_LLAMA, model_type="gemma", head_dim=32, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma3": dict(BASE_LLAMA, model_type="gemma3_text", head_dim=32, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=24, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=20000.0,
                   tie_word_embeddings=True),
    # Gemma 2: Gemma 3's layer without q and k norms and with one rotary base, and tanh
    # soft-capping of the attention scores and the logits, at caps that bend a tiny model's (1
    # and 2: Google's 50 and 30 would barely touch them). transformers' SDPA drops the attention
    # cap, so the judge loads soft-capped models with eager attention (judge.py load_model).
    "gemma2": dict(BASE_LLAMA, model_type="gemma2", head_dim=32, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=24, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                   attn_logit_softcapping=1.0, final_logit_softcapping=2.0, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                 bos_token_id=1019, eos_token_id=EOS),
}
# Checkpoints transformers writes: dtype on disk and sharding (max_shard_size).
SAVES = {
    "llama": [("fp32", None), ("fp16", None), ("bf16", None), ("fp32", "100KB"), ("bf16", "100KB")],
    "gpt2": [("fp32", None), ("fp16", None), ("bf16", "100KB")],
    "qwen2": [("fp32", None), ("bf16", "100KB")],
    "qwen3": [("fp32", None), ("bf16", "100KB")],
    "gemma2": [("fp32", None), ("bf16", "100KB")],
    "gemma3": [("fp32", None), ("bf16", "100KB")],
}
PROMPT = "The old lighthouse keeper"
# llm_int8_skip_modules: module names and pattern lists whose matching transformers' own
# should_convert_module decides; the answers are the table memtune's unit test reads
# (tests/models/skip_modules_test.cpp). INTEROP_WRITE_SKIP_TABLE=1 rewrites it.
SKIP_TABLE = os.path.join("tests", "reference", "transformers_skip_modules.json")
SKIP_NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj",
              "model.layers.10.mlp.down_proj", "model.layers.11.mlp.gate_proj", "model.layers.2.mlp.up_proj",
              "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "transformer.h.10.attn.c_proj",
              "lm_head"]
SKIP_PATTERNS = [["lm_head"], ["mlp"], ["down_proj"], ["proj"], ["model.layers.1"], ["model.layers.1."],
                 ["model.layers.1.mlp"], [r"model\.layers\.1\."], ["layers.1"], ["self_attn"], [".*attn.*"],
                 [r".*\.mlp\..*"], ["model.layers.[0-2].mlp"], ["^model.layers.2"], [""], ["transformer.h.1"],
                 ["h.1.mlp.c_proj"], ["c_proj"], ["attn.c_attn"], ["lm_head", "down_proj", "model.layers.0"],
                 ["q_proj$"], ["model.layers.1[01]"], [r"(model|transformer)\.(layers|h)\.0\."],
                 ["model.layers.1.mlp.down_proj"], ["LM_HEAD"], ["head"], [], ["model.layers.1|transformer"]]
# Per family (12 layers, so "model.layers.1" also reaches layers 10 and 11): the lists `memtune
# quantize --llm-int8-skip-modules` is judged with (None: the key unset).
SKIP_RUNS = {
    "llama": [None, ["lm_head", "mlp"], ["lm_head", "down_proj"], ["lm_head", "model.layers.1"],
              ["lm_head", "model.layers.1."], ["lm_head", ".*self_attn.*"],
              ["lm_head", "model.layers.0.mlp", "model.layers.11.self_attn.q_proj"]],
    "gpt2": [None, ["lm_head", "c_attn"], ["lm_head", "transformer.h.1"], ["lm_head", "transformer.h.0.mlp"]],
    "qwen3": [None, ["lm_head", "o_proj", "model.layers.2"]],
}


class Report:
    def __init__(self):
        self.rows = []

    def add(self, group, name, memtune, hf, ok, note=""):
        """ok: True PASS, False FAIL, None SKIP (a judge this machine lacks; not a failure)."""
        self.rows.append((group, name, str(memtune), str(hf), "SKIP" if ok is None else "PASS" if ok else "FAIL", note))
        g, n, _, _, v, _ = self.rows[-1]
        print(f"  {v} {g}: {n}", flush=True)  # progress; the table follows at the end

    def table(self):
        w = [max(len(r[i]) for r in self.rows) for i in range(5)]
        head = ("group", "check", "memtune", "transformers", "result")
        w = [max(w[i], len(head[i])) for i in range(5)]
        line = lambda r: "  ".join(r[i].ljust(w[i]) for i in range(5)) + (f"  {r[5]}" if len(r) > 5 and r[5] else "")
        out = [line(head), "  ".join("-" * x for x in w)] + [line(r) for r in self.rows]
        fails = sum(r[4] == "FAIL" for r in self.rows)
        skips = sum(r[4] == "SKIP" for r in self.rows)
        out.append(f"\n{len(self.rows)} checks, {len(self.rows) - fails - skips} PASS, {fails} FAIL"
                   + (f", {skips} SKIP" if skips else ""))
        return "\n".join(out), fails


class Judge:
    def __init__(self, root, work_in_root, judge_in_root):
        env = ["/usr/bin/env", "-i", "HOME=/root", "LANG=C.UTF-8", "PATH=/usr/bin:/bin",
               "HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "HF_HUB_DISABLE_PROGRESS_BARS=1"]
        self.p = subprocess.Popen(["chroot", root] + env + ["python3", judge_in_root, work_in_root],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, op, **kw):
        self.p.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the judge (transformers) exited")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait()


class Memtune:
    def __init__(self, binary, work):
        self.binary, self.work = binary, work

    def run(self, *args, check=True):
        r = subprocess.run([self.binary, *args], cwd=self.work, capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
        if check and r.returncode != 0:
            raise RuntimeError(f"memtune {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-600:]}")
        return r

    def eval(self, model, adapter=None, dtype="fp32"):
        args = ["eval", "--model", model, "--data", "rows.bin", "--format", "tokens",
                "--max-seq-length", str(SEQ), "--batch", str(ROWS), "--json", "--dtype", dtype]
        if adapter:
            args += ["--adapter", adapter]
        return json.loads(self.run(*args).stdout.strip().splitlines()[-1])

    def generate(self, model, n=16, adapter=None, dtype="fp32"):
        args = ["generate", "--model", model, "--prompt", PROMPT, "--greedy", "--max-new-tokens", str(n),
                "--dtype", dtype]
        if adapter:
            args += ["--adapter", adapter]
        return self.run(*args).stdout.rstrip("\n")


def normal(v):
    """A default as one string: numbers by value (5e-05 and 5e-5 alike), booleans lower case."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(float(v))
    s = str(v)
    try:
        return repr(float(s))
    except ValueError:
        return s


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def write_rows(work):
    """ROWS documents of SEQ tokens, each ending with eos: memtune's tokens format packs them
    into rows of SEQ with SEQ-1 targets each, exactly transformers' labels=input_ids loss."""
    rng = random.Random(20261124)
    rows = [[rng.randrange(0, 1019) for _ in range(SEQ - 1)] + [EOS] for _ in range(ROWS)]
    flat = [t for r in rows for t in r]
    header = struct.pack("<256i", 20240520, 1, len(flat), *([0] * 253))
    with open(os.path.join(work, "rows.bin"), "wb") as f:
        f.write(header + struct.pack(f"<{len(flat)}H", *flat))
    return rows


class Check:
    def __init__(self, args):
        self.work = args.work
        self.src = args.src
        self.mt = Memtune(args.memtune, args.work)
        self.judge = Judge(args.root, args.work_in_root, args.judge_in_root)
        self.report = Report()
        self.tokenizer = os.path.join(args.src, "examples", "tiny-tokenizer")
        self.rows = write_rows(args.work)
        self.families = set(args.families) or set(FAMILIES)

    def path(self, p):
        return os.path.join(self.work, p)

    def with_tokenizer(self, d):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(self.tokenizer, f), self.path(d))

    def guarded(self, group, name, fn, family=None):
        if family is not None and family not in self.families:
            return
        try:
            fn()
        except Exception as e:  # a crash on either side is a failed check, with its message
            self.report.add(group, name, "error", "-", False, str(e).splitlines()[0][:300] if str(e) else repr(e))

    def loss_and_greedy(self, group, label, model, adapter=None, judge_model=None, judge_adapter=None,
                        dtype="fp32", rtol=None):
        """memtune eval / generate on `model` (+ adapter) against transformers on judge_model, both
        loading the model in `dtype`; returns the two evaluations."""
        m = self.mt.eval(model, adapter, dtype)
        h = self.judge("loss", model=judge_model or model, rows=self.rows, adapter=judge_adapter, dtype=dtype)
        if not h["ok"]:
            raise RuntimeError(h["error"])
        d = rel(m["loss"], h["loss"])
        self.report.add(group, f"{label}: loss", f"{m['loss']:.9f}", f"{h['loss']:.9f}",
                        d < (rtol or LOSS_RTOL) and m["tokens"] == h["tokens"], f"rel {d:.1e}, {m['tokens']} tokens")
        mt_text = self.mt.generate(model, adapter=adapter, dtype=dtype)
        g = self.judge("generate", model=judge_model or model, prompt=PROMPT, n=16, adapter=judge_adapter,
                       dtype=dtype)
        if not g["ok"]:
            raise RuntimeError(g["error"])
        same = mt_text == g["text"]
        first = next((i for i, (a, b) in enumerate(zip(mt_text, g["text"])) if a != b),
                     min(len(mt_text), len(g["text"])))
        ok, note = same, "" if same else f"memtune {mt_text!r} / transformers {g['text']!r}"
        if not same and dtype != "fp32":
            # In 16 bits the logits are rounded to a few bits: where transformers' own lead of its
            # token at the step the texts part is within one rounding of its top logit, either
            # choice is greedy's up to that rounding.
            step = max(i for i, p in enumerate(g["prefixes"]) if mt_text.startswith(p))
            top, lead = g["tops"][step], g["margins"][step]
            ulp = 2.0 ** (math.floor(math.log2(abs(top))) - (7 if dtype == "bf16" else 10)) if top else 0.0
            ok = lead <= ulp
            note = (f"token {step}: transformers' lead {lead:.2e} {'<=' if ok else '>'} one {dtype} rounding of its "
                    f"top logit {top:.3f} ({ulp:.2e}); " + note)
        self.report.add(group, f"{label}: greedy 16 tokens", "same text" if same else f"differs at char {first}",
                        f"margin {g['min_margin']:.1e}", ok, note)
        return m, h

    def same_loss(self, group, label, mine, judged, note=""):
        """A check that memtune's loss equals the judge's reply's (fp32)."""
        d = rel(mine, judged["loss"]) if judged["ok"] else float("inf")
        self.report.add(group, label, f"{mine:.9f}", f"{judged.get('loss', float('nan')):.9f}", d < LOSS_RTOL,
                        f"rel {d:.1e}{note}" if judged["ok"] else judged["error"][:200])

    def adapter_changes(self, group, label, base, loss):
        """A check that the adapter moved memtune's loss off the base's (so the others can fail)."""
        b = self.mt.eval(base)
        self.report.add(group, f"{label}: the adapter changes the loss", f"{b['loss']:.6f} -> {loss:.6f}",
                        "-", abs(b["loss"] - loss) > 1e-3, "base vs base+adapter")

    def hf_config(self, family):
        """config.json as transformers writes it (the judge makes a model; only its config is used)."""
        d = f"cfg-{family}"
        r = self.judge("make_model", config=FAMILIES[family], out=d, dtype="fp32", shard=None)
        if not r["ok"]:
            raise RuntimeError(r["error"])
        return d

    # 1. Models memtune writes, read by transformers.
    def memtune_writes(self, family):
        group, out = "mt->hf", f"mt-{family}"

        def run():
            cfg = self.hf_config(family)
            self.mt.run("init-model", "--config", os.path.join(cfg, "config.json"), "--out", out,
                        "--seed", "7", "--tokenizer", self.tokenizer)
            info = self.judge("load", model=out)
            if not info["ok"]:
                raise RuntimeError(info["error"])
            bad = info["missing"] + info["unexpected"] + info["mismatched"]
            self.report.add(group, f"{family}: transformers loads init-model", "written",
                            info["class"], not bad, f"missing/unexpected/mismatched: {bad}" if bad else "no missing keys")
            self.loss_and_greedy(group, family, out)
        self.guarded(group, family, run, family)

    # 2. Models transformers writes, read by memtune.
    def hf_writes(self, family, dtype, shard):
        group = "hf->mt"
        label = f"{family} {dtype}{' sharded' if shard else ''}"
        out = f"hf-{family}-{dtype}{'-sharded' if shard else ''}"

        def run():
            r = self.judge("make_model", config=FAMILIES[family], out=out, dtype=dtype, shard=shard, seed=3)
            if not r["ok"]:
                raise RuntimeError(r["error"])
            if shard and not any(f.endswith(".index.json") for f in r["files"]):
                raise RuntimeError(f"transformers wrote no shards: {r['files']}")
            self.with_tokenizer(out)
            self.loss_and_greedy(group, label, out)
        self.guarded(group, label, run, family)

    # 2b. Models loaded in bf16 on both sides (from_pretrained(dtype=torch.bfloat16), memtune
    # --dtype bf16 / model.torch_dtype: bfloat16): every dense tensor and activation in bf16.
    # transformers' CPU attention is SDPA's kernel, memtune's its own blocked one: the two
    # round differently inside, so the loss compares at bf16's precision.
    def bf16_models(self, family):
        group, label = "bf16", f"{family} bf16"

        def run():
            model = f"hf-{family}-fp32"
            m, h = self.loss_and_greedy(group, label, model, dtype="bf16", rtol=BF16_LOSS_RTOL)
            # bf16 really ran: memtune's bf16 loss is not its fp32 one (the tolerance above would
            # let an fp32 run pass; an fp32 run is memtune's own fp32 loss to the last bit, so 1e-6
            # apart is bf16's: Gemma 2's, logits capped at 2, was 7e-6 from fp32); beside it, how far transformers' own eager attention lands
            # from its SDPA in bf16, the scale of what the two backends' roundings can differ by.
            m16, m32 = m["loss"], self.mt.eval(model)["loss"]
            he = self.judge("loss", model=model, rows=self.rows, dtype="bf16", attn="eager")
            if not he["ok"]:
                raise RuntimeError(he["error"])
            self.report.add(group, f"{label}: not the fp32 loss", f"rel {rel(m16, m32):.1e} from fp32", "-",
                            rel(m16, m32) > 1e-6,
                            f"transformers bf16 eager vs sdpa: rel {rel(he['loss'], h['loss']):.1e}; memtune bf16 vs "
                            f"eager {rel(m16, he['loss']):.1e}")
        self.guarded(group, label, run, family)

    # 2c. llm_int8_skip_modules: the modules transformers' bitsandbytes integration leaves dense.
    def skip_modules(self):
        group = "skip"

        def table():
            h = self.judge("should_convert", names=SKIP_NAMES, patterns=SKIP_PATTERNS)
            if not h["ok"]:
                raise RuntimeError(h["error"])
            v = self.judge("versions")
            fresh = {"source": f"transformers {v['transformers']}: quantizers_utils.should_convert_module "
                               "(scripts/interop/check.py, group skip)",
                     "names": SKIP_NAMES,
                     "cases": [{"patterns": p, "dense": [not c for c in conv]}
                               for p, conv in zip(SKIP_PATTERNS, h["convert"])]}
            path = os.path.join(self.src, SKIP_TABLE)
            if os.environ.get("INTEROP_WRITE_SKIP_TABLE") == "1":
                with open(path, "w") as f:
                    json.dump(fresh, f, indent=1)
                    f.write("\n")
            committed = json.load(open(path))
            differ = [c["patterns"] for c, f in zip(committed["cases"], fresh["cases"]) if c != f]
            same = committed["names"] == fresh["names"] and len(committed["cases"]) == len(fresh["cases"]) and not differ
            n = len(SKIP_NAMES) * len(SKIP_PATTERNS)
            self.report.add(group, "should_convert_module: the unit test's table", f"{n} answers committed",
                            f"{n} answers", same, f"lists that differ: {differ}" if differ else SKIP_TABLE)
        self.guarded(group, "table", table)

        for family, lists in SKIP_RUNS.items():
            cfg = dict(FAMILIES[family], **({"n_layer": 12} if family == "gpt2" else {"num_hidden_layers": 12}))
            base = f"skip-{family}"
            r = self.judge("make_model", config=cfg, out=base, dtype="fp32", shard=None, seed=5)
            if not r["ok"]:
                self.report.add(group, f"{family}: model", "-", "error", False, r["error"][:300])
                continue
            for k, skip in enumerate(lists):
                label = f"{family} {json.dumps(skip)}"

                def run(skip=skip, out=f"{base}-q{k}"):
                    args = ["quantize", "--model", base, "--out", out]
                    if skip is not None:
                        args += ["--llm-int8-skip-modules", ",".join(skip)]
                    self.mt.run(*args)
                    names = safetensors_names(self.path(os.path.join(out, "model.safetensors")))
                    suffix = ".weight.quant_state.bitsandbytes__nf4"
                    mt = sorted(n[:-len(suffix)] for n in names if n.endswith(suffix))
                    h = self.judge("bnb_targets", config=cfg, skip=skip)
                    if not h["ok"]:
                        raise RuntimeError(h["error"])
                    written = json.load(open(self.path(os.path.join(out, "config.json"))))["quantization_config"]
                    again = self.judge("bnb_targets", config=cfg, skip=written["llm_int8_skip_modules"])
                    dense = len(h["converted"]) - len(mt) if set(mt) <= set(h["converted"]) else "?"
                    self.report.add(group, f"{label}: projections quantized", f"{len(mt)}", f"{len(h['converted'])}",
                                    mt == h["converted"] and again.get("converted") == mt,
                                    f"config.json's list reads back the same: {again.get('converted') == mt}"
                                    if mt == h["converted"] else
                                    f"memtune only: {sorted(set(mt) - set(h['converted']))}; transformers only: "
                                    f"{sorted(set(h['converted']) - set(mt))}")
                self.guarded(group, label, run)

        def refusal():
            skip = ["mlp"]
            out = self.mt.run("quantize", "--model", "skip-llama", "--out", "skip-llama-refused",
                              "--llm-int8-skip-modules", ",".join(skip), check=False)
            h = self.judge("bnb_targets", config=dict(FAMILIES["llama"], num_hidden_layers=12), skip=skip)
            quantizes_head = h.get("ok") and "lm_head" in h["converted"]
            self.report.add(group, "a list without lm_head: refused", f"exit {out.returncode}",
                            "quantizes lm_head" if quantizes_head else "keeps lm_head dense",
                            out.returncode == 2 and quantizes_head and not os.path.exists(self.path("skip-llama-refused")),
                            out.stderr.strip().splitlines()[-1][:200] if out.stderr.strip() else "")
        self.guarded(group, "refusal", refusal)

    def train_adapter(self, name, base, lora, quantized=False, extra=()):
        """memtune trains an adapter (r 4, 6 steps) on `base`; returns its directory."""
        out = f"run-{name}"
        cfg = {
            "model": {"name_or_path": base, "quantization_config": {"load_in_4bit": quantized}},
            "lora": dict({"r": 4, "lora_alpha": 8}, **lora),
            "training": {"output_dir": out, "max_steps": 6, "learning_rate": 2e-2,
                         "per_device_train_batch_size": 2, "logging_steps": 6, "warmup_steps": 0,
                         "lr_scheduler_type": "constant", "max_grad_norm": 0},
            "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ},
        }
        with open(self.path(f"{name}.yaml"), "w") as f:
            json.dump(cfg, f, indent=1)  # JSON is YAML
        self.mt.run("train", f"{name}.yaml", *extra)
        return f"{out}/adapter"

    # 3. Adapters memtune trains, merged by memtune, judged by transformers.
    def adapters(self, name, family, lora, quantized=False, extra=()):
        group = "adapter"
        base = f"hf-{family}-fp32"
        out = f"run-{name}"

        def run():
            adapter = self.train_adapter(name, base, lora, quantized, extra)
            conf = json.load(open(self.path(f"{adapter}/adapter_config.json")))
            sel = self.judge("adapter_config", adapter=adapter, model=base)
            names = sorted(self._adapter_modules(adapter))
            if sel["ok"]:
                ok = sorted(sel["selected"]) == names
                self.report.add(group, f"{name}: PEFT's target matching", f"{len(names)} modules adapted",
                                f"{len(sel['selected'])} selected", ok,
                                f"target_modules {json.dumps(conf['target_modules'])[:60]}")
            else:
                self.report.add(group, f"{name}: PEFT's target matching", f"{len(names)} modules adapted",
                                "refused", False, sel["error"][:200])
            # The adapter file read as PEFT lays it out, merged by hand into transformers' model.
            self.loss_and_greedy(group, f"{name}: eval --adapter vs PEFT-layout merge", base, adapter=adapter,
                                 judge_model=base, judge_adapter=adapter)
            merged = f"{out}/merged"
            self.mt.run("merge", "--model", base, "--adapter", adapter, "--out", merged)
            info = self.judge("load", model=merged)
            bad = info.get("missing", []) + info.get("unexpected", []) if info["ok"] else [info["error"]]
            self.report.add(group, f"{name}: transformers loads the merge", "merged", info.get("class", "-"),
                            not bad, str(bad)[:200] if bad else "no missing keys")
            m = self.mt.eval(base, adapter)
            h = self.judge("loss", model=merged, rows=self.rows)
            self.same_loss(group, f"{name}: eval --adapter vs merged in HF", m["loss"], h)
            # memtune writing a bf16 checkpoint: the merge in bf16, read by both.
            m16 = f"{out}/merged-bf16"
            self.mt.run("merge", "--model", base, "--adapter", adapter, "--out", m16, "--dtype", "bf16")
            self.same_loss(group, f"{name}: merge --dtype bf16, eval vs HF", self.mt.eval(m16)["loss"],
                           self.judge("loss", model=m16, rows=self.rows))
            self.adapter_changes(group, name, base, m["loss"])
        self.guarded(group, name, run, family)

    # 3b. A full fine-tune: the model memtune writes, read by transformers.
    def full_finetune(self, name, family):
        group, base, out = "full", f"hf-{family}-fp32", f"run-{name}"

        def run():
            cfg = {"model": {"name_or_path": base},
                   "training": {"output_dir": out, "finetune": "full", "max_steps": 4, "learning_rate": 1e-3,
                                "per_device_train_batch_size": 2, "logging_steps": 4, "max_grad_norm": 0},
                   "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}
            with open(self.path(f"{name}.yaml"), "w") as f:
                json.dump(cfg, f)
            self.mt.run("train", f"{name}.yaml")
            model = f"{out}/model"
            self.with_tokenizer(model)
            info = self.judge("load", model=model)
            bad = info.get("missing", []) + info.get("unexpected", []) if info["ok"] else [info["error"]]
            self.report.add(group, f"{name}: transformers loads the model", "written", info.get("class", "-"),
                            not bad, str(bad)[:200] if bad else "no missing keys")
            self.loss_and_greedy(group, name, model)
            b, m = self.mt.eval(base), self.mt.eval(model)
            self.report.add(group, f"{name}: training changed the model", f"{b['loss']:.6f} -> {m['loss']:.6f}",
                            "-", abs(b["loss"] - m["loss"]) > 1e-3, "base vs trained")
        self.guarded(group, name, run)

    def _adapter_modules(self, adapter):
        with open(self.path(f"{adapter}/adapter_model.safetensors"), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        mods = set()
        for k in header:
            m = re.fullmatch(r"base_model\.model\.(.+)\.lora_[AB](?:\.default)?\.weight", k)
            if m:
                mods.add(m.group(1))
        return mods

    # 3c. PEFT itself: adapters PEFT makes, read by memtune; adapters memtune trains, read by PEFT.
    def peft(self):
        group = "peft"
        v = self.judge("peft_version")
        if not v["ok"]:
            self.report.add(group, "PEFT itself", "-", "absent", None,
                            "no PEFT source: set MEMTUNE_PEFT_SRC (a directory holding peft/) or MEMTUNE_PEFT_GIT")
            return
        print(f"judge: peft {v['version']}", flush=True)

        def compare(label, base, adapter):
            """memtune eval --adapter and memtune merge against PEFT's forward and PEFT's merge."""
            m = self.mt.eval(base, adapter)
            h = self.judge("peft_loss", model=base, adapter=adapter, rows=self.rows)
            if not h["ok"]:
                raise RuntimeError(h["error"])
            loaded = not h["unloaded"] and not h["differ"]
            self.report.add(group, f"{label}: PEFT loads every tensor", f"{h['tensors']} tensors",
                            "all loaded" if loaded else "not all", loaded,
                            f"not in PEFT's state: {h['unloaded']}; other values: {h['differ']}" if not loaded else "")
            d = rel(m["loss"], h["loss"])
            self.report.add(group, f"{label}: eval --adapter vs PEFT's forward", f"{m['loss']:.9f}",
                            f"{h['loss']:.9f}", d < LOSS_RTOL and m["tokens"] == h["tokens"], f"rel {d:.1e}")
            merged = f"{adapter}-merged"
            shutil.rmtree(self.path(merged), ignore_errors=True)
            self.mt.run("merge", "--model", base, "--adapter", adapter, "--out", merged)
            mm = self.judge("loss", model=merged, rows=self.rows)
            if not mm["ok"]:
                raise RuntimeError(mm["error"])
            self.same_loss(group, f"{label}: memtune merge vs PEFT's merge_and_unload", mm["loss"],
                           {"ok": True, "loss": h["merged_loss"]}, " (both read by transformers)")
            self.adapter_changes(group, label, base, m["loss"])

        # PEFT makes the adapter (B drawn, DoRA's magnitudes off their start); memtune reads it.
        made = [
            ("llama LoRA all-linear", "llama", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
            ("llama DoRA", "llama", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                                     "use_dora": True}),
            ("llama-bias DoRA all-linear", "llama-bias", {"r": 4, "lora_alpha": 16, "target_modules": "all-linear",
                                                          "use_dora": True}),
            ("gpt2 DoRA rslora", "gpt2", {"r": 8, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"],
                                          "fan_in_fan_out": True, "use_dora": True, "use_rslora": True}),
            ("qwen3 DoRA all-linear", "qwen3", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                                                "use_dora": True}),
            # Per-module ranks and alphas; layer 1's v_proj named before the bare v_proj (order decides).
            ("llama rank/alpha patterns", "llama", {
                "r": 4, "lora_alpha": 8, "target_modules": "all-linear",
                "rank_pattern": {"model.layers.1.self_attn.v_proj": 3, "v_proj": 2, "down_proj": 8},
                "alpha_pattern": {"q_proj": 16, r"layers\.0\.mlp\..*": 4}}),
            ("gpt2 DoRA rank pattern", "gpt2", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_fc"],
                                                "fan_in_fan_out": True, "use_dora": True,
                                                "rank_pattern": {"c_fc": 6}, "alpha_pattern": {"c_attn": 12}}),
            # bias: the base biases trained beside the adapters (all: the LayerNorms' too).
            ("gpt2 bias all", "gpt2", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"],
                                       "fan_in_fan_out": True, "bias": "all"}),
            ("llama-bias bias lora_only", "llama-bias", {"r": 4, "lora_alpha": 8,
                                                         "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"],
                                                         "bias": "lora_only"}),
        ]
        for k, (label, family, config) in enumerate(made):
            def run(label=label, family=family, config=config, seed=k):
                base, d = f"hf-{family}-fp32", "peft-made-" + re.sub(r"\W+", "-", label)
                shutil.rmtree(self.path(d), ignore_errors=True)
                r = self.judge("peft_make", model=base, config=config, seed=100 + seed, out=d)
                if not r["ok"]:
                    raise RuntimeError(r["error"])
                compare(f"PEFT made {label}", base, d)
            self.guarded(group, f"PEFT made {label}", run)
        # memtune trains the adapter; PEFT reads it.
        trained = [
            ("dora-llama", "llama", {"target_modules": "all-linear", "use_dora": True}, False),
            ("qdora-qwen3", "qwen3", {"target_modules": "all-linear", "use_dora": True}, True),
            ("dora-gpt2-dropout", "gpt2", {"target_modules": "all-linear", "use_dora": True, "lora_dropout": 0.1}, False),
            ("lora-mistral", "mistral", {"target_modules": ["q_proj", "v_proj"]}, False),
            # lora.rank_pattern / alpha_pattern in the training config, in an order that sorting
            # would change: the bare v_proj first decides layer 1's v_proj too (sorted, the layer-1
            # pattern would come first and give it rank 3).
            ("rank-patterns-llama", "llama", {
                "target_modules": "all-linear",
                "rank_pattern": {"v_proj": 2, r"layers\.1\.self_attn\.(q|v)_proj": 3, "down_proj": 8},
                "alpha_pattern": {"q_proj": 16, r"layers\.0\.mlp\..*": 4}}, False),
            ("rank-patterns-qdora-qwen3", "qwen3", {"target_modules": "all-linear", "use_dora": True,
                                                   "rank_pattern": {"k_proj": 8, "gate_proj": 2}}, True),
            ("bias-all-gpt2", "gpt2", {"target_modules": ["c_attn", "c_fc"], "bias": "all"}, False),
            ("modules-to-save-llama", "llama", {"target_modules": ["q_proj", "v_proj"],
                                                "modules_to_save": ["lm_head", "model.norm"]}, False),
            ("bias-lora-only-qlora-llama-bias", "llama-bias", {"target_modules": "all-linear", "bias": "lora_only"}, True),
            ("bias-all-dora-llama-bias", "llama-bias", {"target_modules": ["q_proj", "v_proj"], "use_dora": True,
                                                        "bias": "all"}, False),
        ]
        for name, family, lora, quantized in trained:
            def run(name=name, family=family, lora=lora, quantized=quantized):
                base = f"hf-{family}-fp32"
                compare(f"memtune trained {name}", base, self.train_adapter(f"peft-{name}", base, lora, quantized))
                if quantized:  # PEFT's judge has no bitsandbytes: its model would be dense
                    return
                # The log's "trainable params: ... || all params: ..." as PEFT prints them.
                log = open(self.path(f"run-peft-{name}/train.log")).read()
                m = re.search(r"trainable params: ([\d,]+) \|\| all params: ([\d,]+)", log)
                h = self.judge("peft_count", model=base, config=dict({"r": 4, "lora_alpha": 8}, **lora))
                if not h["ok"]:
                    raise RuntimeError(h["error"])
                mine = (int(m.group(1).replace(",", "")), int(m.group(2).replace(",", ""))) if m else None
                self.report.add(group, f"memtune trained {name}: trainable / all parameters as PEFT counts",
                                f"{mine[0]:,} / {mine[1]:,}" if mine else "no line", f"{h['trainable']:,} / {h['all']:,}",
                                mine == (h["trainable"], h["all"]), "")
            self.guarded(group, f"memtune trained {name}", run)

    # 4. What memtune refuses: by name, exit status 2, never silently dropped.
    def refused(self, name, args, must_name, group="refusal"):
        r = self.mt.run(*args, check=False)
        text = (r.stderr + r.stdout).strip()
        msg = next((l for l in text.splitlines() if must_name in l), text.splitlines()[-1] if text else "")
        msg = re.sub(r"^\S+ \S+ [EW] ", "", msg)
        ok = r.returncode == 2 and must_name in text
        self.report.add(group, name, f"exit {r.returncode}", f"names '{must_name}'", ok, msg[:160])

    def adapter_refusals(self):
        src = "run-lora-llama/adapter"
        if not os.path.isdir(self.path(src)):
            self.report.add("refusal", "PEFT adapters", "no adapter", "-", False, "the LoRA run failed")
            return

        def variant(label, conf_edit=None, tensor=None):
            d = f"peft-{label}"
            shutil.rmtree(self.path(d), ignore_errors=True)
            shutil.copytree(self.path(src), self.path(d))
            conf = json.load(open(self.path(f"{d}/adapter_config.json")))
            if conf_edit:
                conf.update(conf_edit)
            json.dump(conf, open(self.path(f"{d}/adapter_config.json"), "w"), indent=2)
            if tensor:
                add_tensor(self.path(f"{d}/adapter_model.safetensors"), *tensor)
            return d
        base = "hf-llama-fp32"
        cases = [
            ("modules_to_save without its tensor", {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
            ("lm_head.modules_to_save.default.weight", None, ("base_model.model.lm_head.modules_to_save.default.weight",
                                                [VOCAB, 64]), "modules_to_save"),
            ("LoRA on embed_tokens (target_modules)", {"target_modules": ["q_proj", "embed_tokens"]}, None,
             "embed_tokens"),
            ("a lora_embedding_A tensor", None, ("base_model.model.model.embed_tokens.lora_embedding_A", [4, VOCAB]),
             "lora_embedding"),
            ("lora_bias: true", {"lora_bias": True}, None, "lora_bias"),
            ("a lora_B.bias tensor", None, ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", [64]),
             "lora_B"),
            ("use_dora: true without magnitudes", {"use_dora": True}, None, "lora_magnitude_vector"),
            ("rank_pattern disagreeing with the tensors", {"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
        ]
        for label, edit, tensor, key in cases:
            d = variant(re.sub(r"\W+", "-", label), edit, tensor)
            self.refused(f"PEFT {label}", ["eval", "--model", base, "--adapter", d, "--data", "rows.bin",
                                           "--format", "tokens", "--max-seq-length", str(SEQ)], key)

    def config_refusals(self):
        with open(self.path("refuse.yaml"), "w") as f:
            json.dump({"model": {"name_or_path": "hf-llama-fp32"},
                       "training": {"output_dir": "run-refused", "max_steps": 1},
                       "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}, f)
        for override, key in [("lora.modules_to_save=[q_proj]", "projection"),
                              ("lora.modules_to_save=[norm]", "inside decoder layer"),
                              ("model.torch_dtype=bfloat16", "torch_dtype"),
                              ("model.low_cpu_mem_usage=false", "low_cpu_mem_usage"),
                              ("model.quantization_config.llm_int8_enable_fp32_cpu_offload=true",
                               "llm_int8_enable_fp32_cpu_offload")]:
            self.refused(f"config {override}", ["train", "refuse.yaml", override], key)

    def tied_refusal(self):
        with open(self.path("refuse-tied.yaml"), "w") as f:
            json.dump({"model": {"name_or_path": "hf-qwen2-fp32"},
                       "lora": {"modules_to_save": ["lm_head"]},
                       "training": {"output_dir": "run-refused", "max_steps": 1},
                       "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}, f)
        self.refused("config lora.modules_to_save=[lm_head], tied", ["train", "refuse-tied.yaml"],
                     "tie_word_embeddings")

    def model_refusals(self):
        cases = [
            ("rope_scaling dynamic past max_position_embeddings",
             dict(BASE_LLAMA, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
             "rope_scaling dynamic"),
            ("rope_scaling longrope", dict(BASE_LLAMA, rope_scaling={
                "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64}), "longrope"),
            ("llama hidden_act gelu", dict(BASE_LLAMA, hidden_act="gelu"), "hidden_act"),
            ("llama hidden_act gelu_pytorch_tanh", dict(BASE_LLAMA, hidden_act="gelu_pytorch_tanh"), "hidden_act"),
            ("gpt2 activation_function gelu", dict(FAMILIES["gpt2"], activation_function="gelu"),
             "activation_function"),
            ("qwen2 use_sliding_window", dict(FAMILIES["qwen2"], use_sliding_window=True, sliding_window=8,
                                              max_window_layers=1), "use_sliding_window"),
            ("qwen3 use_sliding_window", dict(FAMILIES["qwen3"], use_sliding_window=True, sliding_window=8,
                                              max_window_layers=1), "use_sliding_window"),
            # With the window off transformers has none to give the layers that layer_types
            # names sliding, and its forward fails.
            ("qwen3 layer_types sliding", dict(FAMILIES["qwen3"], layer_types=["full_attention", "sliding_attention"]),
             "layer_types"),
            ("gpt2 scale_attn_by_inverse_layer_idx", dict(FAMILIES["gpt2"], scale_attn_by_inverse_layer_idx=True),
             "scale_attn_by_inverse_layer_idx"),
        ]
        for label, config, key in cases:
            d = "hf-refused-" + re.sub(r"\W+", "-", label)
            r = self.judge("make_model", config=config, out=d, dtype="fp32", shard=None)
            if not r["ok"]:
                self.report.add("refusal", f"model {label}", "-", "error", False, r["error"][:200])
                continue
            self.refused(f"model {label}", ["eval", "--model", d, "--data", "rows.bin", "--format", "tokens",
                                            "--max-seq-length", str(SEQ)], key)
            if "dynamic" in label:
                s = self.judge("dynamic_state", model=d, short=self.rows[0][:12], long=self.rows[0] + self.rows[1])
                if s["ok"]:
                    self.report.add("refusal", "why: transformers' dynamic is stateful", "-",
                                    f"{s['before']:.7f} -> {s['after']:.7f}", s["before"] != s["after"],
                                    "a 12-token row's loss before / after one 64-token forward")
                with open(self.path("refuse-dynamic.yaml"), "w") as f:
                    json.dump({"model": {"name_or_path": d}, "training": {"output_dir": "run-refused", "max_steps": 1},
                               "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}, f)
                self.refused("train, dynamic, max_seq_length past it", ["train", "refuse-dynamic.yaml"],
                             "max_position_embeddings")
        # Dropout on the attention probabilities: transformers applies it in training and so does
        # memtune (keyed masks, runtime/keyed_dropout.h); a transformers-made model with it trains.
        d = "hf-attention-dropout"
        r = self.judge("make_model", config=dict(BASE_LLAMA, attention_dropout=0.1), out=d, dtype="fp32", shard=None)
        if not r["ok"]:
            self.report.add("train", "llama attention_dropout 0.1", "-", "error", False, r["error"][:200])
            return
        with open(self.path("attention-dropout.yaml"), "w") as f:
            json.dump({"model": {"name_or_path": d}, "training": {"output_dir": "run-attention-dropout", "max_steps": 1},
                       "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}, f)
        r = self.mt.run("train", "attention-dropout.yaml", check=False)
        text = r.stderr + r.stdout
        applied = "dropout in training, from config.json: attention_dropout 0.1" in text
        self.report.add("train", "llama attention_dropout 0.1", f"exit {r.returncode}", "applied",
                        r.returncode == 0 and applied, "the log names it" if applied else text.strip()[-160:])

    # transformers' IntervalStrategy keys: the steps memtune logs, evaluates and checkpoints at,
    # against the Trainer's own DefaultFlowCallback over the same steps and epochs. The 6 rows
    # make 3 steps an epoch at 2 per step, 6 at 1. Each case sets eval_strategy: left unset,
    # memtune evaluates its eval data before and after training, where transformers' "no"
    # evaluates nothing (memtune's eval_strategy: no refuses eval data instead).
    INTERVALS = [
        ("epoch strategies, 2.5 epochs", {"logging_strategy": "epoch", "save_strategy": "epoch",
                                          "eval_strategy": "epoch"}, 2, 2.5, -1),
        ("steps: eval_steps unset, save_steps 4", {"logging_steps": 3, "save_steps": 4, "eval_strategy": "steps"},
         2, 2, -1),
        ("shares of max_steps, save no", {"logging_steps": 0.5, "eval_steps": 0.25, "eval_strategy": "steps",
                                          "save_strategy": "no"}, 1, 3, 8),
        ("steps not dividing the run", {"logging_steps": 5, "eval_steps": 4, "eval_strategy": "steps"}, 2, 2, -1),
        ("logging_first_step, epoch logging", {"logging_first_step": True, "logging_strategy": "epoch",
                                               "eval_strategy": "steps", "eval_steps": 2}, 2, 2, -1),
    ]

    def interval_strategies(self):
        for label, keys, batch, epochs, max_steps in self.INTERVALS:
            def run(label=label, keys=keys, batch=batch, epochs=epochs, max_steps=max_steps):
                out = "run-interval-" + re.sub(r"\W+", "-", label)
                shutil.rmtree(self.path(out), ignore_errors=True)
                with open(self.path(out + ".yaml"), "w") as f:
                    json.dump({"model": {"name_or_path": "hf-llama-fp32"},
                               "training": dict(keys, output_dir=out, per_device_train_batch_size=batch,
                                                num_train_epochs=epochs, max_steps=max_steps, warmup_steps=0),
                               "data": {"train_file": "rows.bin", "eval_file": "rows.bin", "format": "tokens",
                                        "max_seq_length": SEQ, "pack_sequences": False}}, f)
                self.mt.run("train", out + ".yaml")
                rows = [json.loads(line) for line in open(self.path(out + "/metrics.jsonl"))]
                mine = {"log": [m["step"] for m in rows if "loss" in m],
                        "evaluate": [m["step"] for m in rows if "eval_loss" in m and m.get("when") != "before training"],
                        "save": sorted(int(n[5:]) for n in os.listdir(self.path(out + "/checkpoints"))
                                       if n.startswith("step-")) if os.path.isdir(self.path(out + "/checkpoints")) else []}
                mine["evaluate"] = sorted(set(mine["evaluate"]))  # a periodic and the final one at the last step
                per_epoch = -(-ROWS // batch)
                total = max_steps if max_steps > 0 else math.ceil(epochs * per_epoch)
                hf_args = {k: v for k, v in keys.items()}
                hf = self.judge("interval_schedule", args=hf_args, total=total, per_epoch=per_epoch)
                for what in ("log", "evaluate", "save"):
                    ok = mine[what] == hf[what]
                    note = ""
                    # memtune also logs the last step (its progress line's end); transformers' last row is
                    # its train summary instead.
                    if what == "log" and not ok and mine[what] == sorted(set(hf[what]) | {total}):
                        ok, note = True, f"and the last step, {total}, as memtune always logs it"
                    self.report.add("intervals", f"{label}: {what} at steps", str(mine[what]), str(hf[what]), ok,
                                    note)
            self.guarded("intervals", label, run)

    # lr_scheduler_type and lr_scheduler_kwargs: the learning rate of each of memtune's steps
    # (metrics.jsonl) against transformers' get_scheduler over the same steps.
    SCHEDULES = [("linear", {}), ("cosine", {"num_cycles": 1.25}), ("cosine_with_restarts", {"num_cycles": 2}),
                 ("polynomial", {"lr_end": 1e-5, "power": 3.0}), ("inverse_sqrt", {}),
                 ("cosine_with_min_lr", {"min_lr": 3e-5}), ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.2}),
                 ("warmup_stable_decay", {"num_decay_steps": 4, "decay_type": "1-sqrt", "min_lr_ratio": 0.1}),
                 ("warmup_stable_decay", {"num_decay_steps": 3, "num_stable_steps": 2, "warmup_type": "cosine"})]

    def schedules(self):
        total, warmup, lr = 9, 2, 3e-4
        for i, (name, kwargs) in enumerate(self.SCHEDULES):
            def run(name=name, kwargs=kwargs, i=i):
                out = f"run-schedule-{i}-{name}"
                shutil.rmtree(self.path(out), ignore_errors=True)
                with open(self.path(out + ".yaml"), "w") as f:
                    json.dump({"model": {"name_or_path": "hf-llama-fp32"},
                               "training": {"output_dir": out, "per_device_train_batch_size": 1, "max_steps": total,
                                            "warmup_steps": warmup, "learning_rate": lr, "lr_scheduler_type": name,
                                            "lr_scheduler_kwargs": kwargs},
                               "data": {"train_file": "rows.bin", "format": "tokens", "max_seq_length": SEQ}}, f)
                self.mt.run("train", out + ".yaml")
                mine = [json.loads(line)["lr"] for line in open(self.path(out + "/metrics.jsonl"))
                        if '"loss"' in line]
                hf = self.judge("schedule_lrs", name=name, lr=lr, warmup=warmup, total=total, kwargs=kwargs)["lrs"]
                worst = max((rel(a, b) for a, b in zip(mine, hf)), default=0.0)
                self.report.add("schedules", f"{name} {json.dumps(kwargs)}: lr of {total} steps",
                                f"{len(mine)} steps", f"{len(hf)} steps", len(mine) == len(hf) and mine == hf,
                                "bit for bit" if mine == hf else f"max rel {worst:.1e}")
            self.guarded("schedules", name, run)
        # reduce_lr_on_plateau: stepped by each evaluation's eval_loss (every step here), the
        # rates against torch's ReduceLROnPlateau fed memtune's own eval losses.
        for kwargs in ({"patience": 0, "factor": 0.5, "threshold": 0.02}, {"mode": "max", "patience": 1, "cooldown": 1,
                                                                        "threshold_mode": "abs", "min_lr": 1e-4}):
            def run(kwargs=kwargs):
                out = f"run-schedule-plateau-{len(kwargs)}"
                shutil.rmtree(self.path(out), ignore_errors=True)
                with open(self.path(out + ".yaml"), "w") as f:
                    json.dump({"model": {"name_or_path": "hf-llama-fp32"},
                               "training": {"output_dir": out, "per_device_train_batch_size": 1, "max_steps": total,
                                            "learning_rate": lr, "lr_scheduler_type": "reduce_lr_on_plateau",
                                            "lr_scheduler_kwargs": kwargs, "eval_steps": 1},
                               "data": {"train_file": "rows.bin", "eval_file": "rows.bin", "format": "tokens",
                                        "max_seq_length": SEQ}}, f)
                self.mt.run("train", out + ".yaml")
                rows = [json.loads(line) for line in open(self.path(out + "/metrics.jsonl"))]
                mine = [m["lr"] for m in rows if "loss" in m]
                evals = [m["eval_loss"] for m in rows if m.get("when") == "periodic"]
                hf = self.judge("plateau_lrs", lr=lr, total=total, kwargs=kwargs, eval_losses=evals)["lrs"]
                cuts = sum(1 for a, b in zip(hf, hf[1:]) if b < a)
                self.report.add("schedules", f"reduce_lr_on_plateau {json.dumps(kwargs)}: lr of {total} steps",
                                f"{len(mine)} steps", f"{len(hf)} steps, {cuts} cuts",
                                len(mine) == len(hf) and mine == hf and cuts > 0,
                                "bit for bit" if mine == hf else f"mine {mine} torch {hf}")
            self.guarded("schedules", "reduce_lr_on_plateau", run)

    # label_smoothing_factor: memtune's first step's loss (every row in one micro-batch, before
    # any update) and its eval loss before training, against transformers' LabelSmoother. The
    # gradients' smoothing is tests/models/cross_entropy_test.cpp's (against ATen's).
    def label_smoothing(self):
        for eps in (0.1, 0.3):
            def run(eps=eps):
                out = f"run-label-smoothing-{eps}"
                shutil.rmtree(self.path(out), ignore_errors=True)
                with open(self.path(out + ".yaml"), "w") as f:
                    json.dump({"model": {"name_or_path": "hf-llama-fp32"},
                               "training": {"output_dir": out, "per_device_train_batch_size": ROWS,
                                            "per_device_eval_batch_size": 2, "max_steps": 1,
                                            "label_smoothing_factor": eps},
                               "data": {"train_file": "rows.bin", "eval_file": "rows.bin", "format": "tokens",
                                        "max_seq_length": SEQ}}, f)
                self.mt.run("train", out + ".yaml")
                rows = [json.loads(line) for line in open(self.path(out + "/metrics.jsonl"))]
                step = next(m["loss"] for m in rows if "loss" in m)
                before = next(m["eval_loss"] for m in rows if m.get("when") == "before training")
                hf = self.judge("label_smoothed_loss", model="hf-llama-fp32", rows=self.rows, epsilon=eps)["loss"]
                plain = self.judge("loss", model="hf-llama-fp32", rows=self.rows)["loss"]
                for what, mine in (("first step's loss", step), ("eval loss before training", before)):
                    self.report.add("train", f"label_smoothing_factor {eps}: {what}", f"{mine:.9f}", f"{hf:.9f}",
                                    rel(mine, hf) < 1e-6 and rel(hf, plain) > 10 * max(rel(mine, hf), 1e-7),
                                    f"rel {rel(mine, hf):.1e}; smoothing moves it by {rel(hf, plain):.1e} "
                                    f"(the random model's logits are nearly flat)")
            self.guarded("train", f"label_smoothing_factor {eps}", run)

    def tokenizer_check(self):
        def run():
            texts = ["The tired traveler counted a map of the northern coast, 42 times!",
                     "  Leading spaces,\ttabs\nand new lines  ", "Ünïcödé — naïve café, 東京, emoji 🙂",
                     "<|im_start|>user\nSort: cezada<|im_end|>"]
            d = "hf-llama-fp32"
            for i, text in enumerate(texts):
                with open(self.path("tok.jsonl"), "w") as f:
                    f.write(json.dumps(text) + "\n")
                r = self.mt.run("tokenize", "--tokenizer", d, "--input", "tok.jsonl", "--add-special-tokens")
                m = [int(x) for x in re.findall(r"-?\d+", r.stdout)]
                h = self.judge("tokenize", model=d, text=text)
                self.report.add("tokenizer", f"tiny-tokenizer ids, text {i + 1}", f"{len(m)} ids",
                                f"{len(h['ids'])} ids", m == h["ids"], "" if m == h["ids"] else f"{m} vs {h['ids']}")
        self.guarded("tokenizer", "ids", run)

    # Keys whose default memtune takes from transformers (TrainingArguments) and bitsandbytes
    # (BitsAndBytesConfig(load_in_4bit=True)), and the pairs of defaults that are one setting
    # under two spellings. logging_steps and save_steps are memtune's own (its help says so).
    DEFAULT_KEYS = {
        "training": ["learning_rate", "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_steps",
                     "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "seed", "fp16",
                     "bf16", "gradient_checkpointing", "per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "optim", "save_total_limit"],
        "quantization_config": ["load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype",
                                "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage", "llm_int8_threshold",
                                "llm_int8_has_fp16_weight", "llm_int8_skip_modules",
                                "llm_int8_enable_fp32_cpu_offload", "quant_method"],
    }
    SAME_SETTING = {("adamw_torch", "adamw_torch_fused"),  # one update; transformers 5 defaults to fused
                    ("0.0", "None"),                       # save_total_limit: keep every checkpoint
                    ("null", "None")}                      # llm_int8_skip_modules: unset

    def defaults(self):
        def run():
            text = self.mt.run("train", "--help-config").stdout
            ours = {}
            for section, keys in self.DEFAULT_KEYS.items():
                prefix = "model.quantization_config." if section == "quantization_config" else "training."
                for k in keys:
                    m = re.search(r"^\s*" + re.escape(prefix + k) + r" \(.*default: ([^)]*)\)\s*$", text, re.M)
                    ours[(section, k)] = m.group(1) if m else None
            theirs = self.judge("defaults", keys=self.DEFAULT_KEYS)
            for (section, k), mine in ours.items():
                hf = theirs[section][k]
                pair = (normal(mine), normal(hf))
                same = mine is not None and (pair[0] == pair[1] or pair in self.SAME_SETTING)
                self.report.add("defaults", f"{section}.{k}", mine, hf, same,
                                "" if same else "a config that leaves the key out trains differently")
        self.guarded("defaults", "TrainingArguments and BitsAndBytesConfig", run)

    def run(self, only):
        v = self.judge("versions")
        print(f"judge: transformers {v['transformers']}, torch {v['torch']}, tokenizers {v['tokenizers']}, "
              f"safetensors {v['safetensors']}", flush=True)
        want = lambda g: not only or g in only
        if want("defaults"):
            self.defaults()
        if want("mt->hf"):
            for family in FAMILIES:
                self.memtune_writes(family)
        if want("hf->mt") or want("adapter") or want("refusal") or want("tokenizer") or want("full") or want("bf16") \
                or want("peft") or want("intervals") or want("schedules") or want("train"):
            for family in FAMILIES:
                for dtype, shard in SAVES.get(family, [("fp32", None)]):
                    if want("hf->mt") or (dtype, shard) == ("fp32", None):
                        self.hf_writes(family, dtype, shard)
        if want("bf16"):
            for family in ("llama", "gpt2", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3"):
                self.bf16_models(family)
        if want("tokenizer"):
            self.tokenizer_check()
        if want("intervals"):
            self.interval_strategies()
        if want("schedules"):
            self.schedules()
        if want("train"):
            self.label_smoothing()
        if want("skip"):
            self.skip_modules()
        if want("adapter") or want("refusal"):
            self.adapters("lora-llama", "llama", {"target_modules": "all-linear"})
        if want("adapter"):
            self.adapters("qlora-llama", "llama", {"target_modules": "all-linear"}, quantized=True)
            self.adapters("lora-gpt2", "gpt2", {"target_modules": "all-linear"})
            self.adapters("lora-qwen2-rslora", "qwen2", {"target_modules": ["q_proj", "v_proj", "down_proj"],
                                                         "use_rslora": True})
            self.adapters("qlora-qwen3", "qwen3", {"target_modules": "all-linear"}, quantized=True)
            self.adapters("qlora-gemma3", "gemma3", {"target_modules": "all-linear"}, quantized=True)
            self.adapters("lora-gemma", "gemma", {"target_modules": ["q_proj", "v_proj", "down_proj"]})
            self.adapters("qlora-gemma2", "gemma2", {"target_modules": "all-linear"}, quantized=True)
            self.adapters("lora-llama-bias-layers", "llama-bias", {"target_modules": "all-linear",
                                                                   "layers_to_transform": [1]})
            self.adapters("qlora-mistral-regex", "mistral", {"target_modules": r".*\.(q|k|v|o)_proj"},
                          quantized=True)
            self.adapters("lora-llama-modules_to_save", "llama", {
                "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens", "model.norm", "lm_head"]})
            self.adapters("qlora-gpt2-modules_to_save", "gpt2", {
                "target_modules": "all-linear", "modules_to_save": ["wpe", "ln_f"]}, quantized=True)
        if want("peft"):
            self.peft()
        if want("full"):
            self.full_finetune("full-llama-bias", "llama-bias")
            self.full_finetune("full-gpt2", "gpt2")
        if want("refusal"):
            self.adapter_refusals()
            self.config_refusals()
            self.tied_refusal()
            self.model_refusals()
        self.judge.close()
        table, fails = self.report.table()
        print("\n" + table)
        return fails


def safetensors_names(file):
    """The tensor names in a safetensors file's header."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def add_tensor(file, name, shape):
    """Adds one fp32 tensor of zeros to a safetensors file (a stand-in for what PEFT writes)."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    count = 1
    for s in shape:
        count *= s
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + 4 * count]}
    data += bytes(4 * count)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--memtune", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--work", required=True, help="work directory on this machine")
    p.add_argument("--work-in-root", required=True, help="the same directory as the root sees it")
    p.add_argument("--judge-in-root", required=True, help="judge.py as the root sees it")
    p.add_argument("--only", nargs="*", default=[],
                   help="groups: defaults mt->hf hf->mt bf16 skip adapter peft full refusal tokenizer")
    p.add_argument("--families", nargs="*", default=[],
                   help="the families whose models mt->hf, hf->mt, bf16 and adapter check (default all; the other "
                        "groups use llama's and gpt2's)")
    args = p.parse_args()
    sys.exit(1 if Check(args).run(set(args.only)) else 0)


if __name__ == "__main__":
    main()
