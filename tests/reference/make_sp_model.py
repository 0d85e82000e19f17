#!/usr/bin/env python3
"""Writes a SentencePiece BPE .model (protobuf ModelProto) equivalent to a Llama-2-style
tokenizer.json (BPE with byte fallback, Prepend/Replace normalizers), so that memtune's
.model reader can be compared with the Hugging Face library on the same vocabulary.

Pieces keep their ids; <unk> is UNKNOWN, other special added tokens CONTROL, <0xXX> BYTE,
the rest NORMAL with score -(rank of the first merge that makes the piece), so that
sentencepiece's order (highest score first) is the tokenizer.json's merge order. Standard library only:
  python3 make_sp_model.py TOKENIZER_JSON OUT.model
"""
import json
import re
import struct
import sys


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 2:
        return key + varint(len(payload)) + payload
    if wire == 5:
        return key + payload
    raise ValueError(wire)


def main():
    tok = json.load(open(sys.argv[1], encoding="utf-8"))
    model = tok["model"]
    assert model["type"] == "BPE" and model.get("byte_fallback"), "a BPE tokenizer.json with byte_fallback"
    specials = {a["content"]: a["special"] for a in tok.get("added_tokens", [])}
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "ids must be dense"
    first_rank = {}
    for rank, m in enumerate(model["merges"]):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        first_rank.setdefault(a + b, rank)
    out = bytearray()
    for piece, i in by_id:
        if piece == model.get("unk_token"):
            ptype = 2
        elif specials.get(piece):
            ptype = 3
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            ptype = 6
        else:
            ptype = 1
        score = -float(first_rank.get(piece, len(first_rank) + i)) if ptype == 1 else 0.0
        sp = field(1, 2, piece.encode("utf-8")) + field(2, 5, struct.pack("<f", score)) + field(3, 0, ptype)
        out += field(1, 2, sp)
    trainer = field(3, 0, 2) + field(4, 0, len(by_id)) + field(35, 0, 1)  # BPE, vocab_size, byte_fallback
    normalizer = field(1, 2, b"identity") + field(3, 0, 1) + field(4, 0, 0)  # dummy prefix, keep spaces
    out += field(2, 2, trainer) + field(3, 2, normalizer)
    with open(sys.argv[2], "wb") as f:
        f.write(out)


if __name__ == "__main__":
    main()
