#!/usr/bin/python3
"""tests/reference/hf_reference.py (the plain-torch reference memtune's tests compare with) judged
by transformers itself, for the soft-capping families: Gemma 2 (Gemma2ForCausalLM) and Gemma 3's
final_logit_softcapping. Run by scripts/reference_judge.sh, in two steps:

  reference_judge.py prepare WORK REFERENCE   on the host (Debian's /usr/bin/python3, torch 1.13):
      for every case, the reference's CLI writes WORK/cases/<case>/model (init), batch.safetensors
      (make-batch: one document per row, row 1 padded, 20 % of the targets ignored) and
      ref_<dtype>.safetensors (forward: logits, loss, every parameter's gradient) in float64,
      float32 and bfloat16, and a PEFT LoRA's for two cases; REFERENCE is copied to WORK.
  reference_judge.py judge WORK               inside the interop root (transformers 5.x, torch 2.x,
      PEFT's source at /interop/peft): transformers' model (attn_implementation="eager") in each
      dtype on the same batch (attention_mask from the segment ids, labels = the reference's
      targets shifted right by one, which transformers shifts back) against the reference's
      outputs from the host, and against the reference run in-process on the root's torch (which
      separates torch 1.13's kernels from a semantic difference: there they must be 0); then PEFT's
      LoRA gradients the same way; whether each cap changes the loss; transformers' SDPA against
      its eager attention (5.12's sdpa path drops attn_logit_softcapping); and Gemma 3's
      attn_logit_softcapping (5.12 never applies it).
Prints tables of max abs errors (2026-11-29, transformers 5.12.1 / torch 2.14.1: in-process 0.0 in
fp32 and bf16 for every case; docs/interop.md, "The last run").
"""
import json
import os
import subprocess
import sys

HERE = None  # WORK, from the command line
DTYPES = ("float64", "float32", "bfloat16")
COMMON = ["--arch", "llama", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
          "--intermediate", "96", "--vocab", "96", "--max-pos", "64"]
# name -> init options. Rows of 16 tokens, windows of 4 (< the row length).
CASES = {
    "g2_defaults_tied": ["--gemma2", "--layers", "4", "--sliding-window", "4", "--tie"],
    "g2_caps5_3_untied_bias_gelu": ["--gemma2", "--layers", "3", "--layer-types", "sliding,sliding,full",
                                    "--sliding-window", "4", "--attention-bias", "--hidden-act", "gelu",
                                    "--attn-softcap", "5.0", "--final-softcap", "3.0",
                                    "--query-pre-attn-scalar", "8"],
    "g2_caps_null_linear_tied": ["--gemma2", "--layers", "3", "--layer-types", "full,sliding,full",
                                 "--sliding-window", "4", "--tie", "--attn-softcap", "none",
                                 "--final-softcap", "none", "--rope-scaling",
                                 '{"type": "linear", "factor": 2.0}'],
    "g2_caps5_3_ropeparams_linear_pad0": ["--gemma2", "--layers", "2", "--sliding-window", "4",
                                          "--attn-softcap", "5", "--final-softcap", "3",
                                          "--rope-parameters", "--rope-theta", "500",
                                          "--rope-scaling", '{"rope_type": "linear", "factor": 4.0}',
                                          "--pad-token-id", "0", "--tie"],
    "g3_final_cap3_tied": ["--gemma3", "--layers", "3", "--layer-types", "sliding,full,sliding",
                           "--sliding-window", "4", "--final-softcap", "3.0", "--tie",
                           "--rope-local-theta", "5000"],
}
LORA_CASES = ("g2_caps5_3_untied_bias_gelu", "g3_final_cap3_tied")


def prepare(ref):
    import shutil
    shutil.copy(ref, os.path.join(HERE, "hf_reference.py"))
    root = os.path.join(HERE, "cases")
    for name, opts in CASES.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        run = lambda *a: subprocess.run(["/usr/bin/python3", ref, *a], check=True, stdout=subprocess.DEVNULL)
        run("init", "--out", os.path.join(d, "model"), "--seed", "7", *COMMON, *opts)
        run("make-batch", "--out", os.path.join(d, "batch.safetensors"), "--vocab", "96", "--seed", "8",
            "--rows", "2", "--seq", "16", "--max-docs", "1", "--ignore-frac", "0.2")
        for dt in DTYPES:
            run("forward", "--model", os.path.join(d, "model"), "--batch", os.path.join(d, "batch.safetensors"),
                "--out", os.path.join(d, f"ref_{dt}.safetensors"), "--dtype", dt)
        if name in LORA_CASES:  # a PEFT adapter on every linear layer but lm_head; its grads
            run("init-lora", "--model", os.path.join(d, "model"), "--out", os.path.join(d, "lora"),
                "--seed", "9", "--targets", "all-linear", "--r", "4", "--alpha", "8", "--rslora")
            for dt in ("float32", "bfloat16"):
                run("forward", "--model", os.path.join(d, "model"), "--batch", os.path.join(d, "batch.safetensors"),
                    "--lora", os.path.join(d, "lora"), "--out", os.path.join(d, f"lora_{dt}.safetensors"),
                    "--dtype", dt)
        print("prepared", name)


def judge():
    import logging
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    sys.path.insert(0, HERE)
    import hf_reference as R
    DT = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
    root = os.path.join(HERE, "cases")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    def load(d, dt, attn="eager", **over):
        m = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"), attn_implementation=attn,
                                                 dtype=DT[dt], **over)
        m.eval()
        return m

    def inputs(d):
        b = load_file(os.path.join(d, "batch.safetensors"))
        ids, tgt, seg = b["input_ids"].long(), b["targets"].long(), b["segment_ids"].long()
        assert int(seg.max()) == 0, "one document per row"
        assert bool((tgt[:, -1] == -100).all())
        # The reference's targets are already shifted (target[t] = token to predict after t);
        # ForCausalLMLoss shifts labels left by one, so labels[t + 1] = target[t].
        labels = torch.full_like(tgt, -100)
        labels[:, 1:] = tgt[:, :-1]
        return ids, (seg >= 0).long(), labels, seg >= 0

    def hf_run(m, ids, mask, labels):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        m.zero_grad(set_to_none=True)
        out.loss.backward()
        return out

    rows = []
    for name in CASES:
        d = os.path.join(root, name)
        with open(os.path.join(d, "model", "config.json")) as f:
            conf = json.load(f)
        ids, mask, labels, real = inputs(d)
        cfg, base = R.load_model(os.path.join(d, "model"))
        batch = R.load_batch(os.path.join(d, "batch.safetensors"))
        for dt in DTYPES:
            ref = load_file(os.path.join(d, f"ref_{dt}.safetensors"))
            # The reference on this torch: its values rounded to f32 as its CLI writes them.
            lg2, loss2, g2 = R.run_forward(cfg, base, batch, dtype=DT[dt])
            here = {"logits": lg2.float(), "loss": loss2.float(), **{k + ".grad": g.float() for k, g in g2.items()}}
            m = load(d, dt)
            assert type(m).__name__ == conf["architectures"][0], type(m).__name__
            assert m.config._attn_implementation == "eager"
            out = hf_run(m, ids, mask, labels)
            params = dict(m.named_parameters())
            hf = {"logits": out.logits.detach(), "loss": out.loss.detach(),
                  **{k + ".grad": p.grad for k, p in params.items()}}
            errs = []
            for other in (ref, here):
                assert set(other) == set(hf), set(other) ^ set(hf)  # every parameter (tied: one embedding)
                e_grad, worst, rel = 0.0, "", 0.0
                for k, g in other.items():
                    if k.endswith(".grad"):
                        e = float((hf[k].double() - g.double()).abs().max())
                        if e > e_grad:
                            e_grad, worst = e, k[:-len(".grad")]
                        rel = max(rel, e / max(float(g.double().abs().max()), 1e-30))
                errs.append((float((hf["logits"].double() - other["logits"].double())[real].abs().max()),
                             abs(hf["loss"].item() - other["loss"].item()), e_grad, rel, worst))
            rows.append((name, dt, errs, len(params), out.loss.item(), float(ref["logits"][real].abs().max())))
    for i, title in enumerate(("the reference's CLI on the host (torch 1.13), as memtune's tests run it",
                               "the reference in-process on this root's torch")):
        print(f"\ntransformers (eager) vs {title}: max abs errors")
        print(f"{'case':36} {'dtype':9} {'logits':>9} {'loss':>9} {'grad':>9} {'grad rel':>9}  "
              f"params  loss(HF)     max|logit|  worst grad")
        for r in rows:
            e = r[2][i]
            print(f"{r[0]:36} {r[1]:9} {e[0]:9.2e} {e[1]:9.2e} {e[2]:9.2e} {e[3]:9.2e}  {r[3]:6d}  "
                  f"{r[4]:.8f}  {r[5]:8.4f}    {e[4]}")

    # PEFT (its source at /interop/peft): the adapter's LoRA gradients through the soft-capped model.
    sys.path.insert(0, "/interop/peft")
    import peft
    print(f"\nPEFT {peft.__version__} LoRA (all-linear, r 4, rslora) vs the reference: max abs errors "
          "(host CLI | in-process)")
    for name in LORA_CASES:
        d = os.path.join(root, name)
        ids, mask, labels, real = inputs(d)
        cfg, base = R.load_model(os.path.join(d, "model"))
        batch = R.load_batch(os.path.join(d, "batch.safetensors"))
        lora = R.Lora(os.path.join(d, "lora"), cfg)
        for dt in ("float32", "bfloat16"):
            ref = load_file(os.path.join(d, f"lora_{dt}.safetensors"))
            lg2, loss2, g2 = R.run_forward(cfg, base, batch, lora, lora.tensors, dtype=DT[dt])
            here = {"logits": lg2.float(), "loss": loss2.float(), **{k + ".grad": g.float() for k, g in g2.items()}}
            pm = peft.PeftModel.from_pretrained(load(d, dt), os.path.join(d, "lora"), is_trainable=True)
            out = hf_run(pm, ids, mask, labels)
            hf = {"logits": out.logits.detach(), "loss": out.loss.detach()}
            for k, p in pm.named_parameters():
                if p.requires_grad:
                    hf[k.replace(".default", "") + ".grad"] = p.grad
            msg = f"  {name:36} {dt:9} {len(hf) - 2:3d} LoRA tensors ({next(p for p in pm.parameters() if p.requires_grad).dtype})"
            for other in (ref, here):
                assert set(other) == set(hf), set(other) ^ set(hf)
                e_l = float((hf["logits"].double() - other["logits"].double())[real].abs().max())
                e_g = max(float((hf[k].double() - other[k].double()).abs().max()) for k in hf if k.endswith(".grad"))
                msg += f" | logits {e_l:.2e} loss {abs(hf['loss'].item() - other['loss'].item()):.2e} grad {e_g:.2e}"
            print(msg)

    # Do the caps matter in these cases? HF with each cap switched off (config override).
    print("\nsoft-caps bite (transformers, fp32): loss with the caps as configured vs with one removed")
    for name in CASES:
        d = os.path.join(root, name)
        with open(os.path.join(d, "model", "config.json")) as f:
            conf = json.load(f)
        ids, mask, labels, real = inputs(d)
        base = hf_run(load(d, "float32"), ids, mask, labels).loss.item()
        msg = f"  {name:38} loss {base:.6f}"
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if conf.get(key) is not None:
                alt = hf_run(load(d, "float32", **{key: None}), ids, mask, labels).loss.item()
                msg += f"; without {key} ({conf[key]}): {alt:.6f} (diff {alt - base:+.2e})"
        print(msg)

    # eager vs sdpa for Gemma 2 (5.12's sdpa_attention_forward takes softcap only into **kwargs).
    print("\neager vs sdpa (transformers 5.12, fp32 and fp64)")
    for name in ("g2_caps5_3_untied_bias_gelu", "g2_caps5_3_ropeparams_linear_pad0", "g2_defaults_tied",
                 "g2_caps_null_linear_tied"):
        d = os.path.join(root, name)
        ids, mask, labels, real = inputs(d)
        for dt in ("float32", "float64"):
            res = {}
            for attn in ("eager", "sdpa"):
                m = load(d, dt, attn)
                assert m.config._attn_implementation == attn
                o = hf_run(m, ids, mask, labels)
                res[attn] = (o.loss.item(), o.logits.detach().double())
            nocap = hf_run(load(d, dt, "eager", attn_logit_softcapping=None), ids, mask, labels)
            print(f"  {name:38} {dt}: loss eager {res['eager'][0]:.8f} sdpa {res['sdpa'][0]:.8f} "
                  f"(diff {res['sdpa'][0] - res['eager'][0]:+.2e}, logits max diff "
                  f"{float((res['sdpa'][1] - res['eager'][1])[real].abs().max()):.2e}); eager without "
                  f"attn cap {nocap.loss.item():.8f} (sdpa - that: {res['sdpa'][0] - nocap.loss.item():+.2e})")
    m = AutoModelForCausalLM.from_pretrained(os.path.join(root, "g2_defaults_tied", "model"))
    print(f"  default attn_implementation of from_pretrained without the argument: "
          f"{m.config._attn_implementation}")

    # Gemma 3: attn_logit_softcapping set in the config changes nothing (never passed on).
    d = os.path.join(root, "g3_final_cap3_tied")
    ids, mask, labels, real = inputs(d)
    a = hf_run(load(d, "float32"), ids, mask, labels)
    b = hf_run(load(d, "float32", attn_logit_softcapping=1.0), ids, mask, labels)
    print(f"\ngemma3_text attn_logit_softcapping 1.0 vs null (eager, fp32): loss {b.loss.item():.8f} vs "
          f"{a.loss.item():.8f}, logits max diff {float((a.logits - b.logits).detach().abs().max()):.2e}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("prepare", "judge") or (sys.argv[1] == "prepare") != (len(sys.argv) == 4):
        sys.exit("usage: reference_judge.py prepare WORK REFERENCE | reference_judge.py judge WORK")
    HERE = os.path.abspath(sys.argv[2])
    if sys.argv[1] == "prepare":
        prepare(os.path.abspath(sys.argv[3]))
    else:
        judge()
