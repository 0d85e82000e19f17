"""The judge of scripts/interop_check.sh: Hugging Face transformers itself, run inside the
Debian unstable root (python3-transformers 5.x). It never imports memtune's code.

One request per stdin line, one JSON reply per stdout line, so transformers is imported
once for the whole check. Paths are relative to the work directory (argv[1]).

Requests ({"op": ..., ...}):
  versions                                 transformers, torch, tokenizers, safetensors
  make_model  config, out, dtype, shard    a random model by transformers' own init, saved
                                           with save_pretrained (shard: max_shard_size or null)
  load        model                        missing / unexpected / mismatched keys, config class
  loss        model, rows[, adapter]       mean next-token cross-entropy over every row (fp32);
                                           with an adapter, its LoRA merged here by hand
                                           (W += B @ A * scaling) from PEFT's file layout
  generate    model, prompt, n[, adapter]           greedy continuation: text, ids and the smallest
                                           top-1 / top-2 logit margin met on the way
  tokenize    model, text                  ids from the model directory's tokenizer
  dynamic_state   model, short, long   a short row's loss before and after a long forward
  adapter_config  adapter, model           which adapter_config.json target_modules PEFT's
                                           matching rules select in the model
  should_convert  names, patterns          transformers' should_convert_module for each pattern list
                                           and name: {"convert": [[bool per name] per list]}
  bnb_targets     config, skip             the projections transformers' bitsandbytes integration
                                           quantizes under llm_int8_skip_modules `skip`
  peft_version                             PEFT's version (group peft: PEFT's source bound at /interop/peft)
  peft_make   model, config, seed, out     an adapter PEFT makes (LoraConfig(**config)) and saves
  peft_count  model, config                PEFT's (trainable, all) parameter counts for LoraConfig(**config)
  peft_loss   model, adapter, rows         the loss of the adapter as PEFT loads and runs it, and of
                                           PEFT's merge of it; file tensors PEFT did not load
  defaults        keys                     TrainingArguments() and BitsAndBytesConfig(load_in_4bit=True):
                                           {"training": {key: value}, "quantization_config": {...}}
                                           (enums and dtypes as their names; a key absent: null)
"""
import json
import math
import os
import re
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(int(os.environ.get("JUDGE_THREADS", "2")))

WORK = sys.argv[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def path(p):
    return os.path.join(WORK, p)


def load_model(model_dir, dtype="fp32", attn=None):
    # transformers' SDPA (its default) drops Gemma 2's attn_logit_softcapping without a word,
    # computing another model than its config's: a soft-capped model is judged by eager
    # attention, which applies the cap (as memtune does).
    if attn is None and getattr(AutoConfig.from_pretrained(path(model_dir)), "attn_logit_softcapping", None):
        attn = "eager"
    kwargs = {"attn_implementation": attn} if attn else {}
    model, info = AutoModelForCausalLM.from_pretrained(
        path(model_dir), dtype=DTYPES[dtype], output_loading_info=True, **kwargs)
    model.eval()
    return model, info


def plain(v):
    """A default as JSON: enums by value, torch dtypes by name."""
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value
    return v


def op_defaults(r):
    ta = transformers.TrainingArguments(output_dir=path("defaults-probe"))
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True)
    return {"training": {k: plain(getattr(ta, k, None)) for k in r["keys"]["training"]},
            "quantization_config": {k: plain(getattr(bnb, k, None)) for k in r["keys"]["quantization_config"]}}


def op_versions(_):
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__}


def op_make_model(r):
    torch.manual_seed(r.get("seed", 0))
    config = AutoConfig.for_model(**r["config"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Weights larger than transformers' initializer_range (0.02) make the logits of a tiny
    # random model far from uniform, so the greedy tokens are not decided by rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, r.get("std", 0.2))
            elif "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
            else:  # biases: nonzero, so a dropped bias shows in the loss
                p.normal_(0, 0.1)
    model = model.to(DTYPES[r["dtype"]])
    kwargs = {"max_shard_size": r["shard"]} if r.get("shard") else {}
    model.save_pretrained(path(r["out"]), **kwargs)
    files = sorted(os.listdir(path(r["out"])))
    return {"files": files, "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters())}


def op_load(r):
    model, info = load_model(r["model"])
    return {"class": type(model).__name__,
            "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "mismatched": [str(m) for m in info.get("mismatched_keys", [])]}


def peft_matches(name, target, layers, layer_of):
    """PEFT's check_target_module_exists for a list or str target_modules (tuners_utils)."""
    if isinstance(target, str) and layers is not None:
        raise ValueError("layers_to_transform cannot be used when target_modules is a str (PEFT's own check)")
    if target == "all-linear":  # PEFT: every linear layer but the output layer
        ok = name not in ("lm_head",)
    elif isinstance(target, str):
        ok = re.fullmatch(target, name) is not None
    elif name in target:  # named in full: a target in any layer
        return True
    else:
        ok = any(name.endswith("." + t) for t in target)
    if ok and layers is not None:
        ok = layer_of(name) in (layers if isinstance(layers, list) else [layers])
    return ok


def layer_index(name):
    m = re.search(r"\.(?:layers|h)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def merge_adapter(model, adapter_dir):
    """W += scaling * B @ A, as PEFT's LoraLayer.merge (fan_in_fan_out: transposed)."""
    cfg = json.load(open(os.path.join(path(adapter_dir), "adapter_config.json")))
    tensors = safetensors.torch.load_file(os.path.join(path(adapter_dir), "adapter_model.safetensors"))
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    modules = dict(model.named_modules())
    merged = []
    # modules_to_save: PEFT saves each selected module's tensors as base_model.model.<name>
    # (a module is selected when its name ends with an entry) and they replace the base's.
    mts = cfg.get("modules_to_save") or []
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in list(tensors):
            name = key[len("base_model.model."):]
            if name in params and not re.search(r"\.lora_[AB]\.", key):
                if not any(name.rsplit(".", 1)[0].endswith(e) for e in mts):
                    raise ValueError(f"{key} is a whole module but modules_to_save {mts} does not select it")
                params[name].copy_(tensors.pop(key).to(params[name].dtype))
                merged.append(name)
        for module in modules:
            if any(module.endswith(e) for e in mts) and hasattr(modules[module], "weight") and \
                    module + ".weight" not in merged and module:
                raise ValueError(f"modules_to_save selects {module} but the adapter has no base_model.model.{module}.weight")
        for key in tensors:
            m = re.fullmatch(r"base_model\.model\.(.+)\.lora_A(?:\.default)?\.weight", key)
            if not m:
                if not re.fullmatch(r"base_model\.model\.(.+)\.lora_B(?:\.default)?\.weight", key):
                    raise ValueError(f"adapter tensor {key} is not a plain LoRA weight")
                continue
            name = m.group(1)
            if not peft_matches(name, cfg["target_modules"], cfg.get("layers_to_transform"), layer_index):
                raise ValueError(f"{name} is in the adapter but PEFT's target_modules "
                                 f"{cfg['target_modules']} would not adapt it")
            A = tensors[key].float()
            B = tensors[key.replace("lora_A", "lora_B")].float()
            delta = (B @ A) * scaling
            w = modules[name].weight
            w += (delta.T if cfg.get("fan_in_fan_out") else delta).to(w.dtype)
            merged.append(name)
    return merged


def mean_row_loss(model, rows):
    """transformers' own causal-LM loss (labels shifted inside), per row, then the rows' mean."""
    rows = torch.tensor(rows, dtype=torch.long)
    with torch.no_grad():
        losses = [model(input_ids=row[None], labels=row[None]).loss.item() for row in rows]
    return sum(losses) / len(losses), rows.numel() - len(rows)


def op_loss(r):
    model, info = load_model(r["model"], r.get("dtype", "fp32"), r.get("attn"))
    merged = merge_adapter(model, r["adapter"]) if r.get("adapter") else []
    loss, tokens = mean_row_loss(model, r["rows"])
    return {"loss": loss, "tokens": tokens, "merged": len(merged),
            "missing": len(info["missing_keys"]), "unexpected": len(info["unexpected_keys"])}


# PEFT itself (group peft): its source (a directory holding peft/), bound here by
# interop_check.sh when it has one. Debian packages no PEFT; it is pure Python over the
# torch, transformers and accelerate this root has.
PEFT_DIR = "/interop/peft"


def import_peft():
    if os.path.isdir(os.path.join(PEFT_DIR, "peft")) and PEFT_DIR not in sys.path:
        sys.path.insert(0, PEFT_DIR)
    import peft
    return peft


def op_peft_version(r):
    return {"version": import_peft().__version__}


def op_peft_make(r):
    """An adapter made by PEFT: get_peft_model(model, LoraConfig(**config)), its lora_B (zero at
    PEFT's init) drawn, DoRA's magnitudes moved 20 % off the norms PEFT starts them at and the
    biases its bias trains moved off the base's, by a seeded generator, then save_pretrained."""
    peft = import_peft()
    model, _ = load_model(r["model"])
    torch.manual_seed(r["seed"])  # PEFT draws lora_A from the global generator: the same file each run
    pm = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **r["config"]))
    g = torch.Generator().manual_seed(r["seed"])
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif ".lora_magnitude_vector." in name:
                p.mul_(0.8 + 0.4 * torch.rand(p.shape, generator=g))
            elif p.requires_grad and name.endswith(".bias"):  # bias: all | lora_only
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(path(r["out"]))
    return {"files": sorted(os.listdir(path(r["out"]))), "trainable": pm.get_nb_trainable_parameters()[0]}


def op_peft_count(r):
    """PEFT's print_trainable_parameters numbers for LoraConfig(**config) on the model:
    get_nb_trainable_parameters() (trainable, all)."""
    peft = import_peft()
    model, _ = load_model(r["model"])
    pm = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **r["config"]))
    trainable, total = pm.get_nb_trainable_parameters()
    return {"trainable": trainable, "all": total}


def op_interval_schedule(r):
    """The steps at which transformers' Trainer logs, evaluates and saves: TrainingArguments
    (**args) driven through its DefaultFlowCallback over `total` steps, epochs of `per_epoch`
    steps (the last one shorter), as _inner_training_loop calls on_step_end and on_epoch_end
    (the TrainerState's steps from compute_steps, as the Trainer sets them)."""
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState
    args = transformers.TrainingArguments(output_dir=path("interval-probe"), report_to="none", **r["args"])
    total, per_epoch = r["total"], r["per_epoch"]
    state, control, flow = TrainerState(), TrainerControl(), DefaultFlowCallback()
    state.max_steps = total
    state.compute_steps(args, total)
    out = {"log": [], "evaluate": [], "save": []}

    def take(step):
        for key, flag in (("log", "should_log"), ("evaluate", "should_evaluate"), ("save", "should_save")):
            if getattr(control, flag) and (not out[key] or out[key][-1] != step):
                out[key].append(step)
            setattr(control, flag, False)

    for step in range(1, total + 1):
        state.global_step = step
        state.epoch = step / per_epoch
        flow.on_step_end(args, state, control)
        take(step)
        if step % per_epoch == 0 or step == total:
            flow.on_epoch_end(args, state, control)
            take(step)
    return out


def op_plateau_lrs(r):
    """The learning rate of each of `total` steps under torch's ReduceLROnPlateau stepped as
    transformers' Trainer steps it: once after each step's evaluation, with its eval_loss
    (r["eval_losses"][k] after step k + 1); the first step at lr."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=r["lr"])
    sched = transformers.get_scheduler("reduce_lr_on_plateau", opt, scheduler_specific_kwargs=r["kwargs"])
    lrs = []
    for k in range(r["total"]):
        lrs.append(opt.param_groups[0]["lr"])
        if k < len(r["eval_losses"]):
            sched.step(r["eval_losses"][k])
    return {"lrs": lrs}


def op_schedule_lrs(r):
    """The learning rate transformers' get_scheduler(name, ...) sets before each of `total`
    optimizer steps (an SGD over one parameter at lr, stepped as the Trainer steps them)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=r["lr"])
    sched = transformers.get_scheduler(r["name"], opt, num_warmup_steps=r["warmup"], num_training_steps=r["total"],
                                       scheduler_specific_kwargs=r["kwargs"])
    lrs = []
    for _ in range(r["total"]):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return {"lrs": lrs}


def op_label_smoothed_loss(r):
    """transformers' Trainer loss under label_smoothing_factor: its LabelSmoother(epsilon) on the
    model's outputs for all rows as one batch (labels = input_ids, shifted inside)."""
    from transformers.trainer_pt_utils import LabelSmoother
    model, _ = load_model(r["model"])
    rows = torch.tensor(r["rows"], dtype=torch.long)
    with torch.no_grad():
        outputs = model(input_ids=rows)
        loss = LabelSmoother(epsilon=r["epsilon"])(outputs, rows, shift_labels=True)
    return {"loss": loss.item()}


def op_peft_loss(r):
    """The adapter as PEFT loads it (PeftModel.from_pretrained) on transformers' model: the loss of
    PEFT's own forward, then of its merge (merge_and_unload). `unloaded` / `differ`: file tensors
    PEFT's state dict does not hold or holds with other values (none left at their init)."""
    peft = import_peft()
    model, _ = load_model(r["model"])
    pm = peft.PeftModel.from_pretrained(model, path(r["adapter"]))
    pm.eval()
    file = safetensors.torch.load_file(os.path.join(path(r["adapter"]), "adapter_model.safetensors"))
    state = peft.get_peft_model_state_dict(pm)
    unloaded = sorted(set(file) ^ set(state))
    differ = sorted(k for k in file if k in state and not torch.equal(file[k].to(state[k].dtype), state[k].cpu()))
    loss, tokens = mean_row_loss(pm, r["rows"])
    merged, _ = mean_row_loss(pm.merge_and_unload(), r["rows"])
    return {"loss": loss, "merged_loss": merged, "tokens": tokens, "tensors": len(file),
            "unloaded": unloaded[:6], "differ": differ[:6]}


def op_generate(r):
    model, _ = load_model(r["model"], r.get("dtype", "fp32"), r.get("attn"))
    if r.get("adapter"):
        merge_adapter(model, r["adapter"])
    tok = AutoTokenizer.from_pretrained(path(r["model"]))
    ids = tok(r["prompt"], return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=r["n"], eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id,
                             output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:].tolist()
    tops = [s[0].float().topk(2).values for s in out.scores]
    margins = [float(t[0] - t[1]) for t in tops]
    text = r["prompt"] + tok.decode(new, skip_special_tokens=True)
    # Per step: the text so far, the top logit and its lead over the second (where a text that
    # differs first parts from this one, and whether a rounding could have decided it).
    prefixes = [r["prompt"] + tok.decode(new[:i], skip_special_tokens=True) for i in range(len(new))]
    return {"ids": new, "text": text, "min_margin": min(margins) if margins else None,
            "prompt_ids": ids[0].tolist(), "margins": margins, "tops": [float(t[0]) for t in tops],
            "prefixes": prefixes}


def op_tokenize(r):
    tok = AutoTokenizer.from_pretrained(path(r["model"]))
    return {"ids": tok(r["text"]).input_ids}


def op_adapter_config(r):
    cfg = json.load(open(os.path.join(path(r["adapter"]), "adapter_config.json")))
    model, _ = load_model(r["model"])
    linear = [n for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    selected = [n for n in linear
                if peft_matches(n, cfg["target_modules"], cfg.get("layers_to_transform"), layer_index)]
    return {"target_modules": cfg["target_modules"], "layers_to_transform": cfg.get("layers_to_transform"),
            "selected": selected}


def op_dynamic_state(r):
    """A dynamic-rope model's loss on a short row before and after one forward of a row past
    max_position_embeddings: transformers keeps the longer row's rotary base."""
    model, _ = load_model(r["model"])
    short = torch.tensor([r["short"]])
    with torch.no_grad():
        before = model(input_ids=short, labels=short).loss.item()
        model(input_ids=torch.tensor([r["long"]]))
        after = model(input_ids=short, labels=short).loss.item()
    return {"before": before, "after": after}


def op_should_convert(r):
    """transformers' own should_convert_module (quantizers_utils) over names x pattern lists."""
    from transformers.quantizers.quantizers_utils import should_convert_module
    return {"convert": [[should_convert_module(n, p) for n in r["names"]] for p in r["patterns"]]}


def op_bnb_targets(r):
    """The modules transformers' bitsandbytes integration replaces with Linear4bit for a model of
    `config` under llm_int8_skip_modules `skip`: replace_with_bnb_linear's selection over the
    quantizer's modules_to_not_convert (bitsandbytes itself is not needed to compute it)."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    config = AutoConfig.for_model(**r["config"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=r["skip"])
    keep = HfQuantizer.get_modules_to_not_convert(model, q.llm_int8_skip_modules, model._keep_in_fp32_modules)
    return {"converted": sorted(name for name, m in model.named_modules()
                                if should_convert_module(name, keep)
                                and (isinstance(m, Conv1D) or type(m) is torch.nn.Linear)),
            "not_converted": sorted(keep)}


OPS = {k[3:]: v for k, v in globals().items() if k.startswith("op_")}


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        r = json.loads(line)
        try:
            reply = OPS[r["op"]](r)
            reply["ok"] = True
        except Exception as e:  # the check prints it as a FAIL with the message
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-2000:]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
