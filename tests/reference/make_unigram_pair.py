#!/usr/bin/env python3
"""Writes the same unigram tokenizer twice: OUT/tokenizer.json (Hugging Face, model
Unigram) and OUT/tokenizer.model (SentencePiece ModelProto, model_type UNIGRAM), from the
pieces of a Llama-2-style tokenizer.json (byte fallback, Prepend/Replace normalizers).
Scores are synthetic, -(2 + log2(id + 1)) on a 1/64 grid (exact in float32 and in sums),
so the library's Viterbi on the .json is a reference for memtune's on the .model.
Standard library only:
  python3 make_unigram_pair.py LLAMA2_TOKENIZER_JSON OUT_DIR
"""
import json
import math
import os
import re
import struct
import sys

from make_sp_model import field


def main():
    src, out_dir = sys.argv[1], sys.argv[2]
    tok = json.load(open(src, encoding="utf-8"))
    model = tok["model"]
    specials = {a["content"] for a in tok.get("added_tokens", []) if a["special"]}
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    unk = model.get("unk_token")
    proto = bytearray()
    vocab = []
    for piece, i in by_id:
        if piece == unk:
            ptype = 2
        elif piece in specials:
            ptype = 3
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            ptype = 6
        else:
            ptype = 1
        score = -round((2 + math.log2(i + 1)) * 64) / 64 if ptype == 1 else 0.0
        vocab.append([piece, score])
        proto += field(1, 2, field(1, 2, piece.encode("utf-8")) + field(2, 5, struct.pack("<f", score)) +
                       field(3, 0, ptype))
    proto += field(2, 2, field(3, 0, 1) + field(4, 0, len(by_id)) + field(35, 0, 1))  # UNIGRAM, byte_fallback
    proto += field(3, 2, field(1, 2, b"identity") + field(3, 0, 1) + field(4, 0, 0))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(proto)
    tok["model"] = {"type": "Unigram", "unk_id": model["vocab"][unk], "vocab": vocab, "byte_fallback": True}
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
