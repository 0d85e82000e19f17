#!/usr/bin/env python3
"""Independent NF4 and FP4 reference, written from bitsandbytes' algorithm (NumPy, fp32 math).

  nf4_reference.py OUTDIR   writes fixtures for tests/runtime/nf4_test.cpp

bitsandbytes (quantize_4bit on CUDA, compress_statistics=True for double quantization):
  - blocks of `blocksize` consecutive elements of the flattened tensor; absmax = max|x|;
    scaled = x * (1 / absmax) in fp32; the 4-bit code is the number of midpoints between
    neighbouring codebook values that scaled exceeds (its dQuantizeNF4 decision tree);
    element 2k goes to the high nibble, 2k+1 to the low one (an odd tail pads with 0.0).
    memtune gives an all-zero block the code of 0.0 (bitsandbytes' kernel computes 0 * inf).
    FP4: dQuantizeFP4's decision tree, ported branch for branch below (sign bit for x < 0,
    then the tree over |x|), and get_4bit_type("fp4")'s values for dequantization.
  - double quantization: offset = absmax.mean() (torch, fp32), absmax -= offset, then
    quantize_blockwise(blocksize=256) over create_dynamic_map(): per 256-block the absmax,
    x * (1 / absmax), and dQuantize's binary search with midpoint rounding.
  - dequantize: codebook[code] * absmax in fp32, with absmax = map[q] * nested + offset.
Files per case NAME: NAME.input (raw bytes in the case dtype), NAME.packed (uint8),
NAME.absmax (fp32 or uint8), NAME.nested_absmax (fp32), NAME.deq (fp32), and one line in
cases.txt: name quant_type dtype blocksize double_quant offset_bits json_state dim0 dim1 ...
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


def fp4_codebook():
    """bitsandbytes.functional.get_4bit_type("fp4"): the list (its "-0" is an int, so +0.0)
    divided by its largest magnitude, in torch fp32."""
    data = torch.tensor([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0])
    data.div_(data.abs().max())
    return data.numpy().astype(F32)


FP4 = fp4_codebook()


def fp4_code(x):
    """dQuantizeFP4 (csrc/kernels.cu), branch for branch; fp32 comparisons."""
    lit = f32_literal
    sign = 0b1000 if x < 0 else 0
    x = F32(abs(x))
    if x > lit("0.29166667"):
        if x > lit("0.583333"):
            return (0b0011 if x > lit("0.8333333") else 0b0010) + sign
        return (0b101 if x > lit("0.4166667") else 0b100) + sign
    if x > lit("0.0859375"):
        return (0b0111 if x > lit("0.20833333") else 0b0110) + sign
    return (0b0001 if x > lit("0.00260417") else 0b0000) + sign


def codes_of(quant_type, scaled):
    if quant_type == "nf4":
        return (scaled[:, None] > THRESHOLDS[None, :]).sum(1)
    return np.array([fp4_code(v) for v in scaled], dtype=np.uint8)


def codebook(quant_type):
    return NF4 if quant_type == "nf4" else FP4
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


def quantize(x32, blocksize, double_quant, quant_type):
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
                codes[b * blocksize:b * blocksize + blk.size] = codes_of(quant_type, np.zeros(1, F32))[0]
                continue
            scaled = blk * (F32(1.0) / m)
            codes[b * blocksize:b * blocksize + blk.size] = codes_of(quant_type, scaled)
    if n % 2:
        codes = np.append(codes, np.uint8(codes_of(quant_type, np.zeros(1, F32))[0]))  # padding element 0.0
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


def dequantize(packed, recon, n, blocksize, quant_type):
    codes = np.stack([packed >> 4, packed & 15], 1).reshape(-1)[:n]
    scale = np.repeat(recon, blocksize)[:n]
    return (codebook(quant_type)[codes] * scale).astype(F32)


def json_state(quant_type, dtype, blocksize, shape, q):
    """What QuantState.as_dict(packed=True) packs: json.dumps of the non-tensor items."""
    d = {"quant_type": quant_type, "blocksize": blocksize, "dtype": dtype, "shape": tuple(shape)}
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


def fp4_edges():
    """One block of 128 with absmax 1, so each value is its own scaled value: every pivot of
    dQuantizeFP4 and its fp32 neighbours, both signs, signed zeros and tiny values."""
    vals = [1.0, -0.0, 0.0, -1e-30, 1e-30, -1e-40]
    for t in ["0.00260417", "0.0859375", "0.20833333", "0.29166667", "0.4166667", "0.583333", "0.8333333"]:
        p = f32_literal(t)
        for v in (np.nextafter(p, F32(0)), p, np.nextafter(p, F32(2))):
            vals += [float(v), -float(v)]
    vals += list(FP4.astype(float)) + [-1.0, 0.999]
    x = np.zeros(128, dtype=F32)
    x[:len(vals)] = np.array(vals, dtype=F32)
    return x


CASES = [
    # name, shape, dtype, blocksize, double_quant, quant_type
    ("square64", (64, 64), "float32", 64, True, "nf4"),
    ("odd_partial", (33, 65), "float32", 64, True, "nf4"),
    ("bs32_nodq", (7, 300), "float32", 32, False, "nf4"),
    ("bs128", (128, 520), "float32", 128, True, "nf4"),
    ("one_partial_block", (1001,), "float32", 4096, False, "nf4"),
    ("many_nested", (300, 257), "float32", 64, True, "nf4"),
    ("fp16", (96, 130), "float16", 64, True, "nf4"),
    ("bf16", (50, 77), "bfloat16", 256, True, "nf4"),
    ("bf16_nodq", (40, 64), "bfloat16", 64, False, "nf4"),
    ("bs4096", (3, 5000), "float32", 4096, True, "nf4"),
    ("fp4_square64", (64, 64), "float32", 64, True, "fp4"),
    ("fp4_odd_nodq", (33, 65), "float32", 64, False, "fp4"),
    ("fp4_bf16", (50, 77), "bfloat16", 256, True, "fp4"),
    ("fp4_fp16_bs32", (96, 130), "float16", 32, False, "fp4"),
    ("fp4_edges", (128,), "float32", 128, False, "fp4"),
]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(1234)
    lines = []
    for name, shape, dtype, bs, dq, qt in CASES:
        if name == "fp4_edges":
            x32 = fp4_edges()
            raw = x32.tobytes()
        else:
            x32, raw = make_input(rng, shape, dtype)
        q = quantize(x32, bs, dq, qt)
        n = x32.size
        deq = dequantize(q["packed"], q["recon"], n, bs, qt)
        with open(os.path.join(out, name + ".input"), "wb") as f:
            f.write(raw)
        q["packed"].tofile(os.path.join(out, name + ".packed"))
        q["absmax"].tofile(os.path.join(out, name + ".absmax"))
        if dq:
            q["nested_absmax"].tofile(os.path.join(out, name + ".nested_absmax"))
        deq.tofile(os.path.join(out, name + ".deq"))
        offset_bits = int(np.array([q.get("offset", F32(0))], dtype=F32).view(np.uint32)[0])
        state = json_state(qt, dtype, bs, shape, q).replace(" ", "\x01")  # one token per field
        lines.append(" ".join([name, qt, dtype, str(bs), str(int(dq)), str(offset_bits), state]
                              + [str(d) for d in shape]))
    DYNAMIC.tofile(os.path.join(out, "dynamic_map"))
    with open(os.path.join(out, "cases.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
