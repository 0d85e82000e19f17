#!/usr/bin/python3
"""Independent reference of Hugging Face transformers' causal-LM semantics (Llama, Mistral, Qwen2,
Qwen3, GPT-2, Gemma, Gemma 2, Gemma 3 text) and PEFT LoRA, written from the algorithms with plain
torch (no transformers, no safetensors package). memtune's C++ tests run it on Debian's
/usr/bin/python3 (torch 1.13 + numpy) to make fixtures at test time and to get the values memtune
must reproduce.

Usage (all files are safetensors unless .json):
  hf_reference.py init --arch llama|gpt2 --out DIR --seed N [--layers 2 --hidden 64 --heads 4
      --kv-heads 2 --intermediate 128 --vocab 256 --max-pos 128 --head-dim D --rope-theta 10000
      --rope-scaling JSON --rope-parameters --tie --attention-bias --mlp-bias --qwen2 --mistral
      --qwen3 --sliding-window W --eps E --init-std S --save-dtype float32|bfloat16|float16
      --gemma --gemma2 --gemma3 --hidden-act gelu|gelu_pytorch_tanh --layer-types sliding,full,...
      --query-pre-attn-scalar S --rope-local-theta T --pad-token-id P --attn-softcap X|none
      --final-softcap X|none]
  hf_reference.py init-lora --model DIR --out ADAPTER_DIR --seed N [--r 4 --alpha 8
      --targets q_proj,v_proj --rslora --dora --rank-pattern JSON --alpha-pattern JSON]
  hf_reference.py make-batch --out BATCH --vocab V --seed N [--rows 2 --seq 16 --max-docs 3
      --min-doc 2 --ignore-frac 0.1 --pad]
  hf_reference.py forward --model DIR --batch BATCH --out OUT [--lora ADAPTER_DIR]
      [--dtype float64|float32|bfloat16] [--no-grad] [--autocast]
  hf_reference.py train --model DIR --batch BATCH --lora ADAPTER_DIR --steps N --out OUT.json
      [--out-tensors FINAL --lr 1e-3 --weight-decay 0.0 --betas 0.9,0.999 --eps 1e-8
       --max-grad-norm 0 --dtype float64|float32]
  hf_reference.py selftest

Batch tensors (int64, shape (B,T)): input_ids; targets (already shifted: the token to predict
after position t, -100 = ignored); position_ids (restart at 0 per packed document); segment_ids
(document index within the row, -1 on padding). A query attends to keys that are at or before it
AND in the same segment (segment >= 0); every query also attends to itself, so padding rows give
finite (but meaningless) values: compare logits only where segment_ids >= 0.

forward writes: logits (B,T,V) f32, loss () f32 = mean cross-entropy over targets != -100, and
"<HF name>.grad" f32 for every parameter (or, with --lora, "<PEFT key>.grad" for the LoRA tensors
only). Compute dtype is float64 by default. Kept exactly as HF: RoPE cos/sin tables are computed in
fp32 (HF forces fp32 there) and then cast to the compute dtype; RMSNorm/softmax run in
max(fp32, compute dtype).

Qwen3 (transformers 5's Qwen3ForCausalLM) is Llama plus q_norm / k_norm: RMSNorms over head_dim
(same eps and fp32 upcast) applied to each head's q_proj / k_proj output before RoPE;
attention_bias puts a bias on q, k, v and o_proj; head_dim comes from the config (128 when
absent); use_sliding_window is refused.

Gemma (GemmaForCausalLM, model_type gemma), Gemma 2 (Gemma2ForCausalLM, gemma2) and Gemma 3 text
(Gemma3ForCausalLM, gemma3_text), as transformers 5.12: the embedding is multiplied by
sqrt(hidden_size) rounded to the weights' dtype; every norm is Gemma's, x / rms(x) * (1 + w) in
max(fp32, dtype) rounded once at the end; the MLP is down(act(gate(x)) * up(x)) with act
gelu_pytorch_tanh (default) or gelu (exact), read from hidden_act (gemma) / hidden_activation
(gemma2, gemma3_text; the other key is ignored); attention_bias on q/k/v/o; head_dim from the
config (256 when absent); tie_word_embeddings defaults to true; pad_token_id (default 0, null =
none) is nn.Embedding's padding_idx: that row gets no gradient from the lookup. Gemma's layer is
Llama's. Gemma 2's and 3's: h += post_attention_layernorm(attn(input_layernorm(h))); h +=
post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))); scores scaled by
query_pre_attn_scalar^-0.5 (default 256); sliding layers see keys q-sliding_window+1 .. q (default
4096). Gemma 2: layer_types default to sliding_attention for even layers (0, 2, ...) and
full_attention for odd ones; one RoPE for every layer, read as Gemma's (rope_theta default 1e4;
rope_scaling wins over a flat rope_parameters); soft-capping, cap * tanh(x / cap) with each op in the
compute dtype, of the attention scores (attn_logit_softcapping, default 50, before the mask) and
of the logits (final_logit_softcapping, default 30, before the loss's upcast); null disables
either. Gemma 3: q_norm / k_norm (Gemma norms over head_dim) before RoPE; layer_types (default:
every sliding_window_pattern-th (6) layer full_attention, the others sliding_attention); sliding
layers use RoPE with rope_local_base_freq (default 1e4, no scaling), full layers rope_theta
(default 1e6) with rope_scaling; or rope_parameters nested as {"full_attention": {...},
"sliding_attention": {...}}; final_logit_softcapping as Gemma 2's (default null). Gemma (1) reads
neither soft-capping key. Refused: use_bidirectional_attention, a soft-cap that is not a positive
number, and what transformers 5.12 silently drops: gemma3_text's attn_logit_softcapping (its
attention never applies it), gemma2 rope_parameters entries nested by layer type, and for
gemma3_text a top-level rope_scaling with "type" but no "rope_type", a flat rope_parameters, a
nested yarn truncate. Compute in float64 keeps float64 where transformers goes through fp32
(norms, softmax, loss), as for the other families.
"""
import argparse
import json
import math
import os
import re
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

IGNORE = -100

# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_ARG = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
              "float16": torch.float16}


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()


def save_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> tensor (insertion order kept)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = _tensor_bytes(t)
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"{path}: header length {n} past end of file")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = info["shape"]
        count = int(np.prod(shape)) if shape else 1
        esize = torch.empty((), dtype=dt).element_size()
        if e - b != count * esize or e > len(body):
            raise ValueError(f"{path}: tensor {name}: bad byte range {b}..{e}")
        raw = bytearray(body[b:e])
        if count == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            t = torch.frombuffer(raw, dtype=dt).reshape(shape).clone()
        out[name] = t
    return out


def write_json(path, obj):
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------- config

class Cfg:
    """The fields of an HF config.json that the forward pass needs."""

    def __init__(self, d):
        self.raw = d
        mt = d.get("model_type")
        archs = d.get("architectures") or []
        if mt is None and archs:
            mt = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "GPT2LMHeadModel": "gpt2", "GemmaForCausalLM": "gemma",
                  "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}.get(archs[0])
        if mt not in ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text"):
            raise ValueError(f"unsupported model_type {mt!r} (architectures {archs})")
        self.model_type = mt
        self.family = "gpt2" if mt == "gpt2" else "llama"
        # Gemma / Gemma 2 / Gemma 3: the llama family's tensors (plus Gemma 2's and 3's extra
        # norms), run by Forward.gemma; every other family leaves these off.
        self.gemma = mt in ("gemma", "gemma2", "gemma3_text")
        self.gemma3 = mt == "gemma3_text"
        # Gemma2DecoderLayer / Gemma3DecoderLayer: norms after attention and around the MLP.
        self.sandwich = mt in ("gemma2", "gemma3_text")
        self.padding_idx = None  # nn.Embedding's padding_idx: only the Gemma path applies it
        # cap * tanh(x / cap) of the attention scores / the logits: only the Gemma path applies them
        self.attn_softcap = self.final_softcap = None
        # Qwen3Attention / Gemma3Attention: RMSNorm(head_dim) on each head of q_proj / k_proj
        # output, before RoPE.
        self.qk_norm = mt in ("qwen3", "gemma3_text")
        if self.gemma:
            self._gemma(d)
            return
        if self.family == "gpt2":
            self.hidden = d["n_embd"]
            self.layers = d["n_layer"]
            self.heads = d["n_head"]
            self.kv_heads = self.heads
            self.head_dim = self.hidden // self.heads
            self.inner = d.get("n_inner") or 4 * self.hidden
            self.vocab = d["vocab_size"]
            self.max_pos = d["n_positions"]
            self.eps = d.get("layer_norm_epsilon", 1e-5)
            self.act = d.get("activation_function", "gelu_new")
            if self.act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
                raise ValueError(f"unsupported activation_function {self.act!r}")
            self.tie = d.get("tie_word_embeddings", True)
            self.scale_attn_weights = d.get("scale_attn_weights", True)
            self.scale_by_layer = d.get("scale_attn_by_inverse_layer_idx", False)
            return
        self.hidden = d["hidden_size"]
        self.layers = d["num_hidden_layers"]
        self.heads = d["num_attention_heads"]
        self.kv_heads = d.get("num_key_value_heads") or self.heads
        if self.heads % self.kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if mt == "qwen3":  # Qwen3Config: head_dim: int = 128 (not hidden / heads)
            self.head_dim = d.get("head_dim", 128)
            if not isinstance(self.head_dim, int) or self.head_dim <= 0:
                raise ValueError(f"qwen3 head_dim must be a positive int, got {self.head_dim!r}")
        else:
            self.head_dim = d.get("head_dim") or self.hidden // self.heads
        self.inter = d["intermediate_size"]
        self.vocab = d["vocab_size"]
        # Each config class's default (LlamaConfig 2048, MistralConfig 4096 * 32, Qwen2/Qwen3Config 32768).
        self.max_pos = d.get("max_position_embeddings", {"mistral": 131072, "qwen2": 32768, "qwen3": 32768}.get(mt, 2048))
        self.eps = d.get("rms_norm_eps", 1e-6)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d.get('hidden_act')!r}")
        self.tie = d.get("tie_word_embeddings", False)
        if mt == "llama":
            self.qkv_bias = self.o_bias = bool(d.get("attention_bias", False))
            self.mlp_bias = bool(d.get("mlp_bias", False))
        elif mt == "qwen2":  # Qwen2Attention: q/k/v bias=True, o_proj bias=False (hard-coded)
            self.qkv_bias, self.o_bias, self.mlp_bias = True, False, False
        elif mt == "qwen3":  # Qwen3Attention: attention_bias on q/k/v AND o_proj; Qwen3MLP no bias
            self.qkv_bias = self.o_bias = bool(d.get("attention_bias", False))
            self.mlp_bias = False
        else:  # Mistral: no biases
            self.qkv_bias = self.o_bias = self.mlp_bias = False
        self.sliding_window = None
        if mt == "mistral":
            self.sliding_window = d.get("sliding_window")
        elif mt in ("qwen2", "qwen3") and d.get("use_sliding_window", False):
            raise ValueError(f"{mt} use_sliding_window is not supported by the reference")
        if mt == "qwen3" and "sliding_attention" in (d.get("layer_types") or []):
            # use_sliding_window false makes Qwen3Config's sliding_window None; a layer_types
            # entry "sliding_attention" then makes transformers' create_sliding_window_causal_mask
            # raise (eager / sdpa), so such a config has no well-defined forward.
            raise ValueError("qwen3 layer_types has sliding_attention while use_sliding_window "
                             "is false (transformers cannot build that mask)")
        # RoPE: newer configs nest everything in rope_parameters; older ones use top-level
        # rope_theta + rope_scaling ("type" is the old spelling of "rope_type").
        rp = d.get("rope_parameters")
        if rp:
            self.rope_theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = dict(rp)
        else:
            self.rope_theta = float(d.get("rope_theta", 10000.0))
            scaling = dict(d.get("rope_scaling") or {})
        self.rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if self.rope_type not in ("default", "linear", "llama3", "yarn", "dynamic"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported by the reference")
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported by the reference")
        self.rope_scaling = scaling

    def _gemma(self, d):
        """GemmaConfig / Gemma2Config / Gemma3TextConfig (transformers 5.12): their defaults where
        keys are absent."""
        name = self.model_type
        g3 = self.gemma3
        defaults = {
            "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                          max_position_embeddings=8192),
            "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                           num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=8192),
            "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                                num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                                max_position_embeddings=131072)}[name]

        def get(key):
            v = d.get(key)
            return defaults[key] if v is None else v
        self.hidden = get("hidden_size")
        self.layers = get("num_hidden_layers")
        self.heads = get("num_attention_heads")
        self.kv_heads = get("num_key_value_heads")
        self.inter = get("intermediate_size")
        self.vocab = get("vocab_size")
        self.max_pos = get("max_position_embeddings")
        if self.heads % self.kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if name != "gemma" and self.hidden % self.heads:  # Gemma2/Gemma3TextConfig.validate_architecture
            raise ValueError(f"{name}: hidden_size {self.hidden} is not a multiple of "
                             f"num_attention_heads {self.heads}")
        self.head_dim = d.get("head_dim", 256)  # every config: head_dim 256, not hidden / heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"{name} head_dim must be a positive int, got {self.head_dim!r}")
        self.eps = d.get("rms_norm_eps", 1e-6)
        # GemmaMLP reads hidden_act, Gemma2MLP / Gemma3MLP hidden_activation (the other key is
        # ignored).
        act_key = "hidden_act" if name == "gemma" else "hidden_activation"
        self.act = d.get(act_key, "gelu_pytorch_tanh")
        if self.act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported {act_key} {self.act!r} (gelu_pytorch_tanh or gelu)")
        self.tie = d.get("tie_word_embeddings", True)
        # Gemma(2/3)Attention: attention_bias on q, k, v AND o_proj; the MLP has no bias.
        self.qkv_bias = self.o_bias = bool(d.get("attention_bias", False))
        self.mlp_bias = False
        if d.get("use_bidirectional_attention"):
            raise ValueError(f"{name} use_bidirectional_attention is not supported by the reference")
        # nn.Embedding(vocab, hidden, padding_idx=pad_token_id): the row's gradient from the
        # lookup is zero (a tied lm_head still gives it one). All three configs default to 0.
        pad = d.get("pad_token_id", 0)
        if pad is not None:
            if not isinstance(pad, int) or not -self.vocab <= pad < self.vocab:
                raise ValueError(f"{name} pad_token_id {pad!r} is not a token of vocab {self.vocab}")
            self.padding_idx = pad % self.vocab
        if name == "gemma":  # GemmaConfig has no soft-capping, no sliding window
            self.attn_scale = self.head_dim ** -0.5
            self.sliding_window = None
            self.layer_types = ["full_attention"] * self.layers
        else:
            # Soft-capping: Gemma2Config defaults attn_logit_softcapping 50 and
            # final_logit_softcapping 30, Gemma3TextConfig both null; a null key disables its cap.
            # Gemma3Attention (5.12) never passes attn_logit_softcapping to the attention function,
            # so transformers silently drops it there.
            for key, attr, default in (("attn_logit_softcapping", "attn_softcap", 50.0),
                                       ("final_logit_softcapping", "final_softcap", 30.0)):
                cap = d.get(key, None if g3 else default)
                if cap is None:
                    continue
                if isinstance(cap, bool) or not isinstance(cap, (int, float)) or \
                        not (math.isfinite(cap) and cap > 0):
                    raise ValueError(f"{name} {key} must be a positive number or null, got {cap!r}")
                if g3 and attr == "attn_softcap":
                    raise ValueError("gemma3_text attn_logit_softcapping is ignored by transformers "
                                     "5.12 (Gemma3Attention never applies it)")
                setattr(self, attr, float(cap))
            self.attn_scale = float(d.get("query_pre_attn_scalar", 256)) ** -0.5
            self.sliding_window = d.get("sliding_window", 4096)
            lt = d.get("layer_types")
            if lt is None and g3:  # Gemma3TextConfig: every sliding_window_pattern-th layer is global
                pattern = d.get("sliding_window_pattern", 6)
                lt = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                      for i in range(self.layers)]
            elif lt is None:  # Gemma2Config: even layers (0, 2, ...) sliding, odd ones global
                lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.layers)]
            if len(lt) != self.layers or any(t not in ("sliding_attention", "full_attention") for t in lt):
                raise ValueError(f"{name} layer_types {lt!r}: want {self.layers} entries of "
                                 "sliding_attention / full_attention")
            self.layer_types = list(lt)
            if "sliding_attention" in lt and self.sliding_window is None:
                raise ValueError(f"{name}: sliding_attention layers need a sliding_window")
        if not g3:
            # Gemma / Gemma 2: one RoPE for every layer. RotaryEmbeddingConfigMixin: rope_scaling
            # (old spelling) wins over rope_parameters; rope_theta from the dict, else the
            # top-level key, else 10000.
            scaling = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
            if name == "gemma2" and {"full_attention", "sliding_attention"} & set(scaling):
                # standardize_rope_params keeps one flat dict (rope_theta / rope_type filled in
                # beside the entries) and Gemma2RotaryEmbedding reads only its top level.
                raise ValueError("gemma2 rope parameters nested by layer type are ignored by "
                                 "transformers (Gemma 2 has one RoPE; write a flat dict)")
            theta = scaling.get("rope_theta", d.get("rope_theta", 10000.0))
            RopeSpec.fill(self, theta, scaling, self.head_dim, self.max_pos)
            self.rope = dict.fromkeys(("full_attention", "sliding_attention"), self)
            return
        # Gemma3TextConfig.convert_rope_params_to_dict: rope_parameters is nested by layer type;
        # the old top-level rope_scaling updates the full_attention entry, rope_theta (default 1e6)
        # and rope_local_base_freq (default 1e4) fill full / sliding's rope_theta when absent.
        rp = d.get("rope_parameters")
        if rp is not None and not set(rp) <= {"full_attention", "sliding_attention"}:
            raise ValueError("gemma3_text rope_parameters must be nested by layer type "
                             "(full_attention / sliding_attention); transformers ignores a flat dict")
        rp = {k: dict(v) for k, v in (rp or {}).items() if v is not None}
        rp.setdefault("full_attention", {"rope_type": "default"})
        rp.setdefault("sliding_attention", {"rope_type": "default"})
        old = d.get("rope_scaling")
        if old:
            if "rope_type" not in old and "rope_type" in rp["full_attention"] and \
                    old.get("type", "default") != rp["full_attention"]["rope_type"]:
                # transformers 5.12 keeps the entry's rope_type ("default"): a top-level
                # {"type": "linear", ...} is silently not applied.
                raise ValueError("gemma3_text rope_scaling spells the type as 'type'; transformers "
                                 "5.12 ignores it there (write rope_type)")
            rp["full_attention"].update(old)
        rp["full_attention"].setdefault("rope_theta", d.get("rope_theta", 1e6))
        rp["sliding_attention"].setdefault("rope_theta", d.get("rope_local_base_freq", 1e4))
        for t in ("full_attention", "sliding_attention"):
            if rp[t].get("truncate", True) is not True:
                # _compute_yarn_parameters reads truncate from the top level of rope_parameters,
                # which the nested form never has: transformers 5.12 always truncates here.
                raise ValueError(f"gemma3_text rope_parameters.{t}.truncate is ignored by transformers")
        self.rope = {t: RopeSpec(rp[t]["rope_theta"], rp[t], self.head_dim, self.max_pos)
                     for t in ("full_attention", "sliding_attention")}


class RopeSpec:
    """One RoPE's parameters (the attributes rope_inv_freq / rope_cos_sin read): a Cfg is one;
    Gemma 3 has one per layer type."""

    def __init__(self, theta, scaling, head_dim, max_pos):
        RopeSpec.fill(self, theta, scaling, head_dim, max_pos)

    @staticmethod
    def fill(obj, theta, scaling, head_dim, max_pos):
        obj.head_dim, obj.max_pos = head_dim, max_pos
        obj.rope_theta = float(theta)
        obj.rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if obj.rope_type not in ("default", "linear", "llama3", "yarn", "dynamic"):
            raise ValueError(f"rope_type {obj.rope_type!r} is not supported by the reference")
        if obj.rope_type in ("llama3", "yarn"):  # standardize_rope_params' default
            scaling.setdefault("original_max_position_embeddings", max_pos)
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported by the reference")
        obj.rope_scaling = scaling


def load_model(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Cfg(json.load(f))
    path = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(path):
        tensors = load_safetensors(path)
    else:
        with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
            index = json.load(f)
        tensors = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors.update(load_safetensors(os.path.join(model_dir, shard)))
    if cfg.family == "gpt2":  # the original gpt2 checkpoints lack the "transformer." prefix
        tensors = {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
                   for k, v in tensors.items()
                   if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    expected = param_shapes(cfg)
    if cfg.tie:
        tensors.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing tensors {missing[:8]}, unexpected {unexpected[:8]}")
    for k, shape in expected.items():
        if list(tensors[k].shape) != list(shape):
            raise ValueError(f"{model_dir}: {k} has shape {list(tensors[k].shape)}, want {shape}")
    return cfg, {k: tensors[k] for k in expected}


def param_shapes(cfg):
    """HF parameter names -> shapes, in HF's module order (lm_head absent when tied)."""
    s = {}
    H, V = cfg.hidden, cfg.vocab
    if cfg.family == "gpt2":
        s["transformer.wte.weight"] = [V, H]
        s["transformer.wpe.weight"] = [cfg.max_pos, H]
        for i in range(cfg.layers):
            p = f"transformer.h.{i}."
            s[p + "ln_1.weight"] = [H]
            s[p + "ln_1.bias"] = [H]
            s[p + "attn.c_attn.weight"] = [H, 3 * H]  # Conv1D: [in, out]
            s[p + "attn.c_attn.bias"] = [3 * H]
            s[p + "attn.c_proj.weight"] = [H, H]
            s[p + "attn.c_proj.bias"] = [H]
            s[p + "ln_2.weight"] = [H]
            s[p + "ln_2.bias"] = [H]
            s[p + "mlp.c_fc.weight"] = [H, cfg.inner]
            s[p + "mlp.c_fc.bias"] = [cfg.inner]
            s[p + "mlp.c_proj.weight"] = [cfg.inner, H]
            s[p + "mlp.c_proj.bias"] = [H]
        s["transformer.ln_f.weight"] = [H]
        s["transformer.ln_f.bias"] = [H]
        if not cfg.tie:
            s["lm_head.weight"] = [V, H]
        return s
    d, nq, nkv, I = cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.inter
    s["model.embed_tokens.weight"] = [V, H]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        for name, out, inp, bias in (("q_proj", nq * d, H, cfg.qkv_bias),
                                     ("k_proj", nkv * d, H, cfg.qkv_bias),
                                     ("v_proj", nkv * d, H, cfg.qkv_bias),
                                     ("o_proj", H, nq * d, cfg.o_bias)):
            s[p + f"self_attn.{name}.weight"] = [out, inp]
            if bias:
                s[p + f"self_attn.{name}.bias"] = [out]
        if cfg.qk_norm:  # 1-d: never a linear layer, so never a LoRA target
            s[p + "self_attn.q_norm.weight"] = [d]
            s[p + "self_attn.k_norm.weight"] = [d]
        for name, out, inp in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
            s[p + f"mlp.{name}.weight"] = [out, inp]
            if cfg.mlp_bias:
                s[p + f"mlp.{name}.bias"] = [out]
        s[p + "input_layernorm.weight"] = [H]
        s[p + "post_attention_layernorm.weight"] = [H]
        if cfg.sandwich:  # Gemma2/Gemma3DecoderLayer's sandwich norms around the MLP
            s[p + "pre_feedforward_layernorm.weight"] = [H]
            s[p + "post_feedforward_layernorm.weight"] = [H]
    s["model.norm.weight"] = [H]
    if not cfg.tie:
        s["lm_head.weight"] = [V, H]
    return s


def linear_modules(cfg):
    """Module name -> (in_features, out_features, is_conv1d) for every LoRA-able layer."""
    m = {}
    shapes = param_shapes(cfg)
    for k, shape in shapes.items():
        if not k.endswith(".weight") or len(shape) != 2 or "wte" in k or "wpe" in k \
                or "embed_tokens" in k:
            continue
        name = k[:-len(".weight")]
        if cfg.family == "gpt2" and name != "lm_head":
            m[name] = (shape[0], shape[1], True)
        else:
            m[name] = (shape[1], shape[0], False)
    if cfg.tie:
        m["lm_head"] = (cfg.hidden, cfg.vocab, False)
    return m


# ----------------------------------------------------------------------------- LoRA (PEFT)

def peft_target_matches(name, targets):
    """PEFT check_target_module_exists: a str is a full regex match; a list matches the
    exact name or a '.'-suffix of it. 'all-linear' = every linear layer but the output layer."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return name != "lm_head"
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def pattern_value(patterns, name, default):
    r"""PEFT's get_pattern_key: the value of the first key (in order) matching the module's name
    as (.*\.)?(key)$, else the default."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


class Lora:
    autocast = False  # the adapters' linears under torch.autocast (forward --autocast)

    def rank_and_alpha(self, name):
        return int(pattern_value(self.rank_pattern, name, self.r)), \
            float(pattern_value(self.alpha_pattern, name, self.alpha))

    def __init__(self, adapter_dir, cfg):
        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            self.config = c = json.load(f)
        if c.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type {c.get('peft_type')} is not LORA")
        if c.get("layers_to_transform") is not None:
            raise ValueError("layers_to_transform is not supported by the reference")
        bias = c.get("bias") or "none"
        if bias not in ("none", "all", "lora_only"):
            raise ValueError(f"bias {bias!r} is not one of PEFT's (none, all, lora_only)")
        self.r = int(c["r"])
        self.dora = bool(c.get("use_dora"))
        self.alpha = float(c["lora_alpha"])
        self.rslora = bool(c.get("use_rslora"))
        self.scaling = self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r
        # PEFT's rank_pattern / alpha_pattern: the first key (in the file's order) that matches a
        # module's name as (.*\.)?(key)$ gives its rank / alpha.
        self.rank_pattern = c.get("rank_pattern") or {}
        self.alpha_pattern = c.get("alpha_pattern") or {}
        self.scalings = {}
        raw = load_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
        self.tensors = {}  # PEFT key -> tensor
        # modules_to_save (PEFT's ModulesToSaveWrapper): modules whose name ends with an entry
        # are replaced by the adapter's copies, saved as "base_model.model.<param name>".
        self.full = {}  # HF param name -> tensor
        self.full_keys = {}  # HF param name -> its key in the adapter file
        mts = c.get("modules_to_save") or []
        lin = linear_modules(cfg)
        targets = c["target_modules"]
        targeted = {name for name in lin if peft_target_matches(name, targets)}
        for pname in param_shapes(cfg):
            module = pname.rsplit(".", 1)[0]
            key = None
            if any(module.endswith(e) for e in mts):
                key = f"base_model.model.{pname}"
            # PEFT's bias: "all" trains every parameter named *.bias, "lora_only" the targeted
            # modules' biases; a targeted module's bias is saved on its base layer.
            elif pname.endswith(".bias") and (bias == "all" or (bias == "lora_only" and module in targeted)):
                key = f"base_model.model.{module}.base_layer.bias" if module in targeted \
                    else f"base_model.model.{pname}"
            if key is None:
                continue
            if key not in raw:
                raise ValueError(f"modules_to_save or bias {bias!r} selects {pname} but the adapter lacks {key}")
            self.full[pname] = raw.pop(key)
            self.full_keys[pname] = key
        for k, v in raw.items():
            k = k.replace(".lora_A.default.weight", ".lora_A.weight") \
                 .replace(".lora_B.default.weight", ".lora_B.weight")
            self.tensors[k] = v
        self.modules = {}  # module name -> (A key, B key, DoRA magnitude key or None)
        for name, (fin, fout, _) in lin.items():
            if not peft_target_matches(name, targets):
                continue
            r, alpha = self.rank_and_alpha(name)
            self.scalings[name] = alpha / math.sqrt(r) if self.rslora else alpha / r
            a = f"base_model.model.{name}.lora_A.weight"
            b = f"base_model.model.{name}.lora_B.weight"
            if a not in self.tensors or b not in self.tensors:
                raise ValueError(f"adapter lacks {a} / {b}")
            if list(self.tensors[a].shape) != [r, fin] or \
                    list(self.tensors[b].shape) != [fout, r]:
                raise ValueError(f"{name}: lora_A {list(self.tensors[a].shape)} lora_B "
                                 f"{list(self.tensors[b].shape)}, want [{r},{fin}] "
                                 f"[{fout},{r}]")
            m = None
            if self.dora:  # PEFT saves the magnitude as "<module>.lora_magnitude_vector" ([out])
                m = f"base_model.model.{name}.lora_magnitude_vector"
                if m not in self.tensors or list(self.tensors[m].shape) != [fout]:
                    raise ValueError(f"use_dora: adapter lacks {m} of shape [{fout}]")
            self.modules[name] = (a, b, m)
        used = {k for ab in self.modules.values() for k in ab if k is not None}
        extra = [k for k in self.tensors if k not in used]
        if extra:
            raise ValueError(f"adapter tensors match no target module: {extra[:8]}")
        if not self.modules:
            raise ValueError(f"target_modules {targets} match no layer")


# ----------------------------------------------------------------------------- model math

def yarn_factor_and_original(cfg):
    """transformers 5's yarn: original_max_position_embeddings defaults to the model's
    max_position_embeddings, and a missing factor to max_position_embeddings / original."""
    sc = cfg.rope_scaling
    orig = sc.get("original_max_position_embeddings") or cfg.max_pos
    factor = sc.get("factor")
    if factor is None:
        factor = cfg.max_pos / orig
    return float(factor), float(orig)


def rope_attention_scaling(cfg):
    """HF's attention_scaling: the factor cos and sin are multiplied by (yarn's mscale)."""
    if cfg.rope_type != "yarn":
        return 1.0
    sc = cfg.rope_scaling
    factor, _ = yarn_factor_and_original(cfg)
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    ms, ms_all = sc.get("mscale"), sc.get("mscale_all_dim")
    if ms and ms_all:
        return float(get_mscale(factor, ms) / get_mscale(factor, ms_all))
    return get_mscale(factor)


def rope_inv_freq(cfg, seq_len=None):
    """inv_freq as HF computes it (fp32), with linear / llama3 / yarn / dynamic scaling applied.
    dynamic (NTK): the base grows with the longest sequence of the forward (`seq_len`) past
    max_position_embeddings, as on a freshly loaded transformers model's first forward."""
    d = cfg.head_dim
    base = cfg.rope_theta
    sc = cfg.rope_scaling
    if cfg.rope_type == "dynamic":
        L = max(seq_len or 0, cfg.max_pos)
        f = float(sc["factor"])
        base = base * ((f * L / cfg.max_pos) - (f - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / float(sc["factor"])
    elif cfg.rope_type == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif cfg.rope_type == "yarn":
        # YaRN (Peng et al. 2023), "NTK-by-parts": per dimension, the number of rotations over
        # the original context decides between the original and the interpolated frequency.
        factor, orig = yarn_factor_and_original(cfg)
        beta_fast = sc.get("beta_fast") or 32
        beta_slow = sc.get("beta_slow") or 1
        base = cfg.rope_theta

        def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times
            return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))
        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq


def rope_cos_sin(cfg, position_ids, dtype):
    inv = rope_inv_freq(cfg, int(position_ids.max()) + 1)  # (d/2,) fp32
    freqs = position_ids.float()[..., None] * inv[None, None, :]  # (B,T,d/2) fp32 like HF
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope_attention_scaling(cfg)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rms_norm(x, w, eps):
    dt = x.dtype
    up = torch.float64 if dt == torch.float64 else torch.float32
    h = x.to(up)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def gemma_rms_norm(x, w, eps):
    """Gemma(3)RMSNorm: normalised and scaled by (1 + w) in max(fp32, dtype), rounded once at the
    end (Llama's rms_norm rounds before multiplying by w)."""
    dt = x.dtype
    up = torch.float64 if dt == torch.float64 else torch.float32
    h = x.to(up)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.to(up))).to(dt)


def gemma_embed_scale(hidden, dtype):
    """GemmaTextScaledWordEmbedding's factor: a 0-d buffer sqrt(hidden) (fp32; float64 in a model
    loaded as float64) taken to the weight's dtype before the multiply: bf16 makes sqrt(3072)
    = 55.43 into 55.5."""
    return torch.tensor(hidden ** 0.5, dtype=torch.float64 if dtype == torch.float64
                        else torch.float32).to(dtype)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def attention_mask(segment_ids, sliding_window=None):
    """(B,1,T,T) bool: causal, same segment (>= 0), within the window; diagonal always on."""
    T = segment_ids.shape[1]
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    causal = (k <= q)
    if sliding_window is not None:
        causal = causal & (k > q - sliding_window)
    seg = segment_ids
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0)
    m = (causal[None] & same) | torch.eye(T, dtype=torch.bool)[None]
    return m[:, None]


def attend(q, k, v, mask, scale, softcap=None):
    """q (B,H,T,d), k/v (B,H,T,d) already repeated; softmax in max(fp32, dtype). softcap (Gemma 2):
    the scaled scores become softcap * tanh(scores / softcap) before the mask, each op (divide,
    tanh, multiply) in the compute dtype as eager_attention_forward does them."""
    dt = q.dtype
    up = torch.float64 if dt == torch.float64 else torch.float32
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.to(up).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(dt)
    return torch.matmul(p, v)


def repeat_kv(x, n_rep):
    b, nkv, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, nkv, n_rep, t, d).reshape(b, nkv * n_rep, t, d)


class Forward:
    """Functional forward over a dict of parameters (HF names) plus optional LoRA tensors."""

    def __init__(self, cfg, params, lora=None, lora_params=None):
        self.cfg, self.p, self.lora, self.lp = cfg, params, lora, lora_params

    def linear(self, name, x):
        conv1d = self.cfg.family == "gpt2" and name != "lm_head"
        w = self.p["transformer.wte.weight" if self.cfg.family == "gpt2" else
                   "model.embed_tokens.weight"] if (name == "lm_head" and self.cfg.tie) \
            else self.p[name + ".weight"]
        b = self.p.get(name + ".bias")
        if x.dtype in (torch.bfloat16, torch.float16):
            # A 16-bit model rounds once per product, the bias inside it: PyTorch 2's F.linear on
            # a contiguous 3-d input and GPT-2's Conv1D (addmm) both multiply the rows as one matrix.
            x2 = x.reshape(-1, x.shape[-1])
            wt = w if conv1d else w.t()
            y = (torch.addmm(b, x2, wt) if b is not None else torch.mm(x2, wt)).view(*x.shape[:-1], -1)
        else:
            y = torch.matmul(x, w) if conv1d else torch.matmul(x, w.t())
            if b is not None:
                y = y + b
        if self.lora is not None and name in self.lora.modules:
            a_key, b_key, m_key = self.lora.modules[name]
            A, B = self.lp[a_key], self.lp[b_key]
            if m_key is not None:
                return self.dora(y, x, w.t() if conv1d else w, b, A, B, self.lp[m_key], self.lora.scalings[name])
            # PEFT: the adapter takes x in its own dtype (fp32 adapters on a 16-bit model,
            # autocast_adapter_dtype), the sum is formed in the wider dtype and rounded back.
            xa = x.to(A.dtype)
            if self.lora.autocast and x.dtype in (torch.bfloat16, torch.float16):
                # Under the Trainer's bf16 / fp16 autocast PyTorch's autocast casts x, A and B to
                # 16 bits for each linear; the sum is then of two 16-bit tensors.
                with torch.autocast("cpu", dtype=x.dtype):
                    y = y + F.linear(F.linear(xa, A), B) * self.lora.scalings[name]
            else:
                y = (y + torch.matmul(torch.matmul(xa, A.t()), B.t()) * self.lora.scalings[name]).to(y.dtype)
        return y

    def dora(self, y, x, w, b, A, B, m, s):
        """DoRA (Liu et al. 2024, as PEFT's use_dora): the adapted weight W + s B A rescaled row
        by row to the magnitude m, its row norms n treated as constants:
        y' = m/n * (x W^T + s x A^T B^T) + b, formed from the base output y as PEFT forms it,
        y + (m/n - 1) (y - b) + (m/n) s (x A^T B^T), in the adapter's dtype and rounded to y's."""
        xa = x.to(A.dtype)
        cast = self.lora.autocast and x.dtype in (torch.bfloat16, torch.float16)
        # B A in the products' dtype (16 bits under autocast), taken to the adapter's.
        BA = (B.to(x.dtype) @ A.to(x.dtype)).to(A.dtype) if cast else B @ A
        n = torch.linalg.norm(w.to(A.dtype) + s * BA, dim=1).detach()
        scale = (m / n).view(1, -1)
        if cast:
            with torch.autocast("cpu", dtype=x.dtype):
                ab = F.linear(F.linear(xa, A), B)
        else:
            ab = torch.matmul(torch.matmul(xa, A.t()), B.t())
        base = y - b if b is not None else y
        return (y + ((scale - 1) * base + scale * ab * s)).to(y.dtype)

    def __call__(self, input_ids, position_ids, segment_ids):
        if self.cfg.family == "gpt2":
            return self.gpt2(input_ids, position_ids, segment_ids)
        if self.cfg.gemma:
            return self.gemma(input_ids, position_ids, segment_ids)
        return self.llama(input_ids, position_ids, segment_ids)

    def gemma(self, input_ids, position_ids, segment_ids):
        """GemmaForCausalLM / Gemma2ForCausalLM / Gemma3ForCausalLM. Gemma: Llama's layer with
        Gemma's norm, GELU MLP and sqrt(hidden)-scaled embedding. Gemma 2 adds a norm after
        attention and around the MLP (both before the residual add), attention scale
        query_pre_attn_scalar^-0.5, per layer type its mask (sliding: keys q-W+1 .. q), and
        soft-capping of the attention scores and of the logits. Gemma 3: Gemma 2 with q_norm /
        k_norm, a RoPE per layer type (sliding: rope_local_base_freq; full: rope_theta with its
        scaling), and only the logits soft-capped."""
        c, p = self.cfg, self.p
        B, T = input_ids.shape
        W = p["model.embed_tokens.weight"]
        h = W[input_ids] if c.padding_idx is None else F.embedding(input_ids, W, c.padding_idx)
        h = h * gemma_embed_scale(c.hidden, W.dtype)
        act = (lambda t: F.gelu(t, approximate="tanh")) if c.act == "gelu_pytorch_tanh" else F.gelu
        rope, masks = {}, {}
        for t in set(c.layer_types):
            cos, sin = rope_cos_sin(c.rope[t], position_ids, h.dtype)
            rope[t] = cos[:, None], sin[:, None]
            masks[t] = attention_mask(segment_ids, c.sliding_window if t == "sliding_attention" else None)
        d, nq, nkv = c.head_dim, c.heads, c.kv_heads
        for i in range(c.layers):
            pre = f"model.layers.{i}."
            cos, sin = rope[c.layer_types[i]]
            x = gemma_rms_norm(h, p[pre + "input_layernorm.weight"], c.eps)
            q = self.linear(pre + "self_attn.q_proj", x).view(B, T, nq, d)
            k = self.linear(pre + "self_attn.k_proj", x).view(B, T, nkv, d)
            if c.qk_norm:  # Gemma 3: per-head Gemma norm over head_dim, before RoPE
                q = gemma_rms_norm(q, p[pre + "self_attn.q_norm.weight"], c.eps)
                k = gemma_rms_norm(k, p[pre + "self_attn.k_norm.weight"], c.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self.linear(pre + "self_attn.v_proj", x).view(B, T, nkv, d).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k, v = repeat_kv(k, nq // nkv), repeat_kv(v, nq // nkv)
            o = attend(q, k, v, masks[c.layer_types[i]], c.attn_scale, c.attn_softcap)
            o = self.linear(pre + "self_attn.o_proj", o.transpose(1, 2).reshape(B, T, nq * d))
            if c.sandwich:
                o = gemma_rms_norm(o, p[pre + "post_attention_layernorm.weight"], c.eps)
                h = h + o
                x = gemma_rms_norm(h, p[pre + "pre_feedforward_layernorm.weight"], c.eps)
            else:
                h = h + o
                x = gemma_rms_norm(h, p[pre + "post_attention_layernorm.weight"], c.eps)
            m = self.linear(pre + "mlp.down_proj", act(self.linear(pre + "mlp.gate_proj", x)) *
                            self.linear(pre + "mlp.up_proj", x))
            if c.sandwich:
                m = gemma_rms_norm(m, p[pre + "post_feedforward_layernorm.weight"], c.eps)
            h = h + m
        h = gemma_rms_norm(h, p["model.norm.weight"], c.eps)
        logits = self.linear("lm_head", h)
        if c.final_softcap is not None:  # in the compute dtype; the loss upcasts afterwards
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def llama(self, input_ids, position_ids, segment_ids):
        c, p = self.cfg, self.p
        B, T = input_ids.shape
        h = p["model.embed_tokens.weight"][input_ids]
        cos, sin = rope_cos_sin(c, position_ids, h.dtype)
        cos, sin = cos[:, None], sin[:, None]
        mask = attention_mask(segment_ids, c.sliding_window)
        d, nq, nkv = c.head_dim, c.heads, c.kv_heads
        for i in range(c.layers):
            pre = f"model.layers.{i}."
            x = rms_norm(h, p[pre + "input_layernorm.weight"], c.eps)
            q = self.linear(pre + "self_attn.q_proj", x).view(B, T, nq, d)
            k = self.linear(pre + "self_attn.k_proj", x).view(B, T, nkv, d)
            if c.qk_norm:  # Qwen3: per-head RMSNorm on the (B,T,H,D) view, before RoPE
                q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], c.eps)
                k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], c.eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = self.linear(pre + "self_attn.v_proj", x).view(B, T, nkv, d).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k, v = repeat_kv(k, nq // nkv), repeat_kv(v, nq // nkv)
            o = attend(q, k, v, mask, d ** -0.5)
            o = o.transpose(1, 2).reshape(B, T, nq * d)
            h = h + self.linear(pre + "self_attn.o_proj", o)
            x = rms_norm(h, p[pre + "post_attention_layernorm.weight"], c.eps)
            g = self.linear(pre + "mlp.gate_proj", x)
            u = self.linear(pre + "mlp.up_proj", x)
            h = h + self.linear(pre + "mlp.down_proj", F.silu(g) * u)
        h = rms_norm(h, p["model.norm.weight"], c.eps)
        return self.linear("lm_head", h)

    def gpt2(self, input_ids, position_ids, segment_ids):
        c, p = self.cfg, self.p
        B, T = input_ids.shape
        H, nh, d = c.hidden, c.heads, c.head_dim
        h = p["transformer.wte.weight"][input_ids] + p["transformer.wpe.weight"][position_ids]
        mask = attention_mask(segment_ids)
        # gelu_new: NewGELUActivation's formula, op by op; gelu_pytorch_tanh: F.gelu's tanh form
        # (one function, two roundings of it in 16 bits).
        act = gelu_new if c.act == "gelu_new" else \
            (lambda t: F.gelu(t, approximate="tanh")) if c.act == "gelu_pytorch_tanh" else F.gelu
        for i in range(c.layers):
            pre = f"transformer.h.{i}."
            x = F.layer_norm(h, (H,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], c.eps)
            qkv = self.linear(pre + "attn.c_attn", x)
            q, k, v = qkv.split(H, dim=2)
            q, k, v = (t.view(B, T, nh, d).transpose(1, 2) for t in (q, k, v))
            scale = (d ** -0.5) if c.scale_attn_weights else 1.0
            if c.scale_by_layer:
                scale = scale / float(i + 1)
            o = attend(q, k, v, mask, scale).transpose(1, 2).reshape(B, T, H)
            h = h + self.linear(pre + "attn.c_proj", o)
            x = F.layer_norm(h, (H,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], c.eps)
            h = h + self.linear(pre + "mlp.c_proj", act(self.linear(pre + "mlp.c_fc", x)))
        h = F.layer_norm(h, (H,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], c.eps)
        return self.linear("lm_head", h)


def causal_lm_loss(logits, targets):
    """Mean cross-entropy over targets != -100 (targets already shifted)."""
    if int((targets != IGNORE).sum()) == 0:
        raise ValueError("batch has no targets (all -100): the mean loss is undefined")
    up = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(up).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="mean")


def load_batch(path):
    b = load_safetensors(path)
    for k in ("input_ids", "targets", "position_ids", "segment_ids"):
        if k not in b:
            raise ValueError(f"{path}: missing {k}")
        b[k] = b[k].to(torch.int64)
    shape = b["input_ids"].shape
    for k in ("targets", "position_ids", "segment_ids"):
        if b[k].shape != shape:
            raise ValueError(f"{path}: {k} shape {list(b[k].shape)} != input_ids {list(shape)}")
    return b


def run_forward(cfg, base, batch, lora=None, lora_tensors=None, dtype=torch.float64,
                want_grad=True):
    """Returns (logits, loss, grads dict name -> grad) with grads for base params (no LoRA) or
    for the LoRA tensors (with LoRA)."""
    params = {}
    for k, v in base.items():
        t = v.to(dtype)
        if want_grad and lora is None:
            t.requires_grad_(True)
        params[k] = t
    lp = None
    # PEFT's adapters on a 16-bit model are fp32 (get_peft_model's autocast_adapter_dtype).
    adapter_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if lora is not None:
        lp = {}
        for k, v in lora_tensors.items():
            t = v.to(adapter_dtype)
            if want_grad:
                t.requires_grad_(True)
            lp[k] = t
    if lora is not None:
        for k, v in lora.full.items():  # modules_to_save: the adapter's copies replace the base's
            params[k] = v.to(dtype).requires_grad_(want_grad)
            lp[lora.full_keys[k]] = params[k]
    fwd = Forward(cfg, params, lora, lp)
    with torch.set_grad_enabled(want_grad):
        logits = fwd(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        loss = causal_lm_loss(logits, batch["targets"])
    grads = {}
    if want_grad:
        leaves = lp if lora is not None else params
        names = list(leaves)
        gs = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        for n, g in zip(names, gs):
            grads[n] = torch.zeros_like(leaves[n]) if g is None else g
    return logits.detach(), loss.detach(), grads


# ----------------------------------------------------------------------------- init

def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def init_params(cfg, seed, init_std=None):
    """Random weights. Default std 0.8/sqrt(fan_in) so attention is far from uniform and every
    term matters; norm weights U(0.6, 1.4) (Gemma's, which scale by 1 + w: U(-0.4, 0.4)),
    biases N(0, 0.1)."""
    g = _gen(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight") or re.search(r"ln_\w+\.weight$", name):
            t = (-0.4 if cfg.gemma else 0.6) + 0.8 * torch.rand(shape, generator=g, dtype=torch.float64)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            if init_std is not None:
                std = init_std
            elif cfg.family == "gpt2" and name.endswith(".weight") and "wte" not in name \
                    and "wpe" not in name and name != "lm_head.weight":
                std = 0.8 / math.sqrt(shape[0])  # Conv1D [in, out]
            else:
                std = 0.8 / math.sqrt(shape[1])  # Linear [out, in] / embedding [V, H]
            t = std * torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = t.float()
    return out


def make_config(a):
    arch = a.arch
    if arch == "gpt2":
        heads = a.heads or 4
        return {
            "activation_function": "gelu_new",
            "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.0,
            "bos_token_id": a.vocab - 1,
            "embd_pdrop": 0.0,
            "eos_token_id": a.vocab - 1,
            "initializer_range": 0.02,
            "layer_norm_epsilon": a.eps if a.eps is not None else 1e-5,
            "model_type": "gpt2",
            "n_embd": a.hidden,
            "n_head": heads,
            "n_inner": a.intermediate,
            "n_layer": a.layers,
            "n_positions": a.max_pos,
            "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0,
            "scale_attn_by_inverse_layer_idx": False,
            "scale_attn_weights": True,
            "summary_activation": None,
            "summary_first_dropout": 0.0,
            "summary_proj_to_labels": True,
            "summary_type": "cls_index",
            "summary_use_proj": True,
            "tie_word_embeddings": True,
            "torch_dtype": a.save_dtype,
            "transformers_version": "4.46.0",
            "use_cache": True,
            "vocab_size": a.vocab,
        }
    heads = a.heads or 4
    kv = a.kv_heads or (2 if heads % 2 == 0 else heads)
    head_dim = a.head_dim or a.hidden // heads
    scaling = json.loads(a.rope_scaling) if a.rope_scaling else None
    if getattr(a, "gemma", False) or getattr(a, "gemma2", False) or getattr(a, "gemma3", False):
        return make_gemma_config(a, heads, kv, head_dim, scaling)
    theta = a.rope_theta if a.rope_theta is not None else 10000.0
    kind = "qwen2" if a.qwen2 else "mistral" if a.mistral else \
        "qwen3" if getattr(a, "qwen3", False) else "llama"
    c = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": a.hidden,
        "initializer_range": 0.02,
        "intermediate_size": a.intermediate or 2 * a.hidden,
        "max_position_embeddings": a.max_pos,
        "model_type": kind,
        "num_attention_heads": heads,
        "num_hidden_layers": a.layers,
        "num_key_value_heads": kv,
        "rms_norm_eps": a.eps if a.eps is not None else 1e-6,
        "tie_word_embeddings": bool(a.tie),
        "torch_dtype": a.save_dtype,
        "transformers_version": "4.46.0",
        "use_cache": True,
        "vocab_size": a.vocab,
    }
    if kind == "llama":
        c.update({"attention_bias": bool(a.attention_bias), "mlp_bias": bool(a.mlp_bias),
                  "pretraining_tp": 1, "head_dim": head_dim})
    elif kind == "mistral":
        c.update({"head_dim": head_dim, "sliding_window": a.sliding_window})
    elif kind == "qwen3":
        # head_dim always written: Qwen3Config's default is 128, not hidden / heads.
        c.update({"attention_bias": bool(a.attention_bias), "head_dim": head_dim,
                  "max_window_layers": a.layers, "sliding_window": a.sliding_window,
                  "use_sliding_window": False, "transformers_version": "4.51.0"})
    else:
        c.update({"max_window_layers": a.layers, "sliding_window": a.sliding_window or 4096,
                  "use_sliding_window": False})
        if a.head_dim:
            c["head_dim"] = head_dim
    if a.rope_parameters:
        rp = {"rope_theta": theta, "rope_type": "default"}
        if scaling:
            rp.update(scaling)
            rp["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
            rp.pop("type", None)
        c["rope_parameters"] = rp
    else:
        c["rope_theta"] = theta
        c["rope_scaling"] = scaling
    return c


GEMMA_LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention",
                     "sliding_attention": "sliding_attention", "full_attention": "full_attention"}


def make_gemma_config(a, heads, kv, head_dim, scaling):
    """config.json of GemmaForCausalLM (--gemma), Gemma2ForCausalLM (--gemma2) or Gemma3ForCausalLM
    (--gemma3), every key the forward reads written out (Gemma 2: every key Gemma2Config saves);
    pad_token_id null (no padding_idx) unless --pad-token-id."""
    mt = "gemma3_text" if getattr(a, "gemma3", False) else \
        "gemma2" if getattr(a, "gemma2", False) else "gemma"
    if scaling:  # rope_type spelled out: Gemma3TextConfig ignores a top-level "type"
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
    act = getattr(a, "hidden_act", None) or "gelu_pytorch_tanh"
    c = {
        "architectures": [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                           "gemma3_text": "Gemma3ForCausalLM"}[mt]],
        "attention_bias": bool(a.attention_bias),
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "head_dim": head_dim,
        "hidden_act" if mt == "gemma" else "hidden_activation": act,
        "hidden_size": a.hidden,
        "initializer_range": 0.02,
        "intermediate_size": a.intermediate or 2 * a.hidden,
        "max_position_embeddings": a.max_pos,
        "model_type": mt,
        "num_attention_heads": heads,
        "num_hidden_layers": a.layers,
        "num_key_value_heads": kv,
        "pad_token_id": getattr(a, "pad_token_id", None),
        "rms_norm_eps": a.eps if a.eps is not None else 1e-6,
        "tie_word_embeddings": bool(a.tie),
        "torch_dtype": a.save_dtype,
        "transformers_version": "4.50.0" if mt == "gemma3_text" else "4.46.0",
        "use_cache": True,
        "vocab_size": a.vocab,
    }
    if mt != "gemma":
        if getattr(a, "layer_types", None):
            types = [GEMMA_LAYER_TYPES[t.strip()] for t in a.layer_types.split(",")]
        elif mt == "gemma2":  # Gemma2Config's default: even layers sliding, odd ones full
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(a.layers)]
        else:  # Gemma3TextConfig's default pattern: every 6th layer full
            types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(a.layers)]

        def softcap(value, default):  # --attn-softcap / --final-softcap: unset = the config's default
            return default if value is None else None if value == "none" else float(value)
        qpas = getattr(a, "query_pre_attn_scalar", None)
        c.update({
            "attn_logit_softcapping": softcap(getattr(a, "attn_softcap", None), 50.0 if mt == "gemma2" else None),
            "final_logit_softcapping": softcap(getattr(a, "final_softcap", None), 30.0 if mt == "gemma2" else None),
            "layer_types": types,
            "query_pre_attn_scalar": qpas if qpas is not None else head_dim,
            "sliding_window": a.sliding_window if a.sliding_window is not None else 4096,
            # Gemma2Config's default is None, Gemma3TextConfig's False.
            "use_bidirectional_attention": None if mt == "gemma2" else False,
        })
    if mt != "gemma3_text":  # one RoPE for every layer
        theta = a.rope_theta if a.rope_theta is not None else 10000.0
        if a.rope_parameters:
            c["rope_parameters"] = dict({"rope_theta": theta, "rope_type": "default"}, **(scaling or {}))
        else:
            c["rope_theta"] = theta
            c["rope_scaling"] = scaling
        return c
    theta = a.rope_theta if a.rope_theta is not None else 1e6
    local = a.rope_local_theta if getattr(a, "rope_local_theta", None) is not None else 1e4
    if a.rope_parameters:
        c["rope_parameters"] = {
            "full_attention": dict({"rope_theta": theta, "rope_type": "default"}, **(scaling or {})),
            "sliding_attention": {"rope_theta": local, "rope_type": "default"}}
    else:
        c.update({"rope_theta": theta, "rope_scaling": scaling, "rope_local_base_freq": local})
    return c


def cmd_init(a):
    os.makedirs(a.out, exist_ok=True)
    conf = make_config(a)
    cfg = Cfg(conf)
    params = init_params(cfg, a.seed, a.init_std)
    dt = _DTYPE_ARG[a.save_dtype]
    write_json(os.path.join(a.out, "config.json"), conf)
    save_safetensors(os.path.join(a.out, "model.safetensors"),
                     {k: v.to(dt) for k, v in params.items()}, {"format": "pt"})
    print(f"wrote {a.out}: {len(params)} tensors, "
          f"{sum(v.numel() for v in params.values())} parameters")


def cmd_init_lora(a):
    cfg, _ = load_model(a.model)
    targets = a.targets if a.targets == "all-linear" or "," not in a.targets and \
        any(ch in a.targets for ch in "*.|()[]") else a.targets.split(",")
    lin = linear_modules(cfg)
    names = [n for n in lin if peft_target_matches(n, targets)]
    if not names:
        raise SystemExit(f"--targets {a.targets} match no layer of {a.model}")
    g = _gen(a.seed)
    tensors = {}
    # In the order the file will hold them: PEFT writes adapter_config.json with sorted keys, and
    # the first pattern in the file's order decides when PEFT (or memtune) reads it back.
    rank_pattern = dict(sorted(json.loads(a.rank_pattern).items()))
    alpha_pattern = dict(sorted(json.loads(a.alpha_pattern).items()))
    for n in names:
        fin, fout, _ = lin[n]
        r = int(pattern_value(rank_pattern, n, a.r))
        A = torch.randn(r, fin, generator=g, dtype=torch.float64) / math.sqrt(fin)
        B = 0.25 * torch.randn(fout, r, generator=g, dtype=torch.float64) / math.sqrt(r)
        tensors[f"base_model.model.{n}.lora_A.weight"] = A.float()
        tensors[f"base_model.model.{n}.lora_B.weight"] = B.float()
    if a.dora:
        # DoRA's magnitude: PEFT starts it at ||W + s B A|| per row; here it is moved off that by
        # 20 % so that m / n - 1 matters.
        _, base = load_model(a.model)
        for n in names:
            r = int(pattern_value(rank_pattern, n, a.r))
            alpha = float(pattern_value(alpha_pattern, n, a.alpha))
            scaling = alpha / math.sqrt(r) if a.rslora else alpha / r
            w = base[n + ".weight"].double()
            if lin[n][2]:  # Conv1D: [in, out]
                w = w.t()
            BA = tensors[f"base_model.model.{n}.lora_B.weight"].double() @ \
                tensors[f"base_model.model.{n}.lora_A.weight"].double()
            norm = torch.linalg.norm(w + scaling * BA, dim=1)
            tensors[f"base_model.model.{n}.lora_magnitude_vector"] = (
                norm * (1 + 0.2 * torch.randn(norm.shape, generator=g, dtype=torch.float64))).float()
    mts = a.modules_to_save.split(",") if a.modules_to_save else None
    if mts:
        _, base = load_model(a.model)
        for pname, t in base.items():
            if any(pname.rsplit(".", 1)[0].endswith(e) for e in mts):
                tensors[f"base_model.model.{pname}"] = (
                    t.double() + 0.1 * t.double().std() * torch.randn(t.shape, generator=g, dtype=torch.float64)).float()
    if a.bias != "none":  # the biases PEFT's bias trains, moved off the base's values
        _, base = load_model(a.model)
        for pname, t in base.items():
            module = pname.rsplit(".", 1)[0]
            if pname.endswith(".bias") and (a.bias == "all" or module in names):
                key = f"base_model.model.{module}.base_layer.bias" if module in names else f"base_model.model.{pname}"
                tensors[key] = (t.double() + 0.1 * torch.randn(t.shape, generator=g, dtype=torch.float64)).float()
    conv = any(lin[n][2] for n in names)
    conf = {
        "alpha_pattern": alpha_pattern, "auto_mapping": None,
        "base_model_name_or_path": os.path.abspath(a.model),
        "bias": a.bias, "fan_in_fan_out": bool(conv), "inference_mode": False,
        "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
        "lora_alpha": int(a.alpha) if float(a.alpha).is_integer() else a.alpha, "lora_dropout": 0.0, "modules_to_save": mts,
        "peft_type": "LORA", "r": a.r, "rank_pattern": rank_pattern, "revision": None,
        "target_modules": targets, "task_type": "CAUSAL_LM", "use_dora": bool(a.dora),
        "use_rslora": bool(a.rslora),
    }
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "adapter_config.json"), conf)
    save_safetensors(os.path.join(a.out, "adapter_model.safetensors"), tensors, {"format": "pt"})
    print(f"wrote {a.out}: {len(names)} LoRA modules")


def make_batch(rows, seq, vocab, seed, max_docs=3, min_doc=2, ignore_frac=0.1, pad=True):
    """Packed rows: documents back to back, positions restarting, the last token of each
    document predicting nothing, some targets masked, trailing padding on some rows."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((rows, seq), np.int64)
    tgt = np.full((rows, seq), IGNORE, np.int64)
    pos = np.zeros((rows, seq), np.int64)
    seg = np.full((rows, seq), -1, np.int64)
    for r in range(rows):
        used = seq - (int(rng.integers(1, max(2, seq // 4))) if pad and r % 2 == 1 else 0)
        ndocs = int(rng.integers(1, max_docs + 1))
        cuts = sorted(rng.choice(np.arange(min_doc, max(min_doc + 1, used - min_doc + 1)),
                                 size=min(ndocs - 1, max(0, used // min_doc - 1)),
                                 replace=False).tolist()) if ndocs > 1 else []
        cuts = [c for i, c in enumerate(cuts) if c - (cuts[i - 1] if i else 0) >= min_doc
                and used - c >= min_doc]
        bounds = [0] + cuts + [used]
        for s_i in range(len(bounds) - 1):
            b, e = bounds[s_i], bounds[s_i + 1]
            doc = rng.integers(0, vocab, size=e - b)
            ids[r, b:e] = doc
            pos[r, b:e] = np.arange(e - b)
            seg[r, b:e] = s_i
            tgt[r, b:e - 1] = doc[1:]
        ids[r, used:] = 0
    drop = (rng.random((rows, seq)) < ignore_frac) & (tgt != IGNORE)
    tgt[drop] = IGNORE
    if (tgt != IGNORE).sum() == 0:
        tgt[0, 0] = ids[0, 1]
    return {k: torch.from_numpy(v) for k, v in
            (("input_ids", ids), ("targets", tgt), ("position_ids", pos), ("segment_ids", seg))}


def cmd_make_batch(a):
    b = make_batch(a.rows, a.seq, a.vocab, a.seed, a.max_docs, a.min_doc, a.ignore_frac, a.pad)
    save_safetensors(a.out, b)
    print(f"wrote {a.out}: {a.rows}x{a.seq}, {int((b['targets'] != IGNORE).sum())} targets")


def cmd_forward(a):
    cfg, base = load_model(a.model)
    batch = load_batch(a.batch)
    lora = Lora(a.lora, cfg) if a.lora else None
    if lora is not None:
        lora.autocast = a.autocast
    logits, loss, grads = run_forward(cfg, base, batch, lora, lora.tensors if lora else None,
                                      _DTYPE_ARG[a.dtype], not a.no_grad)
    out = {"logits": logits.float(), "loss": loss.float().reshape(())}
    for k, g in grads.items():
        out[k + ".grad"] = g.float()
    save_safetensors(a.out, out)
    print(f"loss {loss.item():.10g}")


def cmd_train(a):
    cfg, base = load_model(a.model)
    batch = load_batch(a.batch)
    lora = Lora(a.lora, cfg)
    dtype = _DTYPE_ARG[a.dtype]
    full = {lora.full_keys[k]: v for k, v in lora.full.items()}  # modules_to_save, biases
    param_of = {lora.full_keys[k]: k for k in lora.full}
    names = list(lora.tensors) + list(full)
    master = {k: (lora.tensors[k] if k in lora.tensors else full[k]).float().clone().requires_grad_(True)
              for k in names}
    betas = tuple(float(x) for x in a.betas.split(","))
    # Hugging Face's Trainer: no weight decay on biases and norm weights.
    nodecay = [k for k in full if master[k].dim() < 2 or "norm" in k or "ln_" in k]
    groups = [{"params": [master[k] for k in names if k not in nodecay], "weight_decay": a.weight_decay},
              {"params": [master[k] for k in nodecay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=betas, eps=a.eps)
    params = {k: v.to(dtype) for k, v in base.items()}
    losses = []
    for step in range(a.steps + 1):
        lp = {k: master[k].to(dtype) for k in names}  # fp32 leaves, grads come back as fp32
        for k in full:
            params[param_of[k]] = lp[k]
        fwd = Forward(cfg, params, lora, lp)
        with torch.set_grad_enabled(step < a.steps):
            logits = fwd(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
            loss = causal_lm_loss(logits, batch["targets"])
        losses.append(loss.item())
        if step == a.steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([master[k] for k in names], a.max_grad_norm)
        opt.step()
        print(f"step {step} loss {losses[-1]:.10g}")
    print(f"final loss {losses[-1]:.10g}")
    write_json(a.out, {"losses": losses[:-1], "final_loss": losses[-1], "steps": a.steps,
                       "lr": a.lr, "betas": list(betas), "eps": a.eps,
                       "weight_decay": a.weight_decay, "max_grad_norm": a.max_grad_norm})
    if a.out_tensors:
        save_safetensors(a.out_tensors, {k: master[k].detach() for k in names},
                         {"format": "pt"})


# ----------------------------------------------------------------------------- selftest

class _Args:
    def __init__(self, **kw):
        d = dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48,
                 vocab=40, max_pos=64, head_dim=None, rope_theta=10000.0, rope_scaling=None,
                 rope_parameters=False, tie=False, attention_bias=False, mlp_bias=False,
                 qwen2=False, mistral=False, qwen3=False, sliding_window=None, eps=None,
                 save_dtype="float32", gemma=False, gemma2=False, gemma3=False, hidden_act=None,
                 layer_types=None, query_pre_attn_scalar=None, rope_local_theta=None,
                 pad_token_id=None, attn_softcap=None, final_softcap=None)
        d.update(kw)
        self.__dict__.update(d)


def _model(seed=0, **kw):
    cfg = Cfg(make_config(_Args(**kw)))
    return cfg, init_params(cfg, seed)


def _rand_lora(cfg, targets, r, alpha, rslora, seed, tmp, dora=False):
    lin = linear_modules(cfg)
    g = _gen(seed)
    t = {}
    for n in lin:
        if peft_target_matches(n, targets):
            fin, fout, _ = lin[n]
            t[f"base_model.model.{n}.lora_A.weight"] = torch.randn(r, fin, generator=g) / fin ** .5
            t[f"base_model.model.{n}.lora_B.weight"] = 0.3 * torch.randn(fout, r, generator=g)
            if dora:
                t[f"base_model.model.{n}.lora_magnitude_vector"] = 0.5 + torch.rand(fout, generator=g)
    os.makedirs(tmp, exist_ok=True)
    write_json(os.path.join(tmp, "adapter_config.json"),
               {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora, "use_dora": dora,
                "target_modules": targets, "bias": "none"})
    save_safetensors(os.path.join(tmp, "adapter_model.safetensors"), t)
    return Lora(tmp, cfg)


def naive_rope(x, p, spec):
    """RoPE of one head's vector x (d,) at position p, one pair (i, i + d/2) at a time."""
    d = len(x)
    inv = rope_inv_freq(spec).double().numpy()
    m = rope_attention_scaling(spec)
    out = x.copy()
    for i in range(d // 2):
        a = p * inv[i]
        out[i] = m * (x[i] * math.cos(a) - x[i + d // 2] * math.sin(a))
        out[i + d // 2] = m * (x[i + d // 2] * math.cos(a) + x[i] * math.sin(a))
    return out


def naive_numpy_forward(cfg, base, ids, pos, seg, qk_norm_after_rope=False):
    """A second, loop-per-token/head numpy implementation of one row (selftest only): written
    from the definitions, sharing nothing with Forward but inv_freq."""
    if cfg.gemma:
        return naive_numpy_gemma_forward(cfg, base, ids, pos, seg)
    P = {k: v.double().numpy() for k, v in base.items()}
    T, H = len(ids), cfg.hidden
    nq, nkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim

    def ln(x, w, b):
        mu = x.mean()
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean() + cfg.eps) * w + b

    def rms(x, w):
        return w * x / np.sqrt((x ** 2).mean() + cfg.eps)

    def rope(x, p):
        return naive_rope(x, p, cfg)

    def attn_row(qs, ks, vs, t, scale, kv_of):
        o = []
        for h in range(len(qs[0])):
            keys = [u for u in range(T) if u == t or (u <= t and seg[u] == seg[t] and seg[u] >= 0)]
            sc = np.array([qs[t][h] @ ks[u][kv_of(h)] * scale for u in keys])
            w = np.exp(sc - sc.max())
            w /= w.sum()
            o.append(sum(wi * vs[u][kv_of(h)] for wi, u in zip(w, keys)))
        return np.concatenate(o)

    if cfg.family == "gpt2":
        x = [P["transformer.wte.weight"][ids[t]] + P["transformer.wpe.weight"][pos[t]]
             for t in range(T)]
        for i in range(cfg.layers):
            pre = f"transformer.h.{i}."
            qkv = [ln(x[t], P[pre + "ln_1.weight"], P[pre + "ln_1.bias"])
                   @ P[pre + "attn.c_attn.weight"] + P[pre + "attn.c_attn.bias"] for t in range(T)]
            qs = [[r[h * d:(h + 1) * d] for h in range(nq)] for r in qkv]
            ks = [[r[H + h * d:H + (h + 1) * d] for h in range(nq)] for r in qkv]
            vs = [[r[2 * H + h * d:2 * H + (h + 1) * d] for h in range(nq)] for r in qkv]
            a = [attn_row(qs, ks, vs, t, d ** -0.5, lambda h: h) for t in range(T)]
            x = [x[t] + a[t] @ P[pre + "attn.c_proj.weight"] + P[pre + "attn.c_proj.bias"]
                 for t in range(T)]
            for t in range(T):
                hdn = ln(x[t], P[pre + "ln_2.weight"], P[pre + "ln_2.bias"]) \
                    @ P[pre + "mlp.c_fc.weight"] + P[pre + "mlp.c_fc.bias"]
                hdn = 0.5 * hdn * (1 + np.tanh(math.sqrt(2 / math.pi) * (hdn + 0.044715 * hdn ** 3)))
                x[t] = x[t] + hdn @ P[pre + "mlp.c_proj.weight"] + P[pre + "mlp.c_proj.bias"]
        head = P.get("lm_head.weight", P["transformer.wte.weight"])
        return np.stack([ln(x[t], P["transformer.ln_f.weight"], P["transformer.ln_f.bias"]) @ head.T
                         for t in range(T)])

    def lin(name, v):
        y = P[name + ".weight"] @ v
        return y + P[name + ".bias"] if name + ".bias" in P else y

    def qk(name, v, t):  # one head's q or k: Qwen3's RMSNorm(head_dim) then RoPE
        if cfg.qk_norm:
            w = P[name.replace("_proj", "_norm") + ".weight"]
            if qk_norm_after_rope:  # the wrong order (selftest's sensitivity check only)
                return rms(rope(v, pos[t]), w)
            v = rms(v, w)
        return rope(v, pos[t])

    x = [P["model.embed_tokens.weight"][ids[t]] for t in range(T)]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}.self_attn."
        hs = [rms(x[t], P[f"model.layers.{i}.input_layernorm.weight"]) for t in range(T)]
        qs = [[qk(pre + "q_proj", lin(pre + "q_proj", hs[t])[h * d:(h + 1) * d], t)
               for h in range(nq)] for t in range(T)]
        ks = [[qk(pre + "k_proj", lin(pre + "k_proj", hs[t])[h * d:(h + 1) * d], t)
               for h in range(nkv)] for t in range(T)]
        vs = [[lin(pre + "v_proj", hs[t])[h * d:(h + 1) * d] for h in range(nkv)] for t in range(T)]
        rep = nq // nkv
        x = [x[t] + lin(pre + "o_proj", attn_row(qs, ks, vs, t, d ** -0.5, lambda h: h // rep))
             for t in range(T)]
        pre = f"model.layers.{i}."
        for t in range(T):
            hn = rms(x[t], P[pre + "post_attention_layernorm.weight"])
            g, u = lin(pre + "mlp.gate_proj", hn), lin(pre + "mlp.up_proj", hn)
            x[t] = x[t] + lin(pre + "mlp.down_proj", g / (1 + np.exp(-g)) * u)
    head = P.get("lm_head.weight", P["model.embed_tokens.weight"])
    return np.stack([rms(x[t], P["model.norm.weight"]) @ head.T for t in range(T)])


def naive_numpy_gemma_forward(cfg, base, ids, pos, seg):
    """naive_numpy_forward for Gemma / Gemma 2 / Gemma 3 (one row, loops per token and head,
    float64), from the definitions: embedding * sqrt(hidden); norm x / rms(x) * (1 + w); per layer
    its type's RoPE (inv_freq of that type) and keys: same document, u <= t, and for sliding
    layers u > t - sliding_window; Gemma 3's q/k norms before RoPE; Gemma 2's and 3's norms after
    attention and around the MLP; scores and logits soft-capped as cap * tanh(x / cap)."""
    P = {k: v.double().numpy() for k, v in base.items()}
    T, H = len(ids), cfg.hidden
    nq, nkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    rep = nq // nkv

    def norm(x, w):
        return x / np.sqrt((x ** 2).mean() + cfg.eps) * (1.0 + w)

    def gelu(x):
        if cfg.act == "gelu":
            return np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    rope = naive_rope

    def lin(name, v):
        y = P[name + ".weight"] @ v
        return y + P[name + ".bias"] if name + ".bias" in P else y

    x = [P["model.embed_tokens.weight"][ids[t]] * math.sqrt(H) for t in range(T)]
    for i in range(cfg.layers):
        kind = cfg.layer_types[i]
        spec = cfg.rope[kind]
        window = cfg.sliding_window if kind == "sliding_attention" else None
        a = f"model.layers.{i}.self_attn."
        L = f"model.layers.{i}."
        hs = [norm(x[t], P[L + "input_layernorm.weight"]) for t in range(T)]

        def head(proj, t, h):
            v = lin(a + proj, hs[t])[h * d:(h + 1) * d]
            if proj != "v_proj" and cfg.qk_norm:
                v = norm(v, P[a + proj.replace("_proj", "_norm") + ".weight"])
            return rope(v, pos[t], spec) if proj != "v_proj" else v
        qs = [[head("q_proj", t, h) for h in range(nq)] for t in range(T)]
        ks = [[head("k_proj", t, h) for h in range(nkv)] for t in range(T)]
        vs = [[head("v_proj", t, h) for h in range(nkv)] for t in range(T)]
        new = []
        for t in range(T):
            keys = [u for u in range(T) if u == t or (u <= t and seg[u] == seg[t] and seg[u] >= 0
                                                      and (window is None or u > t - window))]
            o = []
            for h in range(nq):
                sc = np.array([qs[t][h] @ ks[u][h // rep] * cfg.attn_scale for u in keys])
                if cfg.attn_softcap is not None:
                    sc = cfg.attn_softcap * np.tanh(sc / cfg.attn_softcap)
                w = np.exp(sc - sc.max())
                w /= w.sum()
                o.append(sum(wi * vs[u][h // rep] for wi, u in zip(w, keys)))
            y = lin(a + "o_proj", np.concatenate(o))
            if cfg.sandwich:
                y = norm(y, P[L + "post_attention_layernorm.weight"])
            new.append(x[t] + y)
        x = new
        for t in range(T):
            hn = norm(x[t], P[L + ("pre_feedforward_layernorm.weight" if cfg.sandwich
                                   else "post_attention_layernorm.weight")])
            y = lin(L + "mlp.down_proj", gelu(lin(L + "mlp.gate_proj", hn)) * lin(L + "mlp.up_proj", hn))
            if cfg.sandwich:
                y = norm(y, P[L + "post_feedforward_layernorm.weight"])
            x[t] = x[t] + y
    head_w = P.get("lm_head.weight", P["model.embed_tokens.weight"])
    logits = np.stack([norm(x[t], P["model.norm.weight"]) @ head_w.T for t in range(T)])
    cap = cfg.final_softcap
    return logits if cap is None else cap * np.tanh(logits / cap)


def selftest():
    import contextlib
    import io
    import tempfile
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="hf_reference_selftest_")
    failures = []

    def check(name, ok, detail=""):
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
        if not ok:
            failures.append(name)

    def close(a, b, tol):
        a, b = a.double(), b.double()
        return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30)), \
            bool(torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max())))

    # 1. safetensors round trip (all dtypes, a scalar, an empty tensor); header padded to 8.
    ts = {"f64": torch.randn(3, 2, dtype=torch.float64), "f32": torch.randn(5),
          "bf16": torch.randn(4, 3).bfloat16(), "f16": torch.randn(2).half(),
          "i64": torch.arange(-3, 3), "i32": torch.arange(4, dtype=torch.int32),
          "u8": torch.arange(7, dtype=torch.uint8), "b": torch.tensor([True, False]),
          "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    p = os.path.join(tmp, "rt.safetensors")
    save_safetensors(p, ts, {"format": "pt"})
    back = load_safetensors(p)
    with open(p, "rb") as f:
        (hn,) = struct.unpack("<Q", f.read(8))
    check("safetensors round trip", hn % 8 == 0 and all(
        back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
        for k, v in ts.items()))

    # 2. llama3 rope scaling against values worked out by hand per frequency (Llama 3.1 values).
    cfg = Cfg(make_config(_Args(hidden=128, heads=1, kv_heads=1, rope_theta=500000.0,
                                rope_scaling=json.dumps({"rope_type": "llama3", "factor": 8.0,
                                                         "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}))))
    got = rope_inv_freq(cfg).double()
    worst, kinds = 0.0, set()
    for i in range(64):
        f = 1.0 / 500000.0 ** (2 * i / 128)
        wl = 2 * math.pi / f
        if wl < 8192 / 4:      # high frequency: unchanged
            want, kind = f, "high"
        elif wl > 8192 / 1:    # low frequency: divided by factor
            want, kind = f / 8, "low"
        else:                  # in between: interpolate in 1/wavelength
            s = (8192 / wl - 1) / (4 - 1)
            want, kind = (1 - s) * f / 8 + s * f, "mid"
        kinds.add(kind)
        worst = max(worst, abs(got[i].item() - want) / want)
    check("llama3 inv_freq vs hand values", worst < 1e-6 and kinds == {"high", "low", "mid"},
          f"(max rel {worst:.2e})")
    check("llama3 keeps the highest frequency, divides the lowest by 8",
          abs(got[0].item() - 1.0) < 1e-7 and
          abs(got[63].item() * 8 - 500000.0 ** (-126 / 128)) < 1e-6 * 500000.0 ** (-126 / 128))

    # 3. rotate_half RoPE == rotating the pairs (i, i + d/2) by pos * inv_freq[i], norm kept.
    cfg = Cfg(make_config(_Args(hidden=16, heads=1, kv_heads=1)))
    pos = torch.tensor([[0, 3, 17]])
    cos, sin = rope_cos_sin(cfg, pos, torch.float64)
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    y = x * cos + rotate_half(x) * sin
    inv = rope_inv_freq(cfg).double()
    z = torch.complex(x[..., :8], x[..., 8:]) * torch.exp(1j * pos[..., None].double() * inv)
    want = torch.cat((z.real, z.imag), -1)
    err, _ = close(y, want, 1e-6)
    check("rotate_half RoPE == complex rotation of (i, i+d/2)", err < 1e-6, f"({err:.1e})")
    # relative-position property: <R(m)q, R(n)k> depends on m - n only.
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    c2, s2 = rope_cos_sin(cfg, torch.tensor([[5, 2, 25, 22]]), torch.float64)
    r = [q * c2[0, 0] + rotate_half(q) * s2[0, 0], k * c2[0, 1] + rotate_half(k) * s2[0, 1],
         q * c2[0, 2] + rotate_half(q) * s2[0, 2], k * c2[0, 3] + rotate_half(k) * s2[0, 3]]
    check("RoPE scores depend on relative position", abs(float(r[0] @ r[1] - r[2] @ r[3])) < 1e-5)

    # 4. linear scaling == default RoPE at positions / factor.
    cl = Cfg(make_config(_Args(hidden=16, heads=1, kv_heads=1,
                               rope_scaling='{"type": "linear", "factor": 4.0}')))
    p4 = torch.tensor([[0, 4, 8, 36]])
    cl_cos, _ = rope_cos_sin(cl, p4, torch.float64)
    emb = (p4.double() / 4.0)[..., None] * rope_inv_freq(cfg).double()
    check("linear rope scaling == positions / factor",
          float((cl_cos - torch.cat((emb, emb), -1).cos()).abs().max()) < 1e-6)
    # yarn (NTK-by-parts, untruncated): a frequency that turns more than beta_fast times over the
    # original context is kept, one turning fewer than beta_slow times is divided by the factor,
    # those between lie between; cos and sin carry 0.1 ln(factor) + 1.
    cy = Cfg(make_config(_Args(hidden=64, heads=2, kv_heads=2, rope_theta=10000.0, rope_scaling=(
        '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, '
        '"beta_fast": 32, "beta_slow": 1, "truncate": false}'))))
    plain = Cfg(make_config(_Args(hidden=64, heads=2, kv_heads=2, rope_theta=10000.0)))
    base_inv, yarn_inv = rope_inv_freq(plain).double(), rope_inv_freq(cy).double()
    turns = 2048 * base_inv / (2 * math.pi)
    kinds, ok = set(), True
    for b, y, t in zip(base_inv.tolist(), yarn_inv.tolist(), turns.tolist()):
        if t > 32:
            kinds.add("kept")
            ok = ok and abs(y - b) <= 1e-6 * b
        elif t < 1:
            kinds.add("divided")
            ok = ok and abs(y - b / 4) <= 1e-6 * b
        else:
            kinds.add("between")
            ok = ok and b / 4 * (1 - 1e-6) <= y <= b * (1 + 1e-6)
    check("yarn inv_freq: kept above beta_fast turns, / factor below beta_slow",
          ok and kinds == {"kept", "divided", "between"}, f"({sorted(kinds)})")
    check("yarn attention scaling == 0.1 ln(factor) + 1",
          abs(rope_attention_scaling(cy) - (0.1 * math.log(4.0) + 1)) < 1e-12)
    # rope_parameters (newer format) == top-level rope_theta/rope_scaling (older format).
    sc = '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, ' \
         '"high_freq_factor": 4.0, "original_max_position_embeddings": 128}'
    old = Cfg(make_config(_Args(rope_theta=5000.0, rope_scaling=sc)))
    new = Cfg(make_config(_Args(rope_theta=5000.0, rope_scaling=sc, rope_parameters=True)))
    check("rope_parameters == rope_theta + rope_scaling",
          "rope_theta" not in new.raw and torch.equal(rope_inv_freq(old), rope_inv_freq(new)))

    # 5. packed rows == each document run alone (llama GQA + bias + llama3, qwen2, gpt2, qwen3).
    q3 = dict(qwen3=True, head_dim=16, attention_bias=True, tie=True)  # head_dim 16 != 32 / 4
    variants = [("llama gqa bias llama3", dict(attention_bias=True, rope_scaling=sc)),
                ("qwen2 tied", dict(qwen2=True, tie=True, kv_heads=1)),
                ("mistral", dict(mistral=True, heads=2, kv_heads=2, head_dim=24)),
                ("gpt2", dict(arch="gpt2", intermediate=None, kv_heads=None)),
                ("qwen3", dict(qwen3=True)),
                ("qwen3 head_dim 16 bias tied llama3", dict(q3, rope_scaling=sc))]
    # Gemma: head_dim 12 != 32 / 4, exact GELU, biases; Gemma 3: window 3 < the rows' documents,
    # sliding / full layers with their own theta, linear scaling on the full layer only,
    # query_pre_attn_scalar 10 != head_dim.
    gm = dict(gemma=True, head_dim=12, hidden_act="gelu", attention_bias=True)
    g3 = dict(gemma3=True, head_dim=16, layers=3, layer_types="sliding,full,sliding",
              sliding_window=3, query_pre_attn_scalar=10, rope_theta=None, rope_local_theta=500.0,
              rope_scaling='{"rope_type": "linear", "factor": 2.0}', tie=True)
    # Gemma 2: window 3, one linear-scaled RoPE on sliding and full layers, soft-caps 2 (scores
    # reach about 5) and 1.5 (logits reach about 3) so that tanh bites; the config's 50 / 30
    # and null caps; Gemma 3 with a final soft-cap.
    g2 = dict(gemma2=True, head_dim=16, layers=3, layer_types="sliding,full,sliding",
              sliding_window=3, query_pre_attn_scalar=10, attn_softcap=2.0, final_softcap=1.5,
              rope_scaling='{"type": "linear", "factor": 2.0}', tie=True)
    variants += [("gemma gelu head_dim 12 bias", gm),
                 ("gemma3 window 3 sliding/full linear on full", g3),
                 ("gemma3 nested rope_parameters untied tanh", dict(g3, rope_parameters=True, tie=False,
                                                                    attention_bias=True)),
                 ("gemma2 window 3 softcaps 2/1.5 linear rope", g2),
                 ("gemma2 softcaps 50/30 gelu untied bias rope_parameters",
                  dict(g2, attn_softcap=None, final_softcap=None, hidden_act="gelu", tie=False,
                       attention_bias=True, rope_parameters=True)),
                 ("gemma2 softcaps null default layer_types", dict(g2, attn_softcap="none", final_softcap="none",
                                                                   layers=2, layer_types=None)),
                 ("gemma3 final softcap 1.5", dict(g3, final_softcap=1.5))]
    batch = make_batch(3, 20, 40, seed=1)
    for name, kw in variants:
        cfg, base = _model(1, **kw)
        logits, loss, _ = run_forward(cfg, base, batch, want_grad=False)
        worst, tot, n = 0.0, 0.0, 0
        for r in range(3):
            for s in range(int(batch["segment_ids"][r].max()) + 1):
                idx = (batch["segment_ids"][r] == s).nonzero().flatten()
                one = {k: v[r:r + 1, idx] for k, v in batch.items()}
                one["segment_ids"] = torch.zeros_like(one["segment_ids"])
                l1 = Forward(cfg, {k: v.double() for k, v in base.items()})(
                    one["input_ids"], one["position_ids"], one["segment_ids"])
                worst = max(worst, float((l1[0] - logits[r, idx]).abs().max()))
                m = one["targets"] != IGNORE
                if m.any():
                    tot += float(F.cross_entropy(l1[0][m[0]], one["targets"][0][m[0]],
                                                 reduction="sum"))
                    n += int(m.sum())
        check(f"packed == separate documents ({name})",
              worst < 1e-10 and abs(tot / n - loss.item()) < 1e-10, f"({worst:.1e})")
        check(f"no NaN/inf in logits with padding ({name})", bool(torch.isfinite(logits).all()))

    # 5b. a second implementation (numpy, loops per token and head) gives the same logits.
    for name, kw in variants[:2] + variants[3:]:
        cfg, base = _model(12, **kw)
        logits, _, _ = run_forward(cfg, base, batch, want_grad=False)
        worst = 0.0
        for r in range(3):
            want = naive_numpy_forward(cfg, base, *(batch[k][r].tolist() for k in
                                                    ("input_ids", "position_ids", "segment_ids")))
            real = batch["segment_ids"][r] >= 0
            worst = max(worst, close(logits[r][real], torch.from_numpy(want)[real], 1e-6)[0])
        check(f"Forward == naive numpy loops ({name})", worst < 1e-6, f"(max rel {worst:.1e})")

    # 5c. Qwen3: the config as transformers reads it, and q_norm / k_norm are really used.
    cfg, base = _model(14, **q3)
    shapes = param_shapes(cfg)
    check("qwen3 shapes: q/k norms (head_dim), bias on q/k/v/o, none in the MLP",
          shapes["model.layers.1.self_attn.q_norm.weight"] == [16] and
          shapes["model.layers.1.self_attn.k_norm.weight"] == [16] and
          shapes["model.layers.0.self_attn.q_proj.weight"] == [64, 32] and
          shapes["model.layers.0.self_attn.o_proj.weight"] == [32, 64] and
          shapes["model.layers.0.self_attn.o_proj.bias"] == [32] and
          shapes["model.layers.0.self_attn.k_proj.bias"] == [32] and
          not any(k.startswith("model.layers.0.mlp.") and k.endswith(".bias") for k in shapes) and
          all(not (0.99 < float(base[k].min()) and float(base[k].max()) < 1.01)
              for k in shapes if k.endswith(("q_norm.weight", "k_norm.weight"))))
    raw = dict(cfg.raw)
    raw.pop("head_dim")
    raw.pop("attention_bias")
    c_def = Cfg(raw)
    refused = []
    for bad in (dict(cfg.raw, use_sliding_window=True),
                dict(cfg.raw, layer_types=["full_attention", "sliding_attention"])):
        try:
            Cfg(bad)
        except ValueError:
            refused.append(True)
    c_sw = Cfg(dict(cfg.raw, sliding_window=2, max_window_layers=0,
                    layer_types=["full_attention", "full_attention"]))
    check("qwen3 config: head_dim 128 and no bias when absent, use_sliding_window refused",
          c_def.head_dim == 128 and not c_def.qkv_bias and not c_def.o_bias and
          Cfg({"architectures": ["Qwen3ForCausalLM"], **{k: v for k, v in cfg.raw.items()
                                                          if k != "model_type"}}).qk_norm and
          len(refused) == 2 and c_sw.sliding_window is None)
    f0 = Forward(cfg, {k: v.double() for k, v in base.items()})
    l0 = f0(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
    for which in ("q_norm", "k_norm"):
        pb = {k: v.double() for k, v in base.items()}
        key = f"model.layers.0.self_attn.{which}.weight"
        pb[key] = pb[key].clone()
        pb[key][3] *= 1.5
        l1 = Forward(cfg, pb)(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        check(f"qwen3 {which} weight changes the logits", close(l1, l0, 1e-6)[0] > 1e-4,
              f"({close(l1, l0, 1e-6)[0]:.1e})")
    cfg_n = Cfg(dict(cfg.raw, model_type="llama", mlp_bias=False))  # same tensors, no q/k norm
    ln = Forward(cfg_n, {k: v.double() for k, v in base.items()
                         if not k.endswith(("q_norm.weight", "k_norm.weight"))})(
        batch["input_ids"], batch["position_ids"], batch["segment_ids"])
    check("qwen3 != the same weights without q/k norm (llama)", close(ln, l0, 1e-6)[0] > 1e-3)
    r0 = batch["segment_ids"][0] >= 0
    args0 = [batch[k][0].tolist() for k in ("input_ids", "position_ids", "segment_ids")]
    wrong = naive_numpy_forward(cfg, base, *args0, qk_norm_after_rope=True)
    check("qwen3 norm-before-RoPE order matters (numpy check is sensitive)",
          close(l0[0][r0], torch.from_numpy(wrong)[r0], 1e-6)[0] > 1e-4)

    # 5d. Gemma / Gemma 3: config defaults and refusals, norm, embedding scale, window, padding_idx.
    c = Cfg({"model_type": "gemma3_text", "num_hidden_layers": 7})
    check("gemma3_text defaults (Gemma3TextConfig)",
          c.head_dim == 256 and c.hidden == 2304 and c.attn_scale == 256 ** -0.5 and c.tie and
          c.padding_idx == 0 and c.act == "gelu_pytorch_tanh" and c.sliding_window == 4096 and
          c.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"] and
          c.rope["full_attention"].rope_theta == 1e6 and c.rope["sliding_attention"].rope_theta == 1e4
          and c.max_pos == 131072 and c.kv_heads == 4)
    c = Cfg({"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 5e5,
             "rope_local_base_freq": 2e4, "hidden_activation": "gelu", "hidden_act": "silu"})
    check("gemma3_text sliding_window_pattern, rope_scaling on full layers only, thetas",
          c.layer_types == ["sliding_attention", "full_attention"] * 2 and c.act == "gelu" and
          c.rope["full_attention"].rope_type == "linear" and c.rope["full_attention"].rope_theta == 5e5
          and c.rope["sliding_attention"].rope_type == "default" and
          c.rope["sliding_attention"].rope_theta == 2e4)
    c = Cfg({"architectures": ["GemmaForCausalLM"], "hidden_activation": "silu"})
    check("gemma defaults (GemmaConfig)",
          c.model_type == "gemma" and c.head_dim == 256 and c.tie and c.padding_idx == 0 and
          c.act == "gelu_pytorch_tanh" and c.rope_theta == 10000.0 and c.max_pos == 8192 and
          c.kv_heads == 16 and c.attn_scale == 256 ** -0.5 and c.layer_types == ["full_attention"] * 28)
    c = Cfg({"model_type": "gemma", "rope_theta": 7.0, "rope_parameters": {"rope_type": "linear", "factor": 2.0},
             "rope_scaling": {"type": "linear", "factor": 3.0}})
    check("gemma: rope_scaling wins over rope_parameters (RotaryEmbeddingConfigMixin)",
          c.rope_type == "linear" and c.rope_scaling["factor"] == 3.0 and c.rope_theta == 7.0)
    c = Cfg({"model_type": "gemma2", "num_hidden_layers": 5, "hidden_act": "silu",
             "rope_scaling": {"type": "linear", "factor": 4.0}})
    check("gemma2 defaults (Gemma2Config): caps 50 / 30, even layers sliding, one RoPE",
          c.head_dim == 256 and c.hidden == 2304 and c.attn_scale == 256 ** -0.5 and c.tie and
          c.padding_idx == 0 and c.act == "gelu_pytorch_tanh" and c.sliding_window == 4096 and
          c.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"] and
          c.max_pos == 8192 and c.kv_heads == 4 and c.heads == 8 and c.vocab == 256000 and
          c.attn_softcap == 50.0 and c.final_softcap == 30.0 and c.sandwich and not c.qk_norm and
          c.rope["sliding_attention"] is c.rope["full_attention"] and c.rope_theta == 10000.0 and
          c.rope_type == "linear" and c.rope_scaling["factor"] == 4.0)
    c = Cfg({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": None,
             "final_logit_softcapping": 3, "hidden_activation": "gelu"})
    c1 = Cfg({"model_type": "gemma", "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0})
    c3 = Cfg(dict(make_config(_Args(**g3)), final_logit_softcapping=3.0, attn_logit_softcapping=None))
    check("soft-cap keys: null disables (gemma2), gemma3_text reads the final one, gemma ignores both",
          c.model_type == "gemma2" and c.attn_softcap is None and c.final_softcap == 3.0 and
          c.act == "gelu" and c1.attn_softcap is None and c1.final_softcap is None and
          c3.final_softcap == 3.0 and c3.attn_softcap is None)
    g2raw = make_config(_Args(**g2))
    refused = []
    for bad in (dict(g2raw, attn_logit_softcapping=0.0), dict(g2raw, final_logit_softcapping=-30.0),
                dict(g2raw, final_logit_softcapping="30"), dict(g2raw, attn_logit_softcapping=True),
                dict(g2raw, rope_scaling=None, rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                dict(g2raw, use_bidirectional_attention=True), dict(g2raw, hidden_activation="silu"),
                dict(g2raw, layer_types=["full_attention"]), dict(g2raw, sliding_window=None),
                dict(g2raw, num_attention_heads=3, num_key_value_heads=1)):
        try:
            Cfg(bad)
        except ValueError:
            refused.append(True)
    check("gemma2 configs refused: soft-caps not positive numbers, rope nested by layer type, "
          "bidirectional, activation, layer_types, window, heads", len(refused) == 10,
          f"({len(refused)}/10)")
    g3raw = make_config(_Args(**g3))
    refused = []
    for bad in (dict(g3raw, attn_logit_softcapping=50.0), dict(g3raw, final_logit_softcapping=0),
                dict(g3raw, use_bidirectional_attention=True),
                dict(make_config(_Args(**gm)), use_bidirectional_attention=True),
                dict(g3raw, hidden_activation="silu"), dict(make_config(_Args(**gm)), hidden_act="gelu_new"),
                dict(g3raw, layer_types=["full_attention"]),
                dict(g3raw, layer_types=["full_attention", "chunked_attention", "full_attention"]),
                dict(g3raw, sliding_window=None), dict(g3raw, num_attention_heads=3, num_key_value_heads=1),
                dict(g3raw, rope_scaling={"type": "linear", "factor": 2.0}),
                dict(g3raw, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
                dict(g3raw, rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                                "truncate": False}})):
        try:
            Cfg(bad)
        except ValueError:
            refused.append(True)
    check("gemma configs refused: gemma3 attention soft-cap (ignored by transformers), final soft-cap 0, "
          "bidirectional, activation, layer_types, window, rope spellings transformers ignores",
          len(refused) == 13, f"({len(refused)}/13)")
    check("gemma3 nested rope_parameters == top-level rope_theta/rope_scaling/rope_local_base_freq",
          "rope_theta" not in make_config(_Args(**dict(g3, rope_parameters=True))) and all(
              torch.equal(rope_inv_freq(Cfg(make_config(_Args(**g3))).rope[t]),
                          rope_inv_freq(Cfg(make_config(_Args(**dict(g3, rope_parameters=True)))).rope[t]))
              for t in ("full_attention", "sliding_attention")) and
          Cfg(g3raw).rope["full_attention"].rope_type == "linear")
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64) - 0.5
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    xb, wb = x.bfloat16(), w.bfloat16()
    once = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + wb.float())).bfloat16()
    check("Gemma norm: x / rms(x) * (1 + w), bf16 rounded once at the end",
          float((gemma_rms_norm(x, w, 1e-6) - want).abs().max()) < 1e-12 and
          torch.equal(gemma_rms_norm(xb, wb, 1e-6), once))
    check("Gemma embedding scale: sqrt(hidden) in the weight's dtype (bf16 sqrt(3072) = 55.5)",
          gemma_embed_scale(3072, torch.bfloat16).item() == 55.5 and
          gemma_embed_scale(3072, torch.float32).item() == torch.tensor(3072 ** 0.5).item() and
          gemma_embed_scale(48, torch.float64).item() == 48 ** 0.5)
    ids = torch.randint(0, 40, (1, 10))
    one = {"input_ids": ids, "position_ids": torch.arange(10)[None],
           "segment_ids": torch.zeros(1, 10, dtype=torch.long)}
    reach = {}
    for kind in ("sliding", "full"):
        cfg, base = _model(15, **dict(g3, layers=1, layer_types=kind))
        f = Forward(cfg, {k: v.double() for k, v in base.items()})
        a0 = f(**one)
        ids3 = ids.clone()
        ids3[0, 4] = (ids3[0, 4] + 1) % 40
        a1 = f(ids3, one["position_ids"], one["segment_ids"])
        reach[kind] = (torch.equal(a0[:, 7:], a1[:, 7:]), not torch.allclose(a0[:, 6], a1[:, 6]),
                       not torch.allclose(a0[:, 9], a1[:, 9]))
    check("gemma3 window 3: a sliding layer's t sees t-2 .. t, a full layer sees all",
          reach["sliding"][:2] == (True, True) and reach["full"][2])
    cfg, base = _model(19, **g2)
    capped = {}
    for caps in ((2.0, 1.5), ("none", 1.5), (2.0, "none")):
        c = Cfg(make_config(_Args(**dict(g2, attn_softcap=caps[0], final_softcap=caps[1]))))
        capped[caps] = Forward(c, {k: v.double() for k, v in base.items()})(
            batch["input_ids"], batch["position_ids"], batch["segment_ids"])
    check("gemma2 soft-caps: |logits| < the final cap, and each cap changes the logits",
          float(capped[2.0, 1.5].abs().max()) < 1.5 and float(capped[2.0, "none"].abs().max()) > 1.5 and
          close(capped[2.0, 1.5], capped["none", 1.5], 1e-6)[0] > 1e-3,
          f"(attention cap moves logits by {close(capped[2.0, 1.5], capped['none', 1.5], 1e-6)[0]:.1e})")
    pad_b = make_batch(2, 12, 40, seed=16)
    pad_b["input_ids"][0, 2] = 5
    grads = {}
    for pad, tie in ((None, False), (5, False), (5, True)):
        cfg, base = _model(17, **dict(gm, pad_token_id=pad, tie=tie))
        grads[pad, tie] = run_forward(cfg, base, pad_b)[2]["model.embed_tokens.weight"]
    check("gemma pad_token_id: padding_idx row gets no lookup gradient (a tied head still gives one)",
          Cfg(make_config(_Args(**dict(gm, pad_token_id=5)))).padding_idx == 5 and
          float(grads[None, False][5].abs().max()) > 0 and float(grads[5, False][5].abs().max()) == 0 and
          torch.equal(grads[None, False][:5], grads[5, False][:5]) and
          float(grads[5, True][5].abs().max()) > 0)
    cfg, base = _model(18, **g3)
    shapes = param_shapes(cfg)
    check("gemma3 shapes: q/k norms (head_dim), sandwich norms, norm weights around 0",
          shapes["model.layers.2.self_attn.q_norm.weight"] == [16] and
          shapes["model.layers.0.pre_feedforward_layernorm.weight"] == [32] and
          shapes["model.layers.0.post_feedforward_layernorm.weight"] == [32] and
          shapes["model.layers.0.self_attn.q_proj.weight"] == [64, 32] and "lm_head.weight" not in shapes
          and all(-0.4 <= float(base[k].min()) and float(base[k].max()) <= 0.4 and float(base[k].min()) < 0
                  for k in shapes if k.endswith("norm.weight")))

    # 6. causality and padding: changing a later token / adding padding leaves earlier logits.
    cfg, base = _model(2)
    ids = torch.randint(0, 40, (1, 10))
    one = {"input_ids": ids, "position_ids": torch.arange(10)[None],
           "segment_ids": torch.zeros(1, 10, dtype=torch.long)}
    f = Forward(cfg, {k: v.double() for k, v in base.items()})
    l0 = f(**one)
    ids2 = ids.clone()
    ids2[0, 7] = (ids2[0, 7] + 1) % 40
    l1 = f(ids2, one["position_ids"], one["segment_ids"])
    padded = f(torch.cat((ids, torch.zeros(1, 5, dtype=torch.long)), 1),
               torch.cat((one["position_ids"], torch.zeros(1, 5, dtype=torch.long)), 1),
               torch.cat((one["segment_ids"], -torch.ones(1, 5, dtype=torch.long)), 1))
    check("causal: a later token does not change earlier logits",
          torch.equal(l0[:, :7], l1[:, :7]) and not torch.allclose(l0[:, 7:], l1[:, 7:]))
    check("trailing padding leaves real logits unchanged",
          float((padded[:, :10] - l0).abs().max()) < 1e-12)

    # Mistral sliding window W: with one layer, logits at t see tokens t-W+1 .. t only.
    cfg, base = _model(13, mistral=True, layers=1, sliding_window=3)
    f = Forward(cfg, {k: v.double() for k, v in base.items()})
    a0 = f(**one)
    ids3 = ids.clone()
    ids3[0, 4] = (ids3[0, 4] + 1) % 40
    a1 = f(ids3, one["position_ids"], one["segment_ids"])
    check("mistral sliding_window: key t-W is out of reach, t-W+1 is in",
          torch.equal(a0[:, 7:], a1[:, 7:]) and not torch.allclose(a0[:, 6], a1[:, 6]))

    # 7. GQA == MHA whose k/v heads are the kv heads repeated (kv head j serves query heads
    #    j*n_rep ... j*n_rep + n_rep - 1, HF's repeat_kv order).
    cfg_g, base_g = _model(3, heads=4, kv_heads=2)
    cfg_m = Cfg(make_config(_Args(heads=4, kv_heads=4)))
    base_m = dict(base_g)
    d = cfg_g.head_dim
    for i in range(cfg_g.layers):
        for w in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{w}.weight"
            base_m[key] = base_g[key].view(2, 1, d, -1).expand(2, 2, d, -1).reshape(4 * d, -1)
    lg, _, _ = run_forward(cfg_g, base_g, batch, want_grad=False)
    lm, _, _ = run_forward(cfg_m, base_m, batch, want_grad=False)
    err, _ = close(lg, lm, 1e-12)
    check("GQA == MHA with repeated kv weights", err < 1e-12, f"({err:.1e})")
    base_bad = dict(base_m)
    for i in range(cfg_g.layers):  # interleaved repeat (the wrong order) must differ
        for w in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{w}.weight"
            base_bad[key] = base_g[key].view(1, 2, d, -1).expand(2, 2, d, -1).reshape(4 * d, -1)
    lb, _, _ = run_forward(cfg_m, base_bad, batch, want_grad=False)
    check("GQA head order matters (test is sensitive)", close(lg, lb, 1e-6)[0] > 1e-3)

    # 8. LoRA == merged weights (Linear: W + s B A; Conv1D: W + s (B A)^T), rslora scaling.
    for name, kw, targets, rs in (
            ("llama", {}, ["q_proj", "v_proj", "down_proj", "lm_head"], False),
            ("llama rslora", {"tie": True}, "all-linear", True),
            ("gpt2", dict(arch="gpt2", intermediate=None), ["c_attn", "c_fc", "c_proj"], False),
            ("qwen3", q3, ["q_proj", "k_proj", "o_proj", "gate_proj"], False),
            ("qwen3 all-linear", dict(q3, tie=False), "all-linear", True),
            ("gemma3 all-linear", g3, "all-linear", False),
            ("gemma2 all-linear", dict(g2, attention_bias=True), "all-linear", True),
            ("gemma", gm, ["q_proj", "o_proj", "up_proj", "lm_head"], True)):
        cfg, base = _model(4, **kw)
        lora = _rand_lora(cfg, targets, 3, 6.0, rs, 5, os.path.join(tmp, name.replace(" ", "_")))
        want_scale = 6.0 / math.sqrt(3) if rs else 2.0
        ll, _, _ = run_forward(cfg, base, batch, lora, lora.tensors, want_grad=False)
        merged = {k: v.double() for k, v in base.items()}
        lin = linear_modules(cfg)
        for mod, (ak, bk, _) in lora.modules.items():
            delta = want_scale * lora.tensors[bk].double() @ lora.tensors[ak].double()
            key = mod + ".weight"
            if mod == "lm_head" and cfg.tie:  # untie to merge into the head only
                merged["lm_head.weight"] = merged["model.embed_tokens.weight"].clone()
            merged[key] = merged[key] + (delta.t() if lin[mod][2] else delta)
        cfg_u = cfg
        if cfg.tie and "lm_head.weight" in merged:
            cfg_u = Cfg(dict(cfg.raw, tie_word_embeddings=False))
        lmg = Forward(cfg_u, merged)(batch["input_ids"], batch["position_ids"],
                                     batch["segment_ids"])
        err, _ = close(ll, lmg, 1e-10)
        check(f"LoRA == merged weights ({name}, {len(lora.modules)} modules)", err < 1e-10,
              f"({err:.1e})")
        if cfg.qk_norm:
            check(f"no q_norm / k_norm among the LoRA modules ({name})",
                  not any("norm" in m for m in lora.modules) and
                  not any("norm" in m for m in linear_modules(cfg)) and
                  (targets != "all-linear" or len(lora.modules) == 7 * cfg.layers))

    # 8b. DoRA == merged weights m / ||W + s B A|| * (W + s B A), row by row (Conv1D: transposed).
    for name, kw, targets in (
            ("llama dora", {"attention_bias": True}, ["q_proj", "v_proj", "down_proj"]),
            ("gpt2 dora", dict(arch="gpt2", intermediate=None), ["c_attn", "c_fc"])):
        cfg, base = _model(4, **kw)
        lora = _rand_lora(cfg, targets, 3, 6.0, False, 5, os.path.join(tmp, name.replace(" ", "_")), dora=True)
        ll, _, _ = run_forward(cfg, base, batch, lora, lora.tensors, want_grad=False)
        plain, _, _ = run_forward(cfg, base, batch, None, want_grad=False)
        merged = {k: v.double() for k, v in base.items()}
        lin = linear_modules(cfg)
        for mod, (ak, bk, mk) in lora.modules.items():
            conv = lin[mod][2]
            w = merged[mod + ".weight"].t() if conv else merged[mod + ".weight"]
            v = w + 2.0 * lora.tensors[bk].double() @ lora.tensors[ak].double()
            v = lora.tensors[mk].double()[:, None] * v / v.norm(dim=1, keepdim=True)
            merged[mod + ".weight"] = v.t() if conv else v
        lmg = Forward(cfg, merged)(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        err, _ = close(ll, lmg, 1e-10)
        check(f"DoRA == merged weights ({name}, {len(lora.modules)} modules)", err < 1e-10, f"({err:.1e})")
        check(f"DoRA changes the model ({name})", close(ll, plain, 1e-6)[0] > 1e-3)

    # 9. autograd gradients == central finite differences (float64), base and LoRA params.
    small = make_batch(2, 9, 40, seed=6)
    for name, kw in (("llama", dict(attention_bias=True, rope_scaling=sc, layers=1)),
                     ("gpt2", dict(arch="gpt2", intermediate=None, layers=1)),
                     ("qwen3", dict(q3, layers=1)),
                     ("gemma", dict(gm, layers=1, pad_token_id=0)),
                     ("gemma3", dict(g3, layers=2, layer_types="sliding,full", attention_bias=True)),
                     ("gemma2 softcaps", dict(g2, layers=2, layer_types="sliding,full", attention_bias=True)),
                     ("gemma3 final softcap", dict(g3, layers=1, layer_types="sliding", final_softcap=1.5))):
        cfg, base = _model(7, **kw)
        _, _, grads = run_forward(cfg, base, small)
        gen = torch.Generator().manual_seed(8)
        worst = 0.0
        keys = list(base)[::max(1, len(base) // 9)]
        keys += [k for k in base if k.endswith(("q_norm.weight", "k_norm.weight", "o_proj.bias",
                                                "feedforward_layernorm.weight"))
                 and k not in keys]
        for key in keys:
            flat = base[key].double().reshape(-1)
            for _ in range(2):
                j = int(torch.randint(0, flat.numel(), (1,), generator=gen))
                vals = []
                for h in (1e-5, -1e-5):
                    pb = dict(base)
                    pb[key] = base[key].double().reshape(-1).clone()
                    pb[key][j] += h
                    pb[key] = pb[key].reshape(base[key].shape)
                    vals.append(run_forward(cfg, pb, small, want_grad=False)[1].item())
                fd = (vals[0] - vals[1]) / 2e-5
                ag = grads[key].reshape(-1)[j].item()
                worst = max(worst, abs(fd - ag) / max(abs(ag), 1e-4))
        check(f"gradients == finite differences ({name})", worst < 1e-5, f"(max rel {worst:.1e})")
    cfg, base = _model(9, layers=1)
    lora = _rand_lora(cfg, ["q_proj", "o_proj", "up_proj"], 2, 4.0, False, 10,
                      os.path.join(tmp, "fdlora"))
    _, _, grads = run_forward(cfg, base, small, lora, lora.tensors)
    worst = 0.0
    for key in lora.tensors:
        j = 1
        vals = []
        for h in (1e-5, -1e-5):
            lt = {k: v.double().clone() for k, v in lora.tensors.items()}
            lt[key].view(-1)[j] += h
            vals.append(run_forward(cfg, base, small, lora, lt, want_grad=False)[1].item())
        fd = (vals[0] - vals[1]) / 2e-5
        ag = grads[key].reshape(-1)[j].item()
        worst = max(worst, abs(fd - ag) / max(abs(ag), 1e-4))
    check("LoRA gradients == finite differences", worst < 1e-5 and len(grads) == 6,
          f"(max rel {worst:.1e})")

    # 10. RMSNorm by its definition; gelu_new by its formula against erf GELU's neighbourhood.
    x = torch.randn(3, 8, dtype=torch.float32)
    w = torch.rand(8) + 0.5
    want = w.double() * x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    check("RMSNorm definition", float((rms_norm(x, w, 1e-6).double() - want).abs().max()) < 1e-5)
    xs = torch.linspace(-4, 4, 81, dtype=torch.float64)
    check("gelu_new close to exact GELU (tanh approximation)",
          float((gelu_new(xs) - F.gelu(xs)).abs().max()) < 1e-3 and
          abs(gelu_new(torch.tensor(1.0, dtype=torch.float64)).item() - 0.8411919906082768) < 1e-12)

    # 11. AdamW (train) == the update written out by hand for one step.
    g = torch.randn(5, dtype=torch.float64)
    p0 = torch.randn(5, dtype=torch.float64)
    pt = p0.clone().float().requires_grad_(True)
    opt = torch.optim.AdamW([pt], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    pt.grad = g.float()
    opt.step()
    m, v = 0.1 * g, 0.01 * g * g
    want = p0 * (1 - 0.01 * 0.1) - 0.01 * (m / 0.1) / (torch.sqrt(v / 0.01) + 1e-8)
    check("torch AdamW step == hand formula", float((pt.double() - want).abs().max()) < 1e-6)

    # 12. float32 compute agrees with float64 (what memtune's fp32 comparisons can expect).
    cfg, base = _model(11, rope_scaling=sc)
    l64, s64, g64 = run_forward(cfg, base, batch)
    l32, s32, g32 = run_forward(cfg, base, batch, dtype=torch.float32)
    errs = [close(l32, l64, 1e-4)[0], abs(s32.item() - s64.item()) / abs(s64.item())] + \
        [close(g32[k], g64[k], 1e-4)[0] for k in g64]
    check("float32 forward/backward == float64 within 1e-4", max(errs) < 1e-4,
          f"(max rel {max(errs):.1e})")

    # 13. files written by init / init-lora load back and run through the CLI paths.
    for label, arch, extra in (("llama", "llama", ["--qwen2", "--tie"]), ("gpt2", "gpt2", []),
                               ("qwen3", "llama", ["--qwen3", "--tie", "--attention-bias",
                                                   "--head-dim", "16"]),
                               ("gemma", "llama", ["--gemma", "--hidden-act", "gelu", "--head-dim", "12",
                                                   "--rope-parameters", "--rope-scaling",
                                                   '{"type": "linear", "factor": 2.0}']),
                               ("gemma3", "llama", ["--gemma3", "--layers", "3", "--layer-types",
                                                    "sliding,full,sliding", "--sliding-window", "4",
                                                    "--head-dim", "16", "--query-pre-attn-scalar", "12",
                                                    "--rope-local-theta", "20000", "--tie", "--rope-scaling",
                                                    '{"rope_type": "linear", "factor": 2.0}',
                                                    "--final-softcap", "3"]),
                               ("gemma2", "llama", ["--gemma2", "--layers", "3", "--sliding-window", "4",
                                                    "--head-dim", "16", "--attn-softcap", "5",
                                                    "--final-softcap", "none", "--hidden-act", "gelu",
                                                    "--pad-token-id", "0", "--rope-scaling",
                                                    '{"type": "linear", "factor": 2.0}'])):
        mdir = os.path.join(tmp, "m_" + label)
        main(["init", "--arch", arch, "--out", mdir, "--seed", "3", "--hidden", "32",
              "--vocab", "64"] + extra)
        adir = os.path.join(tmp, "a_" + label)
        main(["init-lora", "--model", mdir, "--out", adir, "--seed", "4",
              "--targets", "c_attn,c_proj" if arch == "gpt2" else "q_proj,v_proj"])
        bpath = os.path.join(tmp, "b.safetensors")
        main(["make-batch", "--out", bpath, "--vocab", "64", "--seed", "5"])
        opath = os.path.join(tmp, "o.safetensors")
        main(["forward", "--model", mdir, "--batch", bpath, "--out", opath, "--lora", adir])
        o = load_safetensors(opath)
        with open(os.path.join(adir, "adapter_config.json")) as fh:
            ac = json.load(fh)
        if label == "qwen3":
            with open(os.path.join(mdir, "config.json")) as fh:
                mc = json.load(fh)
            check("CLI init --qwen3 writes a Qwen3 config",
                  mc["model_type"] == "qwen3" and mc["architectures"] == ["Qwen3ForCausalLM"] and
                  mc["head_dim"] == 16 and mc["attention_bias"] is True and
                  mc["use_sliding_window"] is False and
                  "model.layers.0.self_attn.q_norm.weight" in load_safetensors(
                      os.path.join(mdir, "model.safetensors")))
        if label.startswith("gemma"):
            with open(os.path.join(mdir, "config.json")) as fh:
                mc = json.load(fh)
            ok = mc["pad_token_id"] == (0 if label == "gemma2" else None) and \
                mc["head_dim"] == (12 if label == "gemma" else 16)
            if label == "gemma":
                ok = ok and mc["model_type"] == "gemma" and mc["architectures"] == ["GemmaForCausalLM"] and \
                    mc["hidden_act"] == "gelu" and mc["tie_word_embeddings"] is False and \
                    mc["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0}
            elif label == "gemma3":
                ok = ok and mc["model_type"] == "gemma3_text" and \
                    mc["architectures"] == ["Gemma3ForCausalLM"] and \
                    mc["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"] and \
                    mc["sliding_window"] == 4 and mc["query_pre_attn_scalar"] == 12 and \
                    mc["rope_theta"] == 1e6 and mc["rope_local_base_freq"] == 20000.0 and \
                    mc["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and \
                    mc["hidden_activation"] == "gelu_pytorch_tanh" and mc["tie_word_embeddings"] is True and \
                    mc["final_logit_softcapping"] == 3.0 and mc["attn_logit_softcapping"] is None
            elif label == "gemma2":
                # Gemma2Config.save_pretrained's keys (rope_theta / rope_scaling where 5.12 writes
                # rope_parameters), plus architectures and torch_dtype.
                ok = ok and set(mc) == {
                    "architectures", "attention_bias", "attention_dropout", "attn_logit_softcapping",
                    "bos_token_id", "eos_token_id", "final_logit_softcapping", "head_dim",
                    "hidden_activation", "hidden_size", "initializer_range", "intermediate_size",
                    "layer_types", "max_position_embeddings", "model_type", "num_attention_heads",
                    "num_hidden_layers", "num_key_value_heads", "pad_token_id", "query_pre_attn_scalar",
                    "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings",
                    "torch_dtype", "transformers_version", "use_bidirectional_attention", "use_cache",
                    "vocab_size"} and \
                    mc["model_type"] == "gemma2" and mc["architectures"] == ["Gemma2ForCausalLM"] and \
                    mc["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"] and \
                    mc["sliding_window"] == 4 and mc["query_pre_attn_scalar"] == 16 and \
                    mc["attn_logit_softcapping"] == 5.0 and mc["final_logit_softcapping"] is None and \
                    mc["hidden_activation"] == "gelu" and mc["rope_theta"] == 10000.0 and \
                    mc["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
            check(f"CLI init --{label} writes a {mc['architectures'][0]} config", ok)
        check(f"CLI init/init-lora/forward ({label})",
              o["logits"].dtype == torch.float32 and o["loss"].shape == () and
              all(k.endswith(".lora_A.weight.grad") or k.endswith(".lora_B.weight.grad")
                  for k in o if k not in ("logits", "loss")) and
              all(float(v.abs().max()) > 0 for k, v in o.items() if k.endswith(".grad")) and
              ac["fan_in_fan_out"] == (arch == "gpt2"))
        jpath = os.path.join(tmp, "t.json")
        main(["train", "--model", mdir, "--batch", bpath, "--lora", adir, "--steps", "5",
              "--lr", "0.01", "--out", jpath, "--out-tensors", os.path.join(tmp, "t.safetensors")])
        with open(jpath) as fh:
            tj = json.load(fh)
        check(f"CLI train lowers the loss ({label})", tj["final_loss"] < tj["losses"][0],
              f"({tj['losses'][0]:.4f} -> {tj['final_loss']:.4f})")

    rejected = 0
    for extra in (["--gemma3", "--attn-softcap", "5"], ["--gemma", "--final-softcap", "3"],
                  ["--gemma2", "--attn-softcap", "0"], ["--gemma2", "--rope-local-theta", "1e4"],
                  ["--gemma2", "--layers", "2", "--layer-types", "sliding"]):
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # argparse's usage and error
                main(["init", "--arch", "llama", "--out", os.path.join(tmp, "bad")] + extra)
        except SystemExit:
            rejected += 1
    check("CLI init refuses soft-caps transformers ignores or cannot run, gemma3-only options on gemma2",
          rejected == 5, f"({rejected}/5)")

    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    print("selftest:", "FAILED " + ", ".join(failures) if failures else "all passed")
    return 1 if failures else 0


# ----------------------------------------------------------------------------- CLI

def softcap_arg(text):
    """--attn-softcap / --final-softcap: a positive number, or none (the key written as null)."""
    if text.lower() == "none":
        return "none"
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"want a positive number or none, got {text!r}")
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("init")
    p.add_argument("--arch", choices=["llama", "gpt2"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=None, help="default 4")
    p.add_argument("--kv-heads", type=int, default=None, help="llama default 2")
    p.add_argument("--intermediate", type=int, default=None,
                   help="llama default 2*hidden; gpt2 n_inner (null = 4*hidden)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-pos", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=None,
                   help="default 10000 (--gemma3: 1e6, the full_attention layers' theta)")
    p.add_argument("--rope-scaling", default=None, help='JSON, e.g. {"rope_type":"llama3",...}')
    p.add_argument("--rope-parameters", action="store_true",
                   help="write the newer rope_parameters dict instead of rope_theta/rope_scaling "
                        "(--gemma3: nested by layer type, no rope_local_base_freq)")
    p.add_argument("--tie", action="store_true")
    p.add_argument("--attention-bias", action="store_true")
    p.add_argument("--mlp-bias", action="store_true")
    p.add_argument("--qwen2", action="store_true")
    p.add_argument("--mistral", action="store_true")
    p.add_argument("--qwen3", action="store_true",
                   help="Qwen3ForCausalLM: q_norm/k_norm, --attention-bias on q/k/v/o, "
                        "head_dim always written")
    p.add_argument("--gemma", action="store_true",
                   help="GemmaForCausalLM: Gemma norm (1 + w), sqrt(hidden)-scaled embedding, "
                        "GELU MLP, --attention-bias on q/k/v/o, head_dim always written")
    p.add_argument("--gemma2", action="store_true",
                   help="Gemma2ForCausalLM (gemma2): --gemma plus sandwich norms, sliding / full "
                        "layers (one RoPE), attention and final logit soft-capping")
    p.add_argument("--gemma3", action="store_true",
                   help="Gemma3ForCausalLM (gemma3_text): --gemma plus q/k norms, sandwich norms, "
                        "sliding / full layers")
    p.add_argument("--hidden-act", choices=["gelu_pytorch_tanh", "gelu"], default=None,
                   help="Gemma's MLP activation (hidden_act / gemma2, gemma3 hidden_activation), "
                        "default gelu_pytorch_tanh; gelu = exact erf GELU")
    p.add_argument("--layer-types", default=None,
                   help="--gemma2/--gemma3: comma list of sliding|full (or the full names), one per "
                        "layer (default: --gemma2 even layers sliding; --gemma3 every 6th layer full)")
    p.add_argument("--query-pre-attn-scalar", type=int, default=None,
                   help="--gemma2/--gemma3: attention scale query_pre_attn_scalar^-0.5 "
                        "(default: head_dim)")
    p.add_argument("--attn-softcap", type=softcap_arg, default=None,
                   help="--gemma2: attn_logit_softcapping, a positive number or none (default 50); "
                        "--gemma3 only none (transformers 5.12 ignores it there)")
    p.add_argument("--final-softcap", type=softcap_arg, default=None,
                   help="--gemma2/--gemma3: final_logit_softcapping, a positive number or none "
                        "(default: --gemma2 30, --gemma3 none)")
    p.add_argument("--rope-local-theta", type=float, default=None,
                   help="--gemma3: rope_local_base_freq, the sliding layers' theta (default 1e4)")
    p.add_argument("--pad-token-id", type=int, default=None,
                   help="--gemma/--gemma2/--gemma3: pad_token_id (nn.Embedding padding_idx: that row gets no "
                        "gradient from the lookup); default null")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="mistral / qwen: sliding_window; --gemma2/--gemma3: the sliding layers' "
                        "window (default 4096)")
    p.add_argument("--eps", type=float, default=None, help="rms_norm_eps / layer_norm_epsilon")
    p.add_argument("--init-std", type=float, default=None,
                   help="constant std for weights (default 0.8/sqrt(fan_in))")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default="float32")

    p = sub.add_parser("init-lora")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--alpha", type=float, default=8)
    p.add_argument("--targets", default="q_proj,v_proj",
                   help="comma list, 'all-linear', or a regex (PEFT target_modules)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--dora", action="store_true",
                   help="use_dora: magnitudes saved as lora_magnitude_vector, 20 %% off the norms PEFT starts them at")
    p.add_argument("--bias", choices=["none", "all", "lora_only"], default="none",
                   help="PEFT's bias: the base biases trained (saved, moved off the base's values)")
    p.add_argument("--rank-pattern", default="{}", help="JSON object: PEFT's rank_pattern (pattern -> r)")
    p.add_argument("--alpha-pattern", default="{}", help="JSON object: PEFT's alpha_pattern (pattern -> lora_alpha)")
    p.add_argument("--modules-to-save", default=None,
                   help="comma list (PEFT modules_to_save): saved as perturbed copies of the base's")

    p = sub.add_parser("make-batch")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--max-docs", type=int, default=3)
    p.add_argument("--min-doc", type=int, default=2)
    p.add_argument("--ignore-frac", type=float, default=0.1)
    p.add_argument("--no-pad", dest="pad", action="store_false",
                   help="no trailing padding (default: odd rows end in padding)")

    p = sub.add_parser("forward")
    p.add_argument("--model", required=True)
    p.add_argument("--batch", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--lora", default=None)
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float64",
                   help="bfloat16: the model's tensors in bf16 as from_pretrained(torch_dtype=bfloat16), "
                        "LoRA tensors fp32 as PEFT makes them")
    p.add_argument("--no-grad", action="store_true")
    p.add_argument("--autocast", action="store_true",
                   help="with --lora on a 16-bit model: the adapters under torch.autocast in that dtype, "
                        "as the Trainer's bf16 / fp16 runs PEFT's")

    p = sub.add_parser("train")
    p.add_argument("--model", required=True)
    p.add_argument("--batch", required=True)
    p.add_argument("--lora", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="JSON with per-step losses")
    p.add_argument("--out-tensors", default=None, help="final LoRA tensors (PEFT keys, f32)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--betas", default="0.9,0.999")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--max-grad-norm", type=float, default=0.0, help="0 = no clipping")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")

    sub.add_parser("selftest")
    a = ap.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if a.cmd == "init":
        if a.arch == "gpt2" and (a.qwen2 or a.mistral or a.qwen3 or a.kv_heads):
            ap.error("--qwen2/--mistral/--qwen3/--kv-heads are llama-family options")
        if a.arch == "gpt2" and (a.gemma or a.gemma2 or a.gemma3):
            ap.error("--gemma/--gemma2/--gemma3 are llama-family options")
        if a.qwen2 + a.mistral + a.qwen3 + a.gemma + a.gemma2 + a.gemma3 > 1:
            ap.error("--qwen2, --mistral, --qwen3, --gemma, --gemma2 and --gemma3 exclude each other")
        if a.qwen3 and a.mlp_bias:
            ap.error("--mlp-bias: Qwen3's MLP has no bias")
        gemma = a.gemma or a.gemma2 or a.gemma3
        if gemma and a.mlp_bias:
            ap.error("--mlp-bias: Gemma's MLP has no bias")
        if not gemma and (a.hidden_act or a.pad_token_id is not None):
            ap.error("--hidden-act / --pad-token-id are --gemma / --gemma2 / --gemma3 options")
        if not (a.gemma2 or a.gemma3) and (a.layer_types or a.query_pre_attn_scalar is not None or
                                           a.attn_softcap is not None or a.final_softcap is not None):
            ap.error("--layer-types / --query-pre-attn-scalar / --attn-softcap / --final-softcap "
                     "are --gemma2 / --gemma3 options")
        if not a.gemma3 and a.rope_local_theta is not None:
            ap.error("--rope-local-theta is a --gemma3 option (Gemma 2 has one RoPE)")
        if a.gemma3 and a.attn_softcap not in (None, "none"):
            ap.error("--attn-softcap: transformers 5.12's Gemma3Attention ignores attn_logit_softcapping")
        if a.gemma and a.sliding_window is not None:
            ap.error("--sliding-window: Gemma (1) has no sliding window")
        if (a.gemma2 or a.gemma3) and a.layer_types:
            bad = [t for t in a.layer_types.split(",") if t.strip() not in GEMMA_LAYER_TYPES]
            if bad or len(a.layer_types.split(",")) != a.layers:
                ap.error(f"--layer-types: want {a.layers} of sliding|full, got {a.layer_types!r}")
        return cmd_init(a)
    if a.cmd == "init-lora":
        return cmd_init_lora(a)
    if a.cmd == "make-batch":
        return cmd_make_batch(a)
    if a.cmd == "forward":
        return cmd_forward(a)
    if a.cmd == "train":
        return cmd_train(a)
    return selftest()


if __name__ == "__main__":
    sys.exit(main() or 0)
