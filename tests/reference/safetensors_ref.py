#!/usr/bin/env python3
"""Independent safetensors writer/reader for memtune's tests (stdlib + numpy only).

Written from the format description in huggingface/safetensors' README: 8-byte
little-endian u64 header length N, N bytes of UTF-8 JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the data section, which
the tensors' ranges cover exactly. bf16 is encoded and decoded here with bit arithmetic
(float32's upper 16 bits, round to nearest even), not by any tensor library.

  safetensors_ref.py fixtures DIR   writes fixture files into DIR and DIR/expected.json
  safetensors_ref.py read FILE      validates FILE and prints its contents as JSON
  safetensors_ref.py read-checkpoint DIR   same for model.safetensors[.index.json] in DIR
"""
import json
import math
import os
import struct
import sys

import numpy as np

NUMPY = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U8": "u1", "BOOL": "u1", "BF16": "<u2",
}
SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
        "U8": 1, "BOOL": 1}


def bf16_bits(values):
    """float32 values -> bf16 bit patterns (uint16), round to nearest even, NaN kept."""
    bits = np.asarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(np.asarray(values, dtype="<f4"))
    rounded = np.where(nan, (bits >> 16) | 0x40, rounded)
    return rounded.astype("<u2")


def bf16_values(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).astype("<u4").view("<f4").astype(np.float64)


def encode(dtype, values, shape):
    """Python numbers -> (little-endian bytes, the values the bytes hold as floats)."""
    count = int(np.prod(shape)) if shape else 1
    assert len(values) == count, (dtype, len(values), shape)
    if dtype == "BF16":
        bits = bf16_bits(values)
        return bits.tobytes(), bf16_values(bits).tolist()
    if dtype == "BOOL":
        arr = np.asarray([1 if v else 0 for v in values], dtype="u1")
        return arr.tobytes(), arr.astype(np.float64).tolist()
    arr = np.asarray(values, dtype=NUMPY[dtype])
    return arr.tobytes(), arr.astype(np.float64).tolist()


def json_values(values):
    out = []
    for v in values:
        if isinstance(v, float) and math.isnan(v):
            out.append("nan")
        elif isinstance(v, float) and math.isinf(v):
            out.append("inf" if v > 0 else "-inf")
        else:
            out.append(v)
    return out


def write_file(path, entries, metadata=None, header_order=None, pad=True):
    """entries: list of (name, dtype, shape, values) in data order."""
    header = {}
    blobs = []
    expected = {}
    offset = 0
    for name, dtype, shape, values in entries:
        raw, held = encode(dtype, values, shape)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
        expected[name] = {"dtype": dtype, "shape": list(shape), "values": json_values(held),
                          "hex": raw.hex()}
    ordered = {}
    if metadata is not None:
        ordered["__metadata__"] = metadata
    for name in (header_order or list(header)):
        ordered[name] = header[name]
    text = json.dumps(ordered, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    else:  # make 8 + N = 2 (mod 8): the data section starts 2 bytes past an 8-byte boundary
        text += b" " * ((2 - 8 - len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return {"metadata": metadata or {}, "data_order": [e[0] for e in entries],
            "tensors": expected}


def fixtures(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(1234)
    normal = lambda n: [float(x) for x in rng.standard_normal(n)]
    special = [0.0, -0.0, 1.0, -2.5, 65504.0, 1e-3, float("inf"), float("-inf"), float("nan"),
               3.140625, 1.0 / 3.0, -1e30]
    entries = [
        ("model.embed.weight", "F32", [4, 3], normal(12)),
        ("double", "F64", [2, 2], [math.pi, -math.e, 1e300, 5e-324]),
        ("half.specials", "F16", [12], special[:5] + [1e-3, float("inf"), float("-inf"),
                                                      float("nan"), 3.140625, 1.0 / 3.0, -7.0]),
        ("bf16.specials", "BF16", [3, 4], special),
        ("bf16.random", "BF16", [5], normal(5)),
        ("i64", "I64", [3], [-(2 ** 63), 2 ** 63 - 1, -1]),
        ("i32", "I32", [2, 1], [-(2 ** 31), 123456789]),
        ("i16", "I16", [2], [-32768, 32767]),
        ("i8", "I8", [3], [-128, 127, 0]),
        ("u8", "U8", [2, 2], [0, 1, 200, 255]),
        ("mask", "BOOL", [5], [True, False, True, True, False]),
        ("scalar", "F32", [], [2.75]),
        ("empty", "F32", [0, 3], []),
        ("empty.bf16", "BF16", [2, 0], []),
        ("ключ.вес", "F16", [2], [0.5, -0.25]),
        ("重み/😀", "I32", [1], [42]),
    ]
    # Header keys sorted (as the Rust writer does), data in a different order.
    order = sorted(e[0] for e in entries)
    expected = {"mixed.safetensors": write_file(
        os.path.join(out_dir, "mixed.safetensors"), entries,
        metadata={"format": "pt", "note": "ünïcode ✓", "empty": ""}, header_order=order)}
    # A header that leaves the data section 2 bytes off alignment and a 3-byte tensor first:
    # the F32 data starts at 5 (mod 8) in the file, and so in memory.
    expected["unaligned.safetensors"] = write_file(
        os.path.join(out_dir, "unaligned.safetensors"),
        [("bytes", "U8", [3], [1, 2, 3]), ("w", "F32", [2, 2], [1.5, -2.0, 3.25, 4.0])],
        pad=False)
    expected["empty_file.safetensors"] = write_file(
        os.path.join(out_dir, "empty_file.safetensors"), [])

    # A sharded checkpoint in Hugging Face's layout.
    shard_dir = os.path.join(out_dir, "sharded")
    os.makedirs(shard_dir, exist_ok=True)
    shards = [
        [("model.layers.0.w", "F32", [2, 3], normal(6)), ("model.layers.0.b", "F16", [3], normal(3))],
        [("model.layers.1.w", "BF16", [3, 2], normal(6)), ("lm_head.weight", "F32", [4], normal(4))],
        [("model.norm.weight", "F32", [3], normal(3))],
    ]
    weight_map = {}
    total = 0
    sharded_expected = {"tensors": {}}
    for i, entries in enumerate(shards):
        name = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        got = write_file(os.path.join(shard_dir, name), entries, metadata={"format": "pt"})
        for t, info in got["tensors"].items():
            weight_map[t] = name
            total += len(info["hex"]) // 2
            info["file"] = name
            sharded_expected["tensors"][t] = info
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    sharded_expected["total_size"] = total
    expected["sharded"] = sharded_expected

    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False)


def fail(path, message):
    sys.stderr.write("safetensors_ref: %s: %s\n" % (path, message))
    sys.exit(2)


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail(path, "shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        fail(path, "header length %d past end" % n)
    text = blob[8:8 + n]
    if not text.startswith(b"{"):
        fail(path, "header does not start with {")
    pairs = json.loads(text.decode("utf-8"), object_pairs_hook=lambda p: p)
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        fail(path, "duplicate keys")
    header = dict(pairs)
    metadata = dict(header.pop("__metadata__", []))
    data = blob[8 + n:]
    tensors = {}
    spans = []
    for name, fields in header.items():
        fields = dict(fields)
        dtype, shape = fields["dtype"], fields["shape"]
        begin, end = fields["data_offsets"]
        count = 1
        for d in shape:
            count *= d
        if count * SIZE[dtype] != end - begin or end > len(data):
            fail(path, "tensor %s: bad size or range" % name)
        raw = data[begin:end]
        if dtype == "BF16":
            values = bf16_values(np.frombuffer(raw, dtype="<u2")).tolist()
        else:
            values = np.frombuffer(raw, dtype=NUMPY[dtype]).astype(np.float64).tolist()
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end],
                         "values": json_values(values), "hex": raw.hex()}
        spans.append((begin, end, name))
    cursor = 0
    for begin, end, name in sorted(spans):
        if begin != cursor:
            fail(path, "tensor %s: hole or overlap at %d" % (name, begin))
        cursor = end
    if cursor != len(data):
        fail(path, "hole at the end of the data section")
    return {"header_len": n, "header_order": [k for k in keys if k != "__metadata__"],
            "metadata": metadata, "tensors": tensors}


def read_checkpoint(directory):
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return {"files": {"model.safetensors": read(os.path.join(directory, "model.safetensors"))}}
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    files = {}
    for name in sorted(set(index["weight_map"].values())):
        files[name] = read(os.path.join(directory, name))
    for tensor, name in index["weight_map"].items():
        if tensor not in files[name]["tensors"]:
            fail(index_path, "tensor %s not in %s" % (tensor, name))
    return {"index": index, "files": files}


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("fixtures", "read", "read-checkpoint"):
        sys.stderr.write(__doc__)
        sys.exit(1)
    if sys.argv[1] == "fixtures":
        fixtures(sys.argv[2])
    elif sys.argv[1] == "read":
        print(json.dumps(read(sys.argv[2]), ensure_ascii=False))
    else:
        print(json.dumps(read_checkpoint(sys.argv[2]), ensure_ascii=False))


if __name__ == "__main__":
    main()
