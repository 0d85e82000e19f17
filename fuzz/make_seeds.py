#!/usr/bin/env python3
"""Seeds for the fuzz targets from the project's own files (scripts/fuzz.sh runs it):
  python3 fuzz/make_seeds.py ROOT SEEDS_DIR    -> SEEDS_DIR/<target>/*
Small valid inputs of each format, so the fuzzer starts past the first checks. Standard
library only."""
import glob
import json
import os
import struct
import sys

root, out = sys.argv[1], sys.argv[2]


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def copy(target, pattern, prefix=b"", limit=None):
    for path in sorted(glob.glob(os.path.join(root, pattern))):
        with open(path, "rb") as f:
            data = f.read()
        if limit:
            data = b"".join(data.splitlines(keepends=True)[:limit])
        put(target, prefix.hex() + "-" + os.path.basename(path), prefix + data)


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> a safetensors file (8-byte aligned header)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


# safetensors: each dtype, empty and scalar tensors, metadata.
f32 = struct.pack("<6f", *range(6))
put("safetensors", "f32", safetensors([("w", "F32", [2, 3], f32)], {"format": "pt"}))
put("safetensors", "mixed", safetensors([
    ("a", "BF16", [2], b"\x80\x3f\x00\x40"), ("b", "F16", [1, 1], b"\x00\x3c"), ("c", "I64", [], struct.pack("<q", 7)),
    ("d", "U8", [3], b"abc"), ("e", "BOOL", [1], b"\x01"), ("f", "I8", [0, 4], b""), ("g", "F64", [1], struct.pack("<d", 1.5)),
    ("h", "I32", [1], b"\x01\x00\x00\x00"), ("i", "I16", [1], b"\x01\x00")]))
put("safetensors", "empty", safetensors([], {}))
put("safetensors", "unaligned", safetensors([("u", "U8", [1], b"x"), ("v", "F32", [1], b"\x00\x00\x80\x3f")]))

# safetensors_index: the shards the target writes at start (a [2,3] F32; b [4] BF16, c [1] I64).
index = {"metadata": {"total_size": 24 + 8 + 8},
         "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "c": "model-00002-of-00002.safetensors"}}
put("safetensors_index", "index.json", json.dumps(index, indent=2))
put("safetensors_index", "no-metadata.json", json.dumps({"weight_map": index["weight_map"]}))

# hf_config: the families memtune reads.
llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu", "torch_dtype": "bfloat16"}
put("hf_config", "llama.json", json.dumps(llama, indent=2))
put("hf_config", "llama3-rope.json", json.dumps(dict(llama, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}, tie_word_embeddings=True, head_dim=16)))
put("hf_config", "mistral.json", json.dumps(dict(llama, architectures=["MistralForCausalLM"], model_type="mistral",
                                                 sliding_window=32)))
put("hf_config", "qwen2.json", json.dumps(dict(llama, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                                               attention_bias=True)))
put("hf_config", "qwen3.json", json.dumps(dict(llama, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                               head_dim=32, use_sliding_window=False, sliding_window=None,
                                               layer_types=["full_attention", "full_attention"])))
gemma = dict(llama, architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=32,
             hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0)
put("hf_config", "gemma.json", json.dumps(gemma))
put("hf_config", "gemma3.json", json.dumps(dict(gemma, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                                                hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                    "rope_theta": 1e6},
                                                                 "sliding_attention": {"rope_type": "default",
                                                                                       "rope_theta": 1e4}})))
put("hf_config", "gemma2.json", json.dumps(dict(gemma, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                                                hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0)))
put("hf_config", "gpt2.json", json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
                                          "n_head": 4, "n_layer": 2, "n_positions": 128, "vocab_size": 256,
                                          "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}))

# bpe_tokenizer: the example tokenizer.
copy("bpe_tokenizer", "examples/tiny-tokenizer/tokenizer.json")

# config: every YAML config in the project.
for pattern in ("configs/*.yaml", "tests/trainer/fixtures/*.yaml", "examples/custom_model/*.yaml"):
    copy("config", pattern)
# TrainingArguments' scheduling, sampling and loss keys, and a held-out split.
put("config", "trainer-keys.yaml", """training:
  lr_scheduler_type: cosine_with_min_lr
  lr_scheduler_kwargs: {min_lr_rate: 0.1, num_cycles: 0.5}
  logging_strategy: epoch
  logging_first_step: true
  save_strategy: epoch
  eval_strategy: epoch
  group_by_length: true
  train_sampling_strategy: group_by_length
  label_smoothing_factor: 0.1
  neftune_noise_alpha: 5
  gradient_checkpointing: true
  gradient_checkpointing_kwargs: {use_reentrant: false}
data:
  train_file: train.jsonl
  eval_split: 0.05
""")
put("config", "plateau.yaml", """training:
  lr_scheduler_type: reduce_lr_on_plateau
  eval_steps: 5
  save_steps: 10
  metric_for_best_model: eval_loss
  greater_is_better: false
  load_best_model_at_end: true
  lr_scheduler_kwargs: {mode: min, factor: 0.5, patience: 2, threshold: 0.01, threshold_mode: abs, cooldown: 1,
                        min_lr: 1.0e-6, eps: 1.0e-9}
data:
  eval_file: eval.jsonl
""")
put("config", "wsd.yaml", """training:
  lr_scheduler_type: warmup_stable_decay
  lr_scheduler_kwargs: {num_decay_steps: 20, num_stable_steps: 5, warmup_type: cosine, decay_type: 1-sqrt,
                        min_lr_ratio: 0.1, num_cycles: 0.5}
""")

# dataset: the first byte picks format and options (fuzz/dataset_fuzz.cpp): 0 text,
# 1 instruction, 2-4 chat (llama-3, chatml, alpaca), 5 and 7 auto, 6 plain.
for mode in (0x00, 0x15, 0x80):
    copy("dataset", "examples/data/corpus.jsonl", bytes([mode]), limit=8)
for mode in (0x01, 0x39, 0x45, 0x05):
    copy("dataset", "examples/data/tasks_*.jsonl", bytes([mode]), limit=6)
for mode in (0x06, 0x1e):
    copy("dataset", "examples/data/corpus.txt", bytes([mode]), limit=30)
chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
for mode in (0x02, 0x03, 0x04, 0x57):
    put("dataset", "%02x-chat.jsonl" % mode, bytes([mode]) + "".join(json.dumps(r) + "\n" for r in chat).encode())


# token_file: llm.c headers, both versions.
def token_file(magic, version, tokens, width):
    header = struct.pack("<256i", magic, version, len(tokens), *([0] * 253))
    return header + b"".join(t.to_bytes(width, "little") for t in tokens)


put("token_file", "gpt2.bin", token_file(20240520, 1, [5, 6, 7, 0, 8, 9, 0], 2))
put("token_file", "llama3.bin", token_file(20240801, 7, [70000, 3, 0, 4], 4))
put("token_file", "empty.bin", token_file(20240520, 1, [], 2))

# train_state: what trainer/train_state.cpp writes.
state = {"step": 3, "sampler": {"epoch": 0, "offset": 6, "seed": 1234},
         "scaler": {"enabled": True, "scale": 65536.0, "good_steps": 3, "skipped": 0},
         "supervisor": {"micro_batch": 4, "good_steps": 3, "grow_wait": 50, "grown_from": 0},
         "optimizer": {"step": 3}, "checkpoint_layers": [True, False], "world_size": 1,
         "data": {"samples": 113, "target_tokens": 28672}}
put("train_state", "state.json", json.dumps(state, indent=2))
put("train_state", "old.json", json.dumps({k: v for k, v in state.items()
                                           if k not in ("checkpoint_layers", "world_size", "data")}))
put("train_state", "plateau.json", json.dumps(dict(state, lr_scheduler={
    "lr": 5e-4, "best": 2.25, "bad_evaluations": 1, "cooldown_counter": 0, "evaluations": 3},
    best={"metric": 2.25, "step": 2, "checkpoint": 2})))

# adapter_config: PEFT's file as peft 0.x writes it, and memtune's own.
adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
           "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
           "base_model_name_or_path": "tiny", "inference_mode": True, "modules_to_save": None,
           "use_rslora": False, "use_dora": False, "init_lora_weights": True}
put("adapter_config", "peft.json", json.dumps(adapter, indent=2))
put("adapter_config", "regex.json", json.dumps(dict(adapter, target_modules=".*\\.(q|k)_proj", layers_to_transform=[0, 1],
                                                    exclude_modules=["lm_head"], use_rslora=True)))
put("adapter_config", "all-linear.json", json.dumps(dict(adapter, target_modules="all-linear", revision=None)))
put("adapter_config", "patterns-bias.json", json.dumps(dict(adapter, bias="lora_only", use_dora=True,
                                                            rank_pattern={"model.layers.0.self_attn.q_proj": 4, "q_proj": 16},
                                                            alpha_pattern={"layers\\.1\\..*": 2.5})))
