#!/usr/bin/env python3
"""Learns memtune's tiny tokenizer (examples/tiny-tokenizer/): a byte-level BPE like
GPT-2 / Llama 3 with 1024 ids in all: the 256 byte tokens first (id = byte value), 763
merges learned here, then the specials <|begin_of_text|> (bos), <|end_of_text|> (eos),
<|pad|>, <|im_start|>, <|im_end|>.

The training text is generated (English sentences, arithmetic and string tasks, chat
turns), so the output is the same on every run. Standard library only:
  python3 scripts/make_tiny_tokenizer.py examples/tiny-tokenizer
  python3 scripts/make_tiny_tokenizer.py examples/char-tokenizer --merges 0

With --merges 0 the tokenizer is character-level (one byte token per ASCII character), the
quickstart's: its tasks ask for a word's first or last letter or its length, which a model
of 1.1M parameters reads off single-letter tokens, where BPE tokens would have it learn each
token's spelling first. The specials
keep their ids 1019..1023 whatever the number of merges (reserved special tokens fill the ids
in between, as in Llama 3's file), so the tiny presets' 1024-row embeddings and their bos/eos
ids fit every variant.
"""
import argparse
import collections
import json
import os
import random
import re
import sys

N_MERGES = 763
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
FIRST_SPECIAL = 256 + N_MERGES  # 1019: the tiny presets' bos_token_id
# Llama 3's pre-tokenizer regex, as written in its tokenizer.json.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# The same for Python's re on the (ASCII) training text.
PY_PATTERN = re.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[A-Za-z]+|\d{1,3}|"
                        r" ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = """the of and to a in is it you that he was for on are with as I his they be at one
have this from or had by hot word but what some we can out other were all there when up use
your how said an each she which do their time if will way about many then them write would
like so these her long make thing see him two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came show
every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want
air well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left late
run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river
car feet care second book carry took science eat room friend began idea fish mountain stop
once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure
door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach week final
gave green oh quick develop ocean warm free minute strong special mind behind clear tail
produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead
dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring
yes distant fill east paint language among""".split()
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]


def training_text(rng):
    parts = []
    for _ in range(4000):
        n = rng.randint(4, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(NAMES))
        s = " ".join(words)
        parts.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ","]))
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        r = a + b if op == "+" else a - b if op == "-" else a * b
        parts.append(rng.choice([f"What is {a} {op} {b}? The answer is {r}.",
                                 f"Compute {a} {op} {b}.\nAnswer: {r}",
                                 f"{a} {op} {b} = {r}"]))
    for _ in range(1500):
        w = rng.choice(WORDS)
        parts.append(rng.choice([f"Reverse the string \"{w}\". The answer is \"{w[::-1]}\".",
                                 f"Spell \"{w}\": {' '.join(w)}",
                                 f"How many letters are in \"{w}\"? There are {len(w)}."]))
    for _ in range(800):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        parts.append(f"user\n{q.capitalize()}?\nassistant\n{a.capitalize()}.\n")
    return "\n".join(parts)


def bytes_to_unicode():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def learn(text, n_merges):
    b2u = bytes_to_unicode()
    counts = collections.Counter(PY_PATTERN.findall(text))
    words = [[b2u[b] for b in w.encode("utf-8")] for w in counts]
    freqs = [counts[w] for w in counts]
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freqs[i]
            where[p].add(i)
    merges = []
    for _ in range(n_merges):
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged = best[0] + best[1]
        for i in list(where[best]):
            w = words[i]
            for p in zip(w, w[1:]):
                pairs[p] -= freqs[i]
                if pairs[p] <= 0:
                    del pairs[p]
            out, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and (w[k], w[k + 1]) == best:
                    out.append(merged)
                    k += 2
                else:
                    out.append(w[k])
                    k += 1
            words[i] = out
            for p in zip(out, out[1:]):
                pairs[p] += freqs[i]
                where[p].add(i)
        where.pop(best, None)
    return b2u, merges


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default="examples/tiny-tokenizer")
    ap.add_argument("--merges", type=int, default=N_MERGES, help=f"0..{N_MERGES} (default {N_MERGES})")
    args = ap.parse_args()
    if not 0 <= args.merges <= N_MERGES:
        sys.exit(f"--merges {args.merges}: must be in 0..{N_MERGES}, so the specials keep ids {FIRST_SPECIAL}..")
    out_dir = args.out_dir
    b2u, merges = learn(training_text(random.Random(20240520)), args.merges)
    vocab = {b2u[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) == 256 + len(merges), "a merge produced a token twice"
    # Fewer merges leave ids free below the specials: reserved special tokens fill them, as in
    # Llama 3's file, so the ids run without a gap (the tokenizers library numbers added
    # tokens from the end of the vocabulary and finds none past a gap).
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(FIRST_SPECIAL - len(vocab))]
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(reserved + SPECIALS)]
    assert added[len(reserved)]["id"] == FIRST_SPECIAL
    bos = {"id": SPECIALS[0], "ids": [FIRST_SPECIAL], "tokens": [SPECIALS[0]]}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": SPECIALS[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": SPECIALS[0], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": SPECIALS[0], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {SPECIALS[0]: bos}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[2],
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"{out_dir}: {len(vocab) + len(added)} tokens ({len(merges)} merges, {len(reserved)} reserved)")


if __name__ == "__main__":
    main()
