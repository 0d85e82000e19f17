#!/usr/bin/env python3
"""Independent NF4 reference, written from bitsandbytes' algorithm (NumPy, fp32 math).

  nf4_reference.py OUTDIR   writes fixtures for tests/runtime/nf4_test.cpp

bitsandbytes (quantize_4bit on CUDA, compress_statistics=True for double quantization):
  - blocks of `blocksize` consecutive elements of the flattened tensor; absmax = max|x|;
    scaled = x * (1 / absmax) in fp32; the 4-bit code is the number of midpoints between
    neighbouring codebook values that scaled exceeds (its dQuantizeNF4 decision tree);
    element 2k goes to the high nibble, 2k+1 to the low one (an odd tail pads with 0.0).
    memtune gives an all-zero block the code of 0.0 (bitsandbytes' kernel computes 0 * inf).
  - double quantization: offset = absmax.mean() (torch, fp32), absmax -= offset, then
    quantize_blockwise(blocksize=256) over create_dynamic_map(): per 256-block the absmax,
    x * (1 / absmax), and dQuantize's binary search with midpoint rounding.
  - dequantize: codebook[code] * absmax in fp32, with absmax = map[q] * nested + offset.
Files per case NAME: NAME.input (raw bytes in the case dtype), NAME.packed (uint8),
NAME.absmax (fp32 or uint8), NAME.nested_absmax (fp32), NAME.deq (fp32), and one line in
cases.txt: name dtype blocksize double_quant offset_bits json_state dim0 dim1 ...
"""
import json
import os
import sys
from fractions import Fraction

import numpy as np
import torch

F32 = np.float32

NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=F32)
# dQuantizeNF4's decision-tree literals (midpoints of neighbouring codes), as the CUDA
# compiler reads a float literal: the decimal rounded once, straight to fp32. (Through a
# double first, -0.8480964004993439 would land one fp32 step lower: a double-rounding tie.)
THRESHOLD_LITERALS = [
    "-0.8480964004993439", "-0.6106329262256622", "-0.4599952697753906", "-0.33967943489551544",
    "-0.23460740596055984", "-0.13791173323988914", "-0.045525018125772476", "0.03979014977812767",
    "0.1202552504837513", "0.2035212516784668", "0.2920137718319893", "0.3893125355243683",
    "0.5016634166240692", "0.6427869200706482", "0.8614784181118011"]


def f32_literal(text):
    """Correctly rounded fp32 of a decimal string (nearest, ties to even)."""
    exact = Fraction(text)
    guess = np.float32(float(text))
    cands = [np.nextafter(guess, F32(-2)), guess, np.nextafter(guess, F32(2))]
    def key(c):
        return (abs(Fraction(float(c)) - exact), int(np.array([c], F32).view(np.uint32)[0]) & 1)
    return min(cands, key=key)


THRESHOLDS = np.array([f32_literal(t) for t in THRESHOLD_LITERALS], dtype=F32)
# The literals are the midpoints of the codebook (to within one fp32 step).
_MID = ((NF4[:-1].astype(np.float64) + NF4[1:].astype(np.float64)) / 2).astype(F32)
assert np.all(np.abs(THRESHOLDS.view(np.int32) - _MID.view(np.int32)) <= 1)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes.functional.create_dynamic_map, same torch operations."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return np.array(data, dtype=F32)


DYNAMIC = create_dynamic_map()


def dquantize(code, x):
    """bitsandbytes' dQuantize<0> (binary search, then the nearer neighbour by midpoint)."""
    x = F32(x)
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = F32(-1.0), F32(1.0)
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower = pivot, val
            pivot += i
        else:
            upper_pivot, upper = pivot, val
            pivot -= i
        val = code[pivot]
        i >>= 1
    if upper_pivot == 255:
        upper = code[upper_pivot]
    if lower_pivot == 0:
        lower = code[lower_pivot]
    if x > val:
        mid = F32((upper + val) * F32(0.5))
        return upper_pivot if x > mid else pivot
    mid = F32((lower + val) * F32(0.5))
    return lower_pivot if x < mid else pivot


def quantize(x32, blocksize, double_quant):
    n = x32.size
    flat = x32.reshape(-1)
    nb = (n + blocksize - 1) // blocksize
    codes = np.empty(n, dtype=np.uint8)
    absmax = np.empty(nb, dtype=F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        for b in range(nb):
            blk = flat[b * blocksize:(b + 1) * blocksize]
            m = np.max(np.abs(blk)).astype(F32)
            absmax[b] = m
            if m == 0:
                codes[b * blocksize:b * blocksize + blk.size] = 7
                continue
            scaled = blk * (F32(1.0) / m)
            codes[b * blocksize:b * blocksize + blk.size] = (scaled[:, None] > THRESHOLDS[None, :]).sum(1)
    if n % 2:
        codes = np.append(codes, np.uint8(7))  # padding element 0.0
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    out = {"packed": packed, "absmax_fp32": absmax}
    if not double_quant:
        out["absmax"] = absmax
        out["recon"] = absmax
        return out
    offset = F32(torch.from_numpy(absmax.copy()).mean().item())
    diff = (absmax - offset).astype(F32)
    nb2 = (nb + 255) // 256
    nested = np.empty(nb2, dtype=F32)
    qcodes = np.empty(nb, dtype=np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in range(nb2):
            blk = diff[c * 256:(c + 1) * 256]
            m = np.max(np.abs(blk)).astype(F32)
            nested[c] = m
            r = F32(1.0) / m
            for k, v in enumerate(blk):
                qcodes[c * 256 + k] = dquantize(DYNAMIC, F32(v * r))
    recon = (DYNAMIC[qcodes] * np.repeat(nested, 256)[:nb]).astype(F32)
    recon = (recon + offset).astype(F32)
    out.update(absmax=qcodes, nested_absmax=nested, offset=offset, recon=recon)
    return out


def dequantize(packed, recon, n, blocksize):
    codes = np.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n]
    scale = np.repeat(recon, blocksize)[:n]
    return (NF4[codes] * scale).astype(F32)


def json_state(dtype, blocksize, shape, q):
    """What QuantState.as_dict(packed=True) packs: json.dumps of the non-tensor items."""
    d = {"quant_type": "nf4", "blocksize": blocksize, "dtype": dtype, "shape": tuple(shape)}
    if "offset" in q:
        d.update({"nested_blocksize": 256, "nested_dtype": "float32",
                  "nested_offset": float(q["offset"])})
    return json.dumps(d)


def make_input(rng, shape, dtype):
    rows = shape[0] if len(shape) > 1 else 1
    x = rng.standard_normal(shape).astype(F32)
    # Per-row scales over several decades so the absmax values (and their codes) vary.
    scale = (10.0 ** rng.uniform(-3, 1, size=(rows,) + (1,) * (len(shape) - 1))).astype(F32)
    x = (x * scale if len(shape) > 1 else x * scale.reshape(-1)[0]).astype(F32)
    t = torch.from_numpy(x).to({"float32": torch.float32, "float16": torch.float16,
                                "bfloat16": torch.bfloat16}[dtype])
    if dtype == "bfloat16":
        raw = t.view(torch.int16).numpy().tobytes()
    else:
        raw = t.numpy().tobytes()
    return t.float().numpy(), raw


CASES = [
    # name, shape, dtype, blocksize, double_quant
    ("square64", (64, 64), "float32", 64, True),
    ("odd_partial", (33, 65), "float32", 64, True),
    ("bs32_nodq", (7, 300), "float32", 32, False),
    ("bs128", (128, 520), "float32", 128, True),
    ("one_partial_block", (1001,), "float32", 4096, False),
    ("many_nested", (300, 257), "float32", 64, True),
    ("fp16", (96, 130), "float16", 64, True),
    ("bf16", (50, 77), "bfloat16", 256, True),
    ("bf16_nodq", (40, 64), "bfloat16", 64, False),
    ("bs4096", (3, 5000), "float32", 4096, True),
]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(1234)
    lines = []
    for name, shape, dtype, bs, dq in CASES:
        x32, raw = make_input(rng, shape, dtype)
        q = quantize(x32, bs, dq)
        n = x32.size
        deq = dequantize(q["packed"], q["recon"], n, bs)
        with open(os.path.join(out, name + ".input"), "wb") as f:
            f.write(raw)
        q["packed"].tofile(os.path.join(out, name + ".packed"))
        q["absmax"].tofile(os.path.join(out, name + ".absmax"))
        if dq:
            q["nested_absmax"].tofile(os.path.join(out, name + ".nested_absmax"))
        deq.tofile(os.path.join(out, name + ".deq"))
        offset_bits = int(np.array([q.get("offset", F32(0))], dtype=F32).view(np.uint32)[0])
        state = json_state(dtype, bs, shape, q).replace(" ", "\x01")  # one token per field
        lines.append(" ".join([name, dtype, str(bs), str(int(dq)), str(offset_bits), state]
                              + [str(d) for d in shape]))
    DYNAMIC.tofile(os.path.join(out, "dynamic_map"))
    with open(os.path.join(out, "cases.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
