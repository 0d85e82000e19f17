#!/usr/bin/env python3
"""Independent LLM.int8 (bitsandbytes Linear8bitLt) reference, written from bitsandbytes' source
(autograd/_functions.py, nn/modules.py, backends/{default,cuda}/ops.py, _ops.py, csrc/kernels.cu)
op by op. NumPy for the fp32 arithmetic (IEEE, round to nearest even), fractions.Fraction where
one step must be a single rounding (fmaf), torch 1.13 only for bf16 casts and the selftest.

  int8_reference.py OUTDIR     writes the fixtures described below
  int8_reference.py selftest   checks the reference against itself, torch and arithmetic

Notation: f32(.) = the IEEE fp32 result of one operation on fp32 operands; fp16(.), bf16(.) and
D(.) = one round-to-nearest-even cast from fp32 to that dtype; D in {float32, bfloat16, float16}.

1. Weight quantization (Int8Params._quantize: B.to(float16), then int8_vectorwise_quant with
   threshold 0). W [out, in] in dtype D -> W16 = fp16(W); SCB[r] = max_j |W16[r, j]| (exact, as
   fp32). CB[r, j] = rint(f32(W16[r, j] * scale[r])) as int8 (rint: half to even), with
     scale = f32(f32(1/absmax) * 127)      (rcp_scale; the same for both flavours)
   CUDA kernel kInt8VectorQuant: `scale = __fdividef(127.0f, absmax)`. __fdividef compiles to PTX
   div.approx.f32, which the PTX ISA documents as computed as d = a * (1/b) with an approximate
   reciprocal; it is taken here with 1/b correctly rounded: 127 * f32(1/absmax), rounded once.
   Default backend: `127.0 / row_stats` is Tensor.__rtruediv__, which torch defines as
   `self.reciprocal() * other`: the same f32(f32(1/absmax) * 127). So the CUDA and default codes
   agree everywhere, exact ties included. The IEEE quotient f32(127/absmax) (div_scale, what a
   plain `127.0f / absmax` in C++ gives) differs from it in the last bit for some absmax, which
   moves a code only at an exact tie: a*127/absmax = n + 1/2 exactly, i.e. 254*a/absmax an odd
   integer (a = +-absmax/2 always, more values when absmax's significand is a multiple of 127;
   see exact_ties). The weight generators keep such ties (only the LLM.int8 inputs outside the
   `ties` cases are moved off them, avoid_exact_ties); the weight fixtures hold 18 codes, in the
   1536-column cases (SCB 0.062286377, 0.065917969, 0.071777344, 0.061737061), where the IEEE
   quotient gives a code one further from zero, so an implementation dividing fails the byte
   comparison (the selftest counts them). On a GPU: a previous measurement on an H200 found the
   approximate reciprocal (rcp.approx) one fp32 step off for 13 % of absmax values in
   bitsandbytes' 4-bit kernel; where that happens here, the scale moves by a step and a code can
   change only at an exact tie (or where a*127/absmax lies within one step of the scale's
   rounding of n + 1/2, which fp16 values do not reach off exact ties: they keep
   |a*127/absmax - (n + 1/2)| >= 1.9e-6 relative), so the fixtures' codes at exact ties hold on a
   GPU only if rcp.approx is correctly rounded for those absmax. A row of zeros: 1/0 = inf,
   127 * inf = inf, 0 * inf = NaN; CUDA's
   __float2int_rn(NaN) is 0 (torch 1.13's NaN -> int8 on x86 also gives 0; C++ leaves it
   undefined), so the row's codes are 0 and SCB is +0.0 (fmaxf(-0.0, +0.0): sign taken as +).
   The tie row [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 125.5, -126.5, 0...] has scale
   exactly 1 (IEEE 127/127, and 127 * f32(1/127) rounds to 1.0), so its codes are
   [127, 0, 2, 2, 0, -2, -2, 4, -4, 126, -126, 0...]; on a GPU that holds only if
   __fdividef(127, 127) is exactly 1 (127 * rcp.approx(127) rounds to 1).

2. Dequantization (MatMul8bitFp.forward / MatMul8bitLt.backward:
   `CB.to(T, copy=True).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0))`):
   s[r] = f32(SCB[r] * f32(1/127))  (the Python float is cast to the tensor's fp32);
   deq_T[r, j] = T(f32(CB[r, j] * s[r]))  (the in-place mul on a T tensor with an fp32 operand is
   computed in fp32 and cast to T once), for T in float32, bfloat16, float16.

3. CPU training product (bnb.matmul sends is_training on a CPU to MatMul8bitFp):
   y = x @ deq_D^T + bias, grad_x = g @ deq_D, D = x's dtype (Linear8bitLt casts the bias to x's
   dtype). Given exactly in float64 from the D-valued operands (the real result is rounded to D).

4. LLM.int8 product (MatMul8bitLt.forward, threshold t >= 0, A = x [rows, in] in dtype D).
   Flavours: `cuda` (CUDA kernels) and `default` (backends/default/ops.py, what a CPU runs
   outside training).
   a. A16 = fp16(A). If t > 0: outliers = |A16| >= fp16(t) (torch casts the Python scalar to the
      tensor's half); outlier_cols = sorted columns with any outlier (empty file when none).
   b. Row quantization int8_vectorwise_quant(A16, t):
      cuda: absmax over the row's |a| < fp16(t) (all values when t == 0), starting from
            T(-FLT_MIN) with T = half, which is -0.0: a row whose values are all outliers has
            SCA = -0.0 (not -FLT_MIN) and scale = -inf; its codes are 0. SCA = absmax (exact fp32
            of a half); scale = f32(f32(1/absmax) * 127) (__fdividef, see 1.); CA = |a| < f32(t) ?
            rint(f32(a * scale)) : 0 (t == 0: every value). Then, if rows > 1, the columns in
            outlier_cols are set to 0.
      default: outliers set to 0 in A16 first; SCA = max |A16| over the row (as fp32);
            CA = rint(f32(A16 * f32(f32(1 / SCA) * 127))); outlier columns zeroed when rows > 1.
            (An all-outlier row gives SCA 0 and NaN codes: no default case has one.)
      Both flavours use the same scale (1.), so their codes agree, exact ties included. The
      `ties` cases keep 8 exact ties (TIE_INPUTS), where the IEEE quotient 127/absmax would give
      another code (e.g. a = 0.36816406 in a row of absmax 3.2246094: 15 with 127/absmax, 14 with
      127 * f32(1/absmax), the fixtures' code). On a GPU the cuda codes there hold only if
      rcp.approx is correctly rounded for those absmax values (3.2246094, 2.7285156, 3.7207031,
      2.1015625, 2.1855469).
      A row of zeros (cuda): absmax +0.0 (fmaxf(-0.0, +0.0): sign taken as +), scale inf, 0 * inf
      = NaN, codes 0.
   c. I32 = CA @ CB^T, exact (int64, checked to fit int32). cuBLASLt (CUDA, in % 4 == 0) and
      torch._int_mm (CPU, torch >= 2.6 with AVX-512) are exact; the fallbacks, CUDA for
      in % 4 != 0 and the default backend otherwise, compute `torch.matmul(A.float(),
      B.float().t()).to(torch.int32)`, exact only while partial sums stay under 2^24, and,
      under torch.autocast(bfloat16) on CUDA, a bf16 matmul (so no autocast case uses in=33).
   d. Dequantization of I32:
      cuda (kdequant_mm_int32_fp16, MM_DEQUANT_CONST = 6.200012e-05f, the literal rounded once
            to fp32): v = f32(f32(f32(I32) * SCA[i]) * SCB[j]); out16 = fp16(fmaf(v, C, b)) with
            b = fp32(bias[j]) when the bias is float16 (fused), else b = 0; a bias of another dtype
            is then added by `out.add_(bias)` on the fp16 tensor: out16 = fp16(f32(out16 + bias)).
            base = D(out16). Zeros: with no bias b = +0.0 and fmaf(+-0, C, +0.0) = +0.0, so an
            all-outlier row (SCA -0.0, I32 0: v = -0.0) and a zero row give base +0.0, not -0.0.
      default (int8_mm_dequant): out = f32(f32(f32(I32) * f32(SCA[i] * SCB[j])) * C') with
            C' = fp32(6.200124e-05) (sic: not 1/127^2 = 6.2000124e-05; the Python float cast to
            fp32); with a bias out = f32(out + fp32(bias)); base = D(out).
   e. If outlier_cols is non-empty (int8_mixed_scaled_mm): subA = A[:, cols] in D (not fp16);
      subB = D(f32(f32(CB[:, cols] * SCB[r]) * fp32(7.874015718698502e-3)))
      (int8_vectorwise_dequant, `A * stats.view(-1, 1) * 7.874015718698502e-3`);
      y = base + subA @ subB^T (addmm in D), given in float64 from the D values.
      autocast (D = float32 under torch.autocast("cuda", bfloat16)): base stays fp32, the addmm
      is autocast: y = bf16(base) + bf16(subA) @ bf16(subB)^T (float64 of the bf16 values);
      with no outlier columns y = base (fp32).

Cases (seeded by names, deterministic): weights [48, 1536], [40, 64], [7, 33] in each of float32,
bfloat16, float16: N(0, 0.02), four entries of magnitude 0.2-0.6, row 3 all zeros, row 5 the tie
row; the exact ties the random values fall on are kept (18 of them where 127/absmax and
127 * (1/absmax) give different codes, all in the [48, 1536] cases). Inputs N(0, 1) clipped to +-3.9, with planted outliers (6.0, -9.5, 23.0, and for float32
5.999) and non-outliers (5.99, or 5.96875 in bfloat16, and 5.5 in an outlier column); for the
cuda flavour also a row made only of outliers. Input kinds (make_x): clean, outliers,
alloutlier (last row all outliers), alloutlier_zero (6 rows: also row 4 all zeros; the cases
cuda_{f32,bf16}_64_t6_r6_zerorows have no bias, so .base rows 4 and 5 are +0.0 bytes), ties
(make_tie_x: 6 rows of fp16 values, the same for every D, no outliers, with 8 exact ties planted
in rows 0, 1, 2, 4, 5; the cases cuda_f32_64_t6_r6_ties and default_f16_64_t6_r6_ties hold the
same A16 and the same .ca, which the IEEE quotient 127/absmax would change at those 8 entries). LT_CASES and FP_CASES below list the rest.

Fixtures (raw little-endian C-order bytes, no headers; bfloat16 as its 16-bit pattern):
  per weight case W: W.w (D [out, in]), W.cb (int8 [out, in]), W.scb (fp32 [out]),
    W.deq_float32, W.deq_bfloat16, W.deq_float16 ([out, in] in that dtype);
    weights.txt line: `W D out in`
  per LLM.int8 case L: L.x (D [rows, in]), L.bias (bias dtype [out]; absent when none),
    L.ca (int8 [rows, in]), L.sca (fp32 [rows]), L.cols (int64 [ncols], may be empty),
    L.i32 (int32 [rows, out]), L.base (D [rows, out]), L.y (float64 [rows, out]);
    lt.txt line: `L W flavour D threshold rows bias_dtype_or_none autocast(0|1)`
    (D is x's dtype, which may differ from the weight case's).
  per training-product case P: P.x (D [rows, in]), P.g (D [rows, out]), P.bias (D [out];
    absent when none), P.y (float64 [rows, out]), P.gx (float64 [rows, in]);
    fp.txt line: `P W D rows bias(0|1)`
"""
import os
import sys
import zlib
from fractions import Fraction

import numpy as np
import torch

F32 = np.float32
F64 = np.float64
DTYPES = ("float32", "bfloat16", "float16")
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int32": 4, "int64": 8, "float64": 8}


def f32_literal(text):
    """Correctly rounded fp32 of a decimal string (how nvcc reads a float literal)."""
    return round_f32(Fraction(text))


def round_f32(q):
    """One round-to-nearest-even of an exact rational to fp32 (q != 0)."""
    guess = F32(float(q))
    cands = [np.nextafter(guess, F32(-np.inf)), guess, np.nextafter(guess, F32(np.inf))]

    def key(c):
        return (abs(Fraction(float(c)) - q), int(np.array([c], F32).view(np.uint32)[0]) & 1)
    return min(cands, key=key)


MM_DEQUANT_CONST = f32_literal("6.200012e-05")       # csrc/kernels.cu, a float literal
DEFAULT_DEQUANT_CONST = F32(6.200124e-05)            # backends/default/ops.py, Python float -> fp32
INV127 = F32(1.0 / 127.0)                            # `.mul(1.0 / 127.0)` on an fp32 tensor
VECTORWISE_DEQUANT_CONST = F32(7.874015718698502e-3)  # _ops.py int8_vectorwise_dequant


# ---------------------------------------------------------------- dtype helpers (values in fp32)

def to_dtype(a, name):
    """Round fp32 values to `name`; returned as an fp32 array holding the rounded values."""
    a = np.asarray(a, dtype=F32)
    if name == "float32":
        return a.copy()
    if name == "float16":
        return a.astype(np.float16).astype(F32)
    return torch.from_numpy(a.copy()).to(torch.bfloat16).to(torch.float32).numpy()


def fp16(a):
    return to_dtype(a, "float16")


def raw_bytes(a, name):
    a = np.ascontiguousarray(a)
    if name == "float32":
        return a.astype("<f4").tobytes()
    if name == "float16":
        return a.astype(F32).astype("<f2").tobytes()
    if name == "bfloat16":
        b = to_dtype(a, "bfloat16")
        return (b.view(np.uint32) >> 16).astype("<u2").tobytes()
    return a.astype({"int8": "i1", "int32": "<i4", "int64": "<i8", "float64": "<f8"}[name]).tobytes()


def bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=F32)).view(np.uint32)


def same_bits(a, b):
    return np.array_equal(bits(a), bits(b))


def fmaf(a, b, c):
    """fmaf over fp32 arrays: a*b+c exact, one rounding to fp32 (IEEE sign rules for zeros)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, F32), np.asarray(b, F32), np.asarray(c, F32))
    out = np.empty(a.shape, dtype=F32)
    for idx in np.ndindex(a.shape):
        x, y, z = float(a[idx]), float(b[idx]), float(c[idx])
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        if exact == 0:
            prod_neg = np.signbit(x) != np.signbit(y)
            if x * y == 0 and z == 0:
                out[idx] = F32(-0.0) if (prod_neg and np.signbit(z)) else F32(0.0)
            else:
                out[idx] = F32(0.0)
        else:
            out[idx] = round_f32(exact)
    return out


# ---------------------------------------------------------------- quantization

def rint_codes(vals, scale, mask):
    """rint(f32(vals * scale)) where mask, else 0; NaN (0 * inf) -> 0 (__float2int_rn)."""
    with np.errstate(invalid="ignore", over="ignore"):
        prod = (vals.astype(F32) * scale.astype(F32)[:, None]).astype(F32)
        r = np.rint(prod)
    r = np.where(mask & np.isfinite(r), r, F32(0))
    assert np.all(np.abs(r) <= 127), "code out of int8 range"
    return r.astype(np.int8)


def rcp_scale(absmax):
    """f32(f32(1/absmax) * 127): CUDA's __fdividef(127.0f, absmax) (div.approx.f32 = a * (1/b),
    the reciprocal taken correctly rounded) and the default backend's `127.0 / row_stats`
    (torch: reciprocal() * 127). Used by both flavours."""
    with np.errstate(divide="ignore", over="ignore"):
        return ((F32(1.0) / absmax.astype(F32)).astype(F32) * F32(127.0)).astype(F32)


def div_scale(absmax):
    """The IEEE quotient f32(127/absmax): what neither bitsandbytes path computes (selftest only)."""
    with np.errstate(divide="ignore"):
        return (F32(127.0) / absmax.astype(F32)).astype(F32)


def quantize_weight(w, scale_fn=rcp_scale):
    """w: fp32 array holding dtype-D values. Returns CB (int8), SCB (fp32) and W16."""
    w16 = fp16(w)
    scb = np.max(np.abs(w16), axis=1).astype(F32) + F32(0.0)  # +0.0 for a zero row
    cb = rint_codes(w16, scale_fn(scb), np.ones(w16.shape, dtype=bool))
    return cb, scb, w16


def dequantize(cb, scb, tname):
    s = (scb.astype(F32) * INV127).astype(F32)
    return to_dtype((cb.astype(F32) * s[:, None]).astype(F32), tname)


def outlier_mask(a16, t):
    if t <= 0:
        return np.zeros(a16.shape, dtype=bool)
    return np.abs(a16) >= fp16(np.array([t], F32))[0]


def quantize_rows(a16, t, flavour, scale_fn=rcp_scale):
    """int8_vectorwise_quant(A16, threshold=t). Returns CA, SCA, outlier_cols. (scale_fn:
    rcp_scale for bitsandbytes, div_scale only for the selftest's comparison.)"""
    rows = a16.shape[0]
    absv = np.abs(a16).astype(F32)
    out_m = outlier_mask(a16, t)
    cols = np.nonzero(out_m.any(axis=0))[0].astype(np.int64)
    if flavour == "cuda":
        if t > 0:
            keep_max = absv < fp16(np.array([t], F32))[0]   # absval < T(threshold), in half
            keep_q = absv < F32(t)                           # fabs(val) < threshold, in float
        else:
            keep_max = keep_q = np.ones(a16.shape, dtype=bool)
        sca = np.empty(rows, dtype=F32)
        for i in range(rows):
            v = absv[i][keep_max[i]]
            if v.size == 0:
                sca[i] = F32(-0.0)       # half(-FLT_MIN) == -0.0, never raised
            else:
                sca[i] = F32(v.max()) + F32(0.0)
        ca = rint_codes(a16, scale_fn(sca), keep_q)
    else:
        az = np.where(out_m, F32(0), a16).astype(F32)
        sca = np.max(np.abs(az), axis=1).astype(F32) + F32(0.0)
        if np.any(sca == 0):
            raise ValueError("default flavour: a row with no non-outlier value gives NaN codes")
        ca = rint_codes(az, scale_fn(sca), np.ones(a16.shape, dtype=bool))
    if rows > 1 and cols.size:
        ca[:, cols] = 0
    return ca, sca, cols


def int8_matmul(ca, cb):
    i = ca.astype(np.int64) @ cb.astype(np.int64).T
    assert i.min() >= -2**31 and i.max() < 2**31, "int32 overflow"
    return i.astype(np.int32)


def mm_dequant(i32, sca, scb, D, bias, bias_dtype, flavour):
    """int8_mm_dequant (+ bias) to dtype D; returns base as fp32 values of D."""
    if flavour == "cuda":
        v = ((i32.astype(F32) * sca[:, None]).astype(F32) * scb[None, :]).astype(F32)
        if bias is not None and bias_dtype == "float16":
            out32 = fmaf(v, MM_DEQUANT_CONST, np.broadcast_to(bias.astype(F32), v.shape))
        else:
            out32 = fmaf(v, MM_DEQUANT_CONST, F32(0.0))
        out16 = fp16(out32)
        if bias is not None and bias_dtype != "float16":
            out16 = fp16((out16 + bias.astype(F32)[None, :]).astype(F32))
        return to_dtype(out16, D)
    rc = (sca[:, None] * scb[None, :]).astype(F32)
    out = (i32.astype(F32) * rc).astype(F32)
    out = (out * DEFAULT_DEQUANT_CONST).astype(F32)
    if bias is not None:
        out = (out + bias.astype(F32)[None, :]).astype(F32)
    return to_dtype(out, D)


def vectorwise_dequant(cb_cols, scb):
    return ((cb_cols.astype(F32) * scb[:, None]).astype(F32) * VECTORWISE_DEQUANT_CONST).astype(F32)


def llm_int8(x, D, cb, scb, t, bias, bias_dtype, flavour, autocast):
    """MatMul8bitLt.forward. x: fp32 array of D values. Returns a dict of every stage."""
    a16 = fp16(x)
    ca, sca, cols = quantize_rows(a16, t, flavour)
    i32 = int8_matmul(ca, cb)
    base = mm_dequant(i32, sca, scb, D, bias, bias_dtype, flavour)
    if t > 0 and cols.size:
        sub_a = x[:, cols]
        sub_b = to_dtype(vectorwise_dequant(cb[:, cols], scb), D)
        if autocast:
            bf = lambda a: to_dtype(a, "bfloat16").astype(F64)
            y = bf(base) + bf(sub_a) @ bf(sub_b).T
        else:
            y = base.astype(F64) + sub_a.astype(F64) @ sub_b.astype(F64).T
    else:
        sub_b = None
        y = base.astype(F64)
    return {"a16": a16, "ca": ca, "sca": sca, "cols": cols, "i32": i32, "base": base, "y": y,
            "sub_b": sub_b}


def fp_product(x, g, D, cb, scb, bias):
    deq = dequantize(cb, scb, D).astype(F64)
    y = x.astype(F64) @ deq.T
    if bias is not None:
        y = y + bias.astype(F64)[None, :]
    return y, g.astype(F64) @ deq


# ---------------------------------------------------------------- cases

TIE_ROW = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5, 125.5, -126.5]
TIE_CODES = [127, 0, 2, 2, 0, -2, -2, 4, -4, 126, -126]
ZERO_ROW, TIE_ROW_INDEX = 3, 5
WEIGHT_SHAPES = [(48, 1536), (40, 64), (7, 33)]


def rng_for(key):
    return np.random.default_rng(zlib.crc32(key.encode()))


def exact_ties(v, thresholds):
    """Entries of v (fp32 values; their fp16 is quantized) on an exact tie: 254*|a|/absmax an odd
    integer, with absmax over all values (threshold 0) or over those under a threshold t > 0."""
    a = np.abs(fp16(v)).astype(F64)
    hit = np.zeros(v.shape, dtype=bool)
    for t in thresholds:
        m = (np.where(a < t, a, 0.0) if t > 0 else a).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(m > 0, 254.0 * a / np.where(m > 0, m, 1.0), 0.5)
        odd = (q == np.rint(q)) & (np.fmod(np.rint(q), 2) == 1)
        hit |= odd & (a < (t if t > 0 else np.inf))
    return hit


def avoid_exact_ties(v, D, thresholds, keep=None):
    """Exact ties: with fp16 values a and absmax, a*127/absmax is exactly n + 1/2 when
    254*a/absmax is an odd integer: at a = +-absmax/2 always, and at more values when absmax's
    significand is a multiple of 127 (e.g. 3.2246094 = 13*127/2^9). There the code depends on
    the last bit of the scale: the IEEE quotient 127/absmax and 127 * (1/absmax) (both
    flavours) can round differently (e.g. 15 against 14), and so can a GPU whose rcp.approx is a
    step off. Away from exact ties fp16 inputs keep |a*127/absmax - (n + 1/2)| >= 1.9e-6
    relative, so a scale a few ulps off gives the same codes. Used for the LLM.int8 inputs only
    (the weights keep their ties): entries on an exact tie (absmax over all values and over those
    under each threshold) are scaled by 0.97, except the entries in `keep` (the ties planted on
    purpose by make_tie_x)."""
    v = v.copy()
    for _ in range(20):
        hit = exact_ties(v, thresholds)
        if keep is not None:
            hit &= ~keep
        if not hit.any():
            return v
        v[hit] = to_dtype(v[hit] * F32(0.97), D)
    raise RuntimeError("could not move entries off exact ties")


def make_weight(out_f, in_f, D):
    rng = rng_for(f"w-{out_f}x{in_f}-{D}")
    w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(F32)
    for _ in range(4):  # a few larger entries
        r = int(rng.integers(out_f))
        while r in (ZERO_ROW, TIE_ROW_INDEX):
            r = int(rng.integers(out_f))
        w[r, int(rng.integers(in_f))] = F32(rng.choice([-1, 1]) * rng.uniform(0.2, 0.6))
    w[ZERO_ROW] = 0
    w[TIE_ROW_INDEX] = 0
    w[TIE_ROW_INDEX, :len(TIE_ROW)] = TIE_ROW
    return to_dtype(w, D)   # exact ties kept (see 1. in the docstring)


def below_six(D):
    """A value under 6 whose fp16 is under 6 (bf16 rounds 5.99 to 6.0: take 5.96875)."""
    return 5.96875 if D == "bfloat16" else 5.99


# Exact input ties kept on purpose (make_tie_x): per row, the absmax m (a value of the row; its
# sign is the planted value's) and values a with 254*|a|/|m| odd, where the IEEE quotient
# f32(127/|m|) and the scale of both flavours f32(f32(1/|m|) * 127) give codes one apart
# (IEEE 127/|m|, the fixtures' code):
#   3.2246094 = 1651/512 = 13*127/2^9: 0.36816406 (15, 14), -1.3330078 (-53, -52)
#   2.7285156 = 1397/512 = 11*127/2^9: 0.50488281 (24, 23), -1.9658203 (-92, -91)
#   3.7207031 = 1905/512 = 15*127/2^9: -0.42480469 (-15, -14), 1.5966797 (55, 54)
#   2.1015625: 1.0507812 = m/2 (64, 63);  2.1855469: -1.0927734 = -m/2 (-63, -64)
TIE_INPUTS = {0: (3.224609375, (0.3681640625, -1.3330078125)),
              1: (-2.728515625, (0.5048828125, -1.9658203125)),
              2: (3.720703125, (-0.4248046875, 1.5966796875)),
              4: (2.1015625, (-1.05078125,)),
              5: (-2.185546875, (-1.0927734375,))}
ZERO_X_ROW = 4   # alloutlier_zero inputs (rows 6): row 4 all zeros, row 5 all outliers


def make_tie_x(rows, in_f, D):
    """Inputs with planted exact ties (TIE_INPUTS, rows >= 6), no outliers. The values are fp16
    and do not depend on D, so a float16 and a float32 case hold the same A16. Every other entry
    is moved off exact ties; row 3 has none."""
    rng = rng_for(f"x-ties-{rows}x{in_f}")
    x = fp16(np.clip(rng.standard_normal((rows, in_f)), -3.9, 3.9).astype(F32))
    planted = np.zeros(x.shape, dtype=bool)
    for r, (m, vals) in TIE_INPUTS.items():
        lim = abs(m) * 0.9
        x[r] = fp16(np.clip(x[r], -lim, lim))
        c = rng.choice(in_f, 1 + len(vals), replace=False)
        x[r, c[0]] = m
        x[r, c[1:]] = vals
        planted[r, c[1:]] = True
    x = avoid_exact_ties(x, "float16", (0.0, 6.0), keep=planted)
    assert np.array_equal(exact_ties(x, (0.0, 6.0)), planted), "planted ties moved"
    return to_dtype(x, D)


def make_x(rows, in_f, D, kind):
    """kind: clean (|x| < 4), outliers (planted columns), alloutlier (outliers + one row of
    |x| in [6, 12]), alloutlier_zero (alloutlier, rows >= 6, and row ZERO_X_ROW all zeros),
    ties (make_tie_x). Outlier plants: 6.0 exactly (an outlier: the test is >=), 5.99 (not one),
    -9.5 and 23.0, 5.5 in an outlier column of another row (not an outlier, but in that row's
    absmax), and for float32 5.999 (under 6, but fp16 rounds it to 6.0: an outlier)."""
    if kind == "ties":
        return make_tie_x(rows, in_f, D)
    rng = rng_for(f"x-{rows}x{in_f}-{D}-{kind}")
    x = np.clip(rng.standard_normal((rows, in_f)), -3.9, 3.9).astype(F32)
    if kind != "clean":
        c = rng.choice(in_f, 5, replace=False)
        last = rows - 1
        x[0, c[0]] = 6.0
        x[min(1, last), c[1]] = below_six(D)
        x[min(2, last), c[2]] = -9.5
        x[rows // 2, c[3]] = 23.0
        if rows > 1:
            x[last, c[0]] = 5.5
        if D == "float32":
            x[min(3, last), c[4]] = 5.999
    if kind.startswith("alloutlier"):
        r = rows - 1
        x[r] = (rng.choice([-1.0, 1.0], in_f) * rng.uniform(6.0, 12.0, in_f)).astype(F32)
    if kind == "alloutlier_zero":
        assert rows > ZERO_X_ROW + 1
        x[ZERO_X_ROW] = 0
    return avoid_exact_ties(to_dtype(x, D), D, (0.0, 6.0))


def make_bias(out_f, bdt, key):
    if bdt == "none":
        return None
    rng = rng_for(f"b-{out_f}-{bdt}-{key}")
    return to_dtype((rng.standard_normal(out_f) * 0.5).astype(F32), bdt)


# name, weight, flavour, D, threshold, rows, bias dtype, x kind, autocast
LT_CASES = [
    ("cuda_f16_1536_t6_r16_f16fused", "w48x1536_float16", "cuda", "float16", 6.0, 16, "float16", "outliers", 0),
    ("cuda_bf16_64_t6_r5_alloutlier", "w40x64_bfloat16", "cuda", "bfloat16", 6.0, 5, "bfloat16", "alloutlier", 0),
    ("cuda_f32_64_t6_r5_bias", "w40x64_float32", "cuda", "float32", 6.0, 5, "float32", "outliers", 0),
    ("cuda_f16_33_t6_r1", "w7x33_float16", "cuda", "float16", 6.0, 1, "none", "outliers", 0),
    ("cuda_f16_64_t0_r5_outliers", "w40x64_float16", "cuda", "float16", 0.0, 5, "none", "outliers", 0),
    ("cuda_f32_64_t6_r5_autocast", "w40x64_float32", "cuda", "float32", 6.0, 5, "float32", "outliers", 1),
    ("cuda_f32_1536_t6_r16_autocast", "w48x1536_float32", "cuda", "float32", 6.0, 16, "none", "outliers", 1),
    ("cuda_f32x_bf16w_64_t6_r5_f16bias", "w40x64_bfloat16", "cuda", "float32", 6.0, 5, "float16", "outliers", 0),
    ("cuda_bf16_33_t6_r1_alloutlier", "w7x33_bfloat16", "cuda", "bfloat16", 6.0, 1, "bfloat16", "alloutlier", 0),
    ("cuda_f16_64_t6_r5_clean", "w40x64_float16", "cuda", "float16", 6.0, 5, "float16", "clean", 0),
    ("cuda_f16_64_t0_r5_clean", "w40x64_float16", "cuda", "float16", 0.0, 5, "float16", "clean", 0),
    ("cuda_f32_64_t6_r5_clean_autocast", "w40x64_float32", "cuda", "float32", 6.0, 5, "none", "clean", 1),
    ("cuda_bf16_1536_t0_r16_clean", "w48x1536_bfloat16", "cuda", "bfloat16", 0.0, 16, "bfloat16", "clean", 0),
    ("cuda_f32_64_t6_r6_ties", "w40x64_float32", "cuda", "float32", 6.0, 6, "none", "ties", 0),
    ("cuda_f32_64_t6_r6_zerorows", "w40x64_float32", "cuda", "float32", 6.0, 6, "none", "alloutlier_zero", 0),
    ("cuda_bf16_64_t6_r6_zerorows", "w40x64_bfloat16", "cuda", "bfloat16", 6.0, 6, "none", "alloutlier_zero", 0),
    ("default_f32_1536_t6_r16_bias", "w48x1536_float32", "default", "float32", 6.0, 16, "float32", "outliers", 0),
    ("default_f16_1536_t6_r16_bias", "w48x1536_float16", "default", "float16", 6.0, 16, "float16", "outliers", 0),
    ("default_bf16_64_t6_r5_bias", "w40x64_bfloat16", "default", "bfloat16", 6.0, 5, "bfloat16", "outliers", 0),
    ("default_f16_64_t6_r5", "w40x64_float16", "default", "float16", 6.0, 5, "none", "outliers", 0),
    ("default_f32_33_t6_r1", "w7x33_float32", "default", "float32", 6.0, 1, "none", "outliers", 0),
    ("default_f16_64_t0_r16_outliers", "w40x64_float16", "default", "float16", 0.0, 16, "float16", "outliers", 0),
    ("default_f16_64_t6_r5_clean", "w40x64_float16", "default", "float16", 6.0, 5, "float16", "clean", 0),
    ("default_bf16_33_t0_r5_clean", "w7x33_bfloat16", "default", "bfloat16", 0.0, 5, "none", "clean", 0),
    ("default_f16_64_t6_r6_ties", "w40x64_float16", "default", "float16", 6.0, 6, "float16", "ties", 0),
]

# name, weight, D, rows, bias
FP_CASES = [(f"fp_{D}_{shape}_{'bias' if b else 'nobias'}", f"w{shape}_{D}", D, 5, b)
            for D in DTYPES for shape, b in (("40x64", 1), ("40x64", 0), ("7x33", 1))]
FP_CASES += [("fp_float32_1536_bias", "w48x1536_float32", "float32", 5, 1),
             ("fp_bfloat16_1536_nobias", "w48x1536_bfloat16", "bfloat16", 5, 0)]


def build_weights():
    ws = {}
    for (o, i) in WEIGHT_SHAPES:
        for D in DTYPES:
            name = f"w{o}x{i}_{D}"
            w = make_weight(o, i, D)
            cb, scb, w16 = quantize_weight(w)
            ws[name] = {"D": D, "w": w, "w16": w16, "cb": cb, "scb": scb,
                        "deq": {T: dequantize(cb, scb, T) for T in DTYPES}}
    return ws


def build_lt(ws, case):
    name, wname, flavour, D, t, rows, bdt, kind, ac = case
    W = ws[wname]
    out_f, in_f = W["cb"].shape
    x = make_x(rows, in_f, D, kind)
    bias = make_bias(out_f, bdt, f"{rows}-{D}-{kind}")  # shared by the cuda / default pairs
    r = llm_int8(x, D, W["cb"], W["scb"], t, bias, bdt, flavour, ac)
    r.update(x=x, bias=bias)
    return r


def build_fp(ws, case):
    name, wname, D, rows, b = case
    W = ws[wname]
    out_f, in_f = W["cb"].shape
    rng = rng_for("fp-" + name)
    x = to_dtype(rng.standard_normal((rows, in_f)).astype(F32), D)
    g = to_dtype(rng.standard_normal((rows, out_f)).astype(F32), D)
    bias = to_dtype((rng.standard_normal(out_f) * 0.5).astype(F32), D) if b else None
    y, gx = fp_product(x, g, D, W["cb"], W["scb"], bias)
    return {"x": x, "g": g, "bias": bias, "y": y, "gx": gx}


# ---------------------------------------------------------------- fixtures

def write(path, a, dtype):
    with open(path, "wb") as f:
        f.write(raw_bytes(a, dtype))


def write_fixtures(out):
    os.makedirs(out, exist_ok=True)
    ws = build_weights()
    lines = []
    for name, W in ws.items():
        p = os.path.join(out, name)
        write(p + ".w", W["w"], W["D"])
        write(p + ".cb", W["cb"], "int8")
        write(p + ".scb", W["scb"], "float32")
        for T in DTYPES:
            write(p + ".deq_" + T, W["deq"][T], T)
        lines.append(f"{name} {W['D']} {W['cb'].shape[0]} {W['cb'].shape[1]}")
    with open(os.path.join(out, "weights.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    lines = []
    for case in LT_CASES:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        r = build_lt(ws, case)
        p = os.path.join(out, name)
        write(p + ".x", r["x"], D)
        if r["bias"] is not None:
            write(p + ".bias", r["bias"], bdt)
        elif os.path.exists(p + ".bias"):
            os.remove(p + ".bias")
        write(p + ".ca", r["ca"], "int8")
        write(p + ".sca", r["sca"], "float32")
        write(p + ".cols", r["cols"], "int64")
        write(p + ".i32", r["i32"], "int32")
        write(p + ".base", r["base"], D)
        write(p + ".y", r["y"], "float64")
        lines.append(f"{name} {wname} {flavour} {D} {t!r} {rows} {bdt} {ac}")
    with open(os.path.join(out, "lt.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    lines = []
    for case in FP_CASES:
        name, wname, D, rows, b = case
        r = build_fp(ws, case)
        p = os.path.join(out, name)
        write(p + ".x", r["x"], D)
        write(p + ".g", r["g"], D)
        if b:
            write(p + ".bias", r["bias"], D)
        elif os.path.exists(p + ".bias"):
            os.remove(p + ".bias")
        write(p + ".y", r["y"], "float64")
        write(p + ".gx", r["gx"], "float64")
        lines.append(f"{name} {wname} {D} {rows} {b}")
    with open(os.path.join(out, "fp.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    n = check_sizes(out)
    print(f"wrote {len(ws)} weight, {len(LT_CASES)} LLM.int8 and {len(FP_CASES)} training-product "
          f"cases ({n} files) to {out}")


def check_sizes(out):
    """Re-reads the three index files and checks every fixture file's size."""
    expect = {}
    shapes = {}
    for line in open(os.path.join(out, "weights.txt")):
        w, D, o, i = line.split()
        o, i = int(o), int(i)
        shapes[w] = (o, i)
        expect[w + ".w"] = o * i * SIZE[D]
        expect[w + ".cb"] = o * i
        expect[w + ".scb"] = o * 4
        for T in DTYPES:
            expect[f"{w}.deq_{T}"] = o * i * SIZE[T]
    for line in open(os.path.join(out, "lt.txt")):
        L, w, flavour, D, t, rows, bdt, ac = line.split()
        o, i = shapes[w]
        rows = int(rows)
        expect[L + ".x"] = rows * i * SIZE[D]
        if bdt != "none":
            expect[L + ".bias"] = o * SIZE[bdt]
        expect[L + ".ca"] = rows * i
        expect[L + ".sca"] = rows * 4
        expect[L + ".i32"] = rows * o * 4
        expect[L + ".base"] = rows * o * SIZE[D]
        expect[L + ".y"] = rows * o * 8
        cols = os.path.getsize(os.path.join(out, L + ".cols"))
        assert cols % 8 == 0 and (cols == 0 or float(t) > 0), L
    for line in open(os.path.join(out, "fp.txt")):
        P, w, D, rows, b = line.split()
        o, i = shapes[w]
        rows = int(rows)
        expect[P + ".x"] = rows * i * SIZE[D]
        expect[P + ".g"] = rows * o * SIZE[D]
        if b == "1":
            expect[P + ".bias"] = o * SIZE[D]
        expect[P + ".y"] = rows * o * 8
        expect[P + ".gx"] = rows * i * 8
    for f, n in expect.items():
        got = os.path.getsize(os.path.join(out, f))
        if got != n:
            raise RuntimeError(f"{f}: {got} bytes, expected {n}")
    return len(expect)


# ---------------------------------------------------------------- selftest

class Checker:
    def __init__(self):
        self.failed = 0

    def __call__(self, ok, name, detail=""):
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failed += 1


def torch_default_quant(a16, threshold):
    """bitsandbytes' default int8_vectorwise_quant, transcribed (torch 1.13 CPU)."""
    A = torch.from_numpy(a16.copy()).to(torch.float16)
    rows = A.numel() // A.shape[-1]
    outlier_cols = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold
        if outliers.any():
            outlier_cols = torch.argwhere(outliers.any(dim=0)).view(-1)
            A[outliers] = 0
        else:
            outlier_cols = torch.empty(0, dtype=torch.int64)
    row_stats = torch.max(A.abs(), dim=1).values.float()
    out_row = torch.round(A * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
    if rows > 1 and outlier_cols is not None:
        out_row[:, outlier_cols] = 0
    return out_row.numpy(), row_stats.numpy(), outlier_cols


def torch_default_mm_dequant(i32, sca, scb, D, bias, bdt):
    A = torch.from_numpy(i32)
    out = A * (torch.from_numpy(sca).unsqueeze(-1) * torch.from_numpy(scb).unsqueeze(0)) * 6.200124e-05
    if bias is not None:
        out += torch.from_numpy(bias).to(TORCH_DT[bdt])
    return out.to(TORCH_DT[D]).float().numpy()


def torch_vectorwise_dequant(cb_cols, scb, D):
    A = torch.from_numpy(cb_cols.copy())
    return (A * torch.from_numpy(scb).view(-1, 1) * 7.874015718698502e-3).to(TORCH_DT[D]).float().numpy()


def torch_deq(cb, scb, T):
    CB = torch.from_numpy(cb)
    SCB = torch.from_numpy(scb)
    return CB.to(TORCH_DT[T], copy=True).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0)).float().numpy()


def selftest():
    ok = Checker()
    ok(same_bits([MM_DEQUANT_CONST], [F32(6.200012e-05)]) and float(MM_DEQUANT_CONST) != float(DEFAULT_DEQUANT_CONST),
       "constants", f"CUDA {float(MM_DEQUANT_CONST)!r}, default {float(DEFAULT_DEQUANT_CONST)!r}, "
       f"1/127^2 = {1 / 127 ** 2!r}")
    ws = build_weights()
    # both flavours quantize the weights with 127 * f32(1/absmax); the IEEE quotient 127/absmax
    # moves codes at some of the exact ties the weights keep, so a division fails on .cb
    wdiv, wdiv_ok, nw_div, nw_ties = [], True, 0, 0
    for name, W in ws.items():
        cb_div = quantize_weight(W["w"], div_scale)[0]
        diff = cb_div != W["cb"]
        ties = exact_ties(W["w16"], (0.0,))
        ties[TIE_ROW_INDEX] = False   # the tie row: scale exactly 1 either way
        wdiv_ok &= (not (diff & ~ties).any()
                    and bool(np.all(np.abs(cb_div.astype(np.int64) - W["cb"]) <= 1)))
        nw_div += int(diff.sum())
        nw_ties += int(ties.sum())
        if diff.any():
            wdiv.append(f"{name} {int(diff.sum())}/{int(ties.sum())}")
    ok(wdiv_ok and nw_div > 0,
       "weights: IEEE 127/absmax instead of 127 * f32(1/absmax) changes codes, only at exact ties",
       f"{nw_div} codes change, at {nw_ties} exact ties kept outside the tie rows; "
       f"changed/ties per fixture: {', '.join(wdiv)}")

    # torch literal transcriptions vs the NumPy emulation
    bad = []
    for name, W in ws.items():
        cb_t, scb_t, _ = torch_default_quant(W["w16"], 0.0)
        if not (np.array_equal(cb_t, W["cb"]) and same_bits(scb_t, W["scb"])):
            bad.append(name + " quant")
        for T in DTYPES:
            if not same_bits(torch_deq(W["cb"], W["scb"], T), W["deq"][T]):
                bad.append(f"{name} deq_{T}")
    ok(not bad, "weight quantization and dequantization equal torch running bitsandbytes' expressions",
       ", ".join(bad) or "bitwise")

    # dequantized values within half a code step of the fp16 weight
    worst = {}
    for name, W in ws.items():
        step = W["scb"].astype(F64)[:, None] / 254
        for T in DTYPES:
            d = W["deq"][T].astype(F64)
            # the fp32 scale and product add ~2^-23 relative; the cast to T adds half an ulp of T
            half_ulp = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[T]
            bound = step * (1 + 2.0 ** -20) + np.abs(d) * half_ulp + 2.0 ** -40
            err = np.abs(d - W["w16"].astype(F64))
            worst[T] = max(worst.get(T, 0.0), float(np.max(err / bound)))
    ok(all(v <= 1.0 for v in worst.values()),
       "dequantized weight within SCB/254 of fp16(W), plus half an ulp of T",
       "worst err/bound " + ", ".join(f"{T} {v:.4f}" for T, v in worst.items()))

    # codes do not depend on the last bits of the scale (a GPU's rcp.approx may be a step off),
    # except at exact ties (kept in the weights and planted in the ties inputs); an exact tie
    # shows the hazard
    def nudged(scale, k):
        for _ in range(abs(k)):
            scale = np.nextafter(scale, F32(np.inf) if k > 0 else F32(-np.inf)).astype(F32)
        return scale
    stable = []
    for name, W in ws.items():
        off_tie = ~exact_ties(W["w16"], (0.0,))
        for k in (-3, 3):
            c = rint_codes(W["w16"], nudged(rcp_scale(W["scb"]), k), np.ones(W["w16"].shape, bool))
            stable.append(np.array_equal(c[off_tie], W["cb"][off_tie]))
    for case in LT_CASES:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        x = make_x(rows, ws[wname]["cb"].shape[1], D, kind)
        a16 = fp16(x)
        ca, sca, cols = quantize_rows(a16, t, "cuda")
        keep_q = np.abs(a16) < F32(t) if t > 0 else np.ones(a16.shape, bool)
        off_tie = ~exact_ties(a16, (t,))   # the ties cases' planted ties only
        for k in (-3, 3):
            c = rint_codes(a16, nudged(rcp_scale(sca), k), keep_q)
            if rows > 1 and cols.size:
                c[:, cols] = 0
            stable.append(np.array_equal(c[off_tie], ca[off_tie]))
    m = fp16(np.array([3.2246094], F32))   # significand 1651 = 13 * 127
    a = fp16(np.array([[0.36816406, float(m[0])]], F32))
    tie = (rint_codes(a, div_scale(m), np.ones(a.shape, bool))[0, 0],
           rint_codes(a, rcp_scale(m), np.ones(a.shape, bool))[0, 0])
    ok(all(stable) and tie[0] != tie[1],
       "codes unchanged with the scale 3 ulps off (weights and LLM.int8 inputs off exact ties), "
       "but not at an exact tie",
       f"a = 0.36816406, absmax = 3.2246094: a*127/absmax = 14.5 exactly, code {tie[0]} with 127/absmax, "
       f"{tie[1]} with 127*(1/absmax)")

    # tie row and zero row
    tie_ok = all(list(W["cb"][TIE_ROW_INDEX, :len(TIE_CODES)]) == TIE_CODES
                 and not W["cb"][TIE_ROW_INDEX, len(TIE_CODES):].any() for W in ws.values())
    ok(tie_ok, "tie row rounds half to even", str(list(ws["w7x33_bfloat16"]["cb"][TIE_ROW_INDEX, :len(TIE_CODES)])))
    zero_ok = all(not W["cb"][ZERO_ROW].any() and bits(W["scb"])[ZERO_ROW] == 0
                  and all(not bits(W["deq"][T][ZERO_ROW]).any() for T in DTYPES) for W in ws.values())
    ok(zero_ok, "zero weight row: codes 0, SCB +0.0, dequantized +0.0")

    # LLM.int8 cases
    results = {}
    for case in LT_CASES:
        results[case[0]] = build_lt(ws, case)
    bad_i32, bad_default, bad_fp32mm = [], [], []
    for case in LT_CASES:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        r = results[name]
        W = ws[wname]
        ref = torch.from_numpy(r["ca"].astype(np.int64)) @ torch.from_numpy(W["cb"].astype(np.int64)).T
        if not np.array_equal(ref.numpy(), r["i32"].astype(np.int64)):
            bad_i32.append(name)
        if np.max(np.abs(r["ca"]).astype(np.int64) @ np.abs(W["cb"]).astype(np.int64).T) >= 2 ** 24:
            bad_fp32mm.append(name)
        if flavour == "default":
            ca_t, sca_t, cols_t = torch_default_quant(r["a16"], t)
            cols_t = np.zeros(0, np.int64) if cols_t is None else cols_t.numpy()
            base_t = torch_default_mm_dequant(r["i32"], r["sca"], W["scb"], D, r["bias"], bdt)
            same = (np.array_equal(ca_t, r["ca"]) and same_bits(sca_t, r["sca"])
                    and np.array_equal(cols_t, r["cols"]) and same_bits(base_t, r["base"]))
            if r["sub_b"] is not None:
                same = same and same_bits(torch_vectorwise_dequant(W["cb"][:, r["cols"]], W["scb"], D), r["sub_b"])
            if not same:
                bad_default.append(name)
    ok(not bad_i32, "int32 products equal torch's int64 matmul and fit int32", ", ".join(bad_i32))
    ok(not bad_fp32mm, "every |CA| @ |CB|^T < 2^24, so the fp32 matmul fallbacks are exact here",
       ", ".join(bad_fp32mm))
    ok(not bad_default, "default flavour equals torch running bitsandbytes' default ops bitwise",
       ", ".join(bad_default) or f"{sum(c[2] == 'default' for c in LT_CASES)} cases")

    # planted exact ties (TIE_INPUTS): (a) the cuda and default flavours give the same codes there;
    # (b) the IEEE quotient 127/absmax changes them there and only there
    tn = [c for c in LT_CASES if c[7] == "ties"]
    same_ok = len(tn) == 2 and {c[2] for c in tn} == {"cuda", "default"}
    div_ok = same_ok
    divd, torch_ok = [], True
    for case in tn:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        r = results[name]
        planted = exact_ties(r["a16"], (0.0, t))
        other = llm_int8(r["x"], D, ws[wname]["cb"], ws[wname]["scb"], t, None, "none",
                         "default" if flavour == "cuda" else "cuda", 0)
        same_ok &= (np.array_equal(r["ca"], other["ca"]) and same_bits(r["sca"], other["sca"])
                    and r["cols"].size == 0 and other["cols"].size == 0)
        torch_ok &= np.array_equal(torch_default_quant(r["a16"], t)[0], r["ca"])
        ca_div = quantize_rows(r["a16"], t, flavour, div_scale)[0]
        diff = ca_div != r["ca"]
        div_ok &= (np.array_equal(diff, planted) and int(planted.sum()) == 8
                   and all(diff[i].any() for i in TIE_INPUTS) and not np.delete(diff, list(TIE_INPUTS), 0).any()
                   and bool(np.all(np.abs(ca_div.astype(np.int64) - r["ca"]) <= 1)))
        divd.append(f"{name} {int(diff.sum())}/{int(planted.sum())}")
    rc_, rd_ = (results[n] for n in ("cuda_f32_64_t6_r6_ties", "default_f16_64_t6_r6_ties"))
    same_ok &= (np.array_equal(rc_["a16"], rd_["a16"]) and np.array_equal(rc_["ca"], rd_["ca"])
                and same_bits(rc_["sca"], rd_["sca"]) and torch_ok)
    ok(same_ok, "exact input ties: cuda and default flavours give identical codes",
       f"cuda_f32_64_t6_r6_ties and default_f16_64_t6_r6_ties: same A16, .ca identical ({rc_['ca'].size} codes, "
       f"{int(exact_ties(rc_['a16'], (0.0, 6.0)).sum())} at planted exact ties in rows {sorted(TIE_INPUTS)}), "
       "equal to torch's 127.0 / row_stats (reciprocal * 127)")
    ca_div = quantize_rows(rc_["a16"], 6.0, "cuda", div_scale)[0]
    ok(div_ok, "exact input ties: IEEE 127/absmax instead of 127 * f32(1/absmax) changes the codes at the planted "
       "ties, and only there",
       f"codes changed / planted ties: {', '.join(divd)}, at "
       f"{[(int(i), int(j), int(rc_['ca'][i, j]), int(ca_div[i, j])) for i, j in np.argwhere(ca_div != rc_['ca'])]} "
       "(row, col, fixture, IEEE)")

    # +0.0 in cuda's base for the all-outlier row (SCA -0.0) and the zero row (no bias)
    zr = []
    detail = []
    for name in ("cuda_f32_64_t6_r6_zerorows", "cuda_bf16_64_t6_r6_zerorows"):
        case = next(c for c in LT_CASES if c[0] == name)
        wname, D, rows = case[1], case[3], case[5]
        r = results[name]
        W = ws[wname]
        ao, zro = rows - 1, ZERO_X_ROW
        v = ((r["i32"].astype(F32) * r["sca"][:, None]).astype(F32) * W["scb"][None, :]).astype(F32)
        neg_v = int(np.signbit(v[ao]).sum())
        plain = to_dtype(fp16((v * MM_DEQUANT_CONST).astype(F32)), D)   # v * C without the fma's + 0.0
        plain_neg = int(np.signbit(plain[ao]).sum())
        nbytes = len(raw_bytes(r["base"][[zro, ao]], D))
        base_zero = not any(raw_bytes(r["base"][[zro, ao]], D))
        zr.append(case[2] == "cuda" and case[6] == "none" and r["bias"] is None and base_zero
                  and not r["x"][zro].any() and bits(r["sca"])[zro] == 0 and bits(r["sca"])[ao] == 0x80000000
                  and not r["i32"][[zro, ao]].any() and neg_v == v.shape[1] and plain_neg == v.shape[1])
        detail.append(f"{name}: .base rows {zro} (zeros) and {ao} (all outliers) are {nbytes} bytes, all 0x00 "
                      f"({D}); v = -0.0 in {neg_v}/{v.shape[1]} columns of row {ao}, where v * C without the "
                      f"fma would give -0.0 in {plain_neg}")
    ok(all(zr) and len(zr) == 2, "cuda dequantization without bias: +0.0 in the zero row and the all-outlier row",
       "; ".join(detail))

    # out.add_(bias) on an fp16 tensor (CUDA's unfused bias): computed in fp32, rounded to fp16
    rng = np.random.default_rng(7)
    o16 = fp16(rng.standard_normal(4000).astype(F32) * 3)
    add_ok = True
    for bdt in ("bfloat16", "float32"):
        b = to_dtype(rng.standard_normal(4000).astype(F32), bdt)
        t_out = torch.from_numpy(o16).half().add_(torch.from_numpy(b).to(TORCH_DT[bdt])).float().numpy()
        add_ok &= same_bits(t_out, fp16((o16 + b).astype(F32)))
    ok(add_ok, "torch's in-place fp16 add of a bf16 / fp32 bias is fp16(f32(a + b))")

    # fmaf emulation against float64 where float64 is exact enough
    a = rng.standard_normal(300).astype(F32)
    c = rng.standard_normal(300).astype(F32)
    f = fmaf(a, MM_DEQUANT_CONST, c)
    ex = np.array([Fraction(float(p)) * Fraction(float(MM_DEQUANT_CONST)) + Fraction(float(q)) for p, q in zip(a, c)])
    err = max(abs(Fraction(float(v)) - e) / abs(e) for v, e in zip(f, ex))
    ok(err <= 2.0 ** -24, "fmaf is one rounding of the exact a*b+c", f"max rel err {float(err):.3g}")

    # outlier semantics in the planted inputs
    sem = []
    for D in DTYPES:
        x = make_x(5, 64, D, "outliers")
        m = outlier_mask(fp16(x), 6.0)
        six = np.argwhere(x == 6.0)
        below = np.argwhere(x == to_dtype(np.array([below_six(D)], F32), D)[0])
        sem.append(bool(m[tuple(six[0])]) and not m[tuple(below[0])])
        if D == "float32":
            edge = np.argwhere(x == F32(5.999))
            sem.append(bool(m[tuple(edge[0])]) and fp16(x)[tuple(edge[0])] == 6.0)
    ok(all(sem), "6.0 is an outlier, the value under 6 is not, fp32 5.999 is (fp16 rounds it to 6)")

    # all-outlier rows (cuda): SCA = -0.0, codes 0, base = bias (or +0)
    ao = []
    for case in LT_CASES:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        if not kind.startswith("alloutlier"):
            continue
        r = results[name]
        last = rows - 1
        want = to_dtype(fp16(r["bias"]), D) if r["bias"] is not None else np.zeros(r["base"].shape[1], F32)
        ao.append(bits(r["sca"])[last] == 0x80000000 and not r["ca"][last].any()
                  and same_bits(r["base"][last], want) and r["cols"].size == r["x"].shape[1])
    ok(all(ao) and len(ao) == 4, "all-outlier row: SCA -0.0, codes 0, base = bias, every column an outlier")

    # threshold 0 == threshold above max|x|
    th = []
    for wname, D, rows, kind in (("w40x64_float16", "float16", 5, "clean"), ("w48x1536_bfloat16", "bfloat16", 16, "clean"),
                                 ("w7x33_float32", "float32", 1, "clean"), ("w40x64_float32", "float32", 5, "outliers")):
        W = ws[wname]
        x = make_x(rows, W["cb"].shape[1], D, kind)
        bias = make_bias(W["cb"].shape[0], D, "th")
        big = float(np.max(np.abs(x))) * 2 + 1
        for flavour in ("cuda", "default"):
            r0 = llm_int8(x, D, W["cb"], W["scb"], 0.0, bias, D, flavour, 0)
            r1 = llm_int8(x, D, W["cb"], W["scb"], big, bias, D, flavour, 0)
            th.append(np.array_equal(r0["ca"], r1["ca"]) and same_bits(r0["sca"], r1["sca"])
                      and r1["cols"].size == 0 and same_bits(r0["base"], r1["base"]) and np.array_equal(r0["y"], r1["y"]))
    ok(all(th), "threshold 0 gives the same codes, scales, base and y as a threshold above max|x|", f"{len(th)} pairs")

    # cuda vs default on inputs without outliers
    cd = []
    detail = []
    for cname, dname in (("cuda_f16_64_t6_r5_clean", "default_f16_64_t6_r5_clean"),):
        rc, rd = results[cname], results[dname]
        cd.append(np.array_equal(rc["ca"], rd["ca"]) and same_bits(rc["sca"], rd["sca"]))
        bc, bd = rc["base"].astype(F64), rd["base"].astype(F64)
        ulp = np.spacing(np.maximum(np.abs(bc), np.abs(bd)).astype(np.float16)).astype(F64)
        ulps = np.rint(np.abs(bc - bd) / ulp).astype(np.int64)
        # one fp16 rounding apart, plus the constants' 1.8e-5 relative difference on the product
        # term, which the bias can cancel (then 2 fp16 ulps of the small sum)
        prod = np.abs(bd - rd["bias"].astype(F64)[None, :])
        cd.append(bool(np.all(np.abs(bc - bd) <= ulp + 3e-5 * prod)))
        detail.append(f"{cname}: fp16 base differs in {int((ulps > 0).sum())}/{ulps.size} entries, "
                      f"max {int(ulps.max())} ulp")
    for (o, i) in WEIGHT_SHAPES:
        W = ws[f"w{o}x{i}_float32"]
        for rows in (1, 5, 16):
            for D in DTYPES:
                x = make_x(rows, i, D, "clean")
                rc = llm_int8(x, D, W["cb"], W["scb"], 6.0, None, "none", "cuda", 0)
                rd = llm_int8(x, D, W["cb"], W["scb"], 6.0, None, "none", "default", 0)
                cd.append(np.array_equal(rc["ca"], rd["ca"]))
                # cuda rounds to fp16 before D; default rounds fp32 to D once; constants differ by 1.8e-5
                # (bfloat16: bf16(fp16(z)) against bf16(z'), up to one bf16 ulp apart)
                rel = {"float32": 2.0 ** -10, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[D]
                tol = np.abs(rd["base"].astype(F64)) * (rel + 3e-5) + 2.0 ** -24
                cd.append(bool(np.all(np.abs(rc["base"].astype(F64) - rd["base"].astype(F64)) <= tol)))
    ok(all(cd), "cuda and default flavours: same codes without outliers, base differs only in last bits",
       "; ".join(detail))

    # autocast without outliers: y is base (fp32)
    r = results["cuda_f32_64_t6_r5_clean_autocast"]
    ok(r["cols"].size == 0 and np.array_equal(r["y"], r["base"].astype(F64)), "autocast without outliers: y = base (fp32)")

    # accuracy against x @ W^T (float64) for threshold-6 and outlier-free cases
    acc = []
    worst = 0.0
    for case in LT_CASES:
        name, wname, flavour, D, t, rows, bdt, kind, ac = case
        if t == 0 and kind != "clean":
            continue
        r = results[name]
        W = ws[wname]
        ref = r["x"].astype(F64) @ W["w"].astype(F64).T
        if r["bias"] is not None:
            ref = ref + r["bias"].astype(F64)
        keep = np.ones(ref.shape[1], dtype=bool)
        keep[TIE_ROW_INDEX] = False  # its huge values would hide the error elsewhere
        rel = np.linalg.norm((r["y"] - ref)[:, keep]) / np.linalg.norm(ref[:, keep])
        worst = max(worst, rel)
        acc.append(rel < 0.04)
    ok(all(acc), "LLM.int8 y within a few percent of x @ W^T (float64)", f"worst relative error {worst:.4f}")

    # the training product against the fp16 weight
    fp = []
    worst = 0.0
    for case in FP_CASES:
        r = build_fp(ws, case)
        W = ws[case[1]]
        keep = np.arange(W["cb"].shape[0]) != TIE_ROW_INDEX  # the tie row's 0.5 errors dominate
        deq = dequantize(W["cb"], W["scb"], case[2]).astype(F64)
        y_ref = r["x"].astype(F64) @ W["w16"].astype(F64).T + (0 if r["bias"] is None else r["bias"].astype(F64))
        gx_ref = r["g"][:, keep].astype(F64) @ W["w16"][keep].astype(F64)
        gx = r["g"][:, keep].astype(F64) @ deq[keep]
        exact = np.array_equal(r["gx"], r["g"].astype(F64) @ deq)
        rel = max(np.linalg.norm((r["y"] - y_ref)[:, keep]) / np.linalg.norm(y_ref[:, keep]),
                  np.linalg.norm(gx - gx_ref) / np.linalg.norm(gx_ref))
        worst = max(worst, rel)
        fp.append(rel < 0.03 and exact)
    ok(all(fp), "training product y and grad_x close to the unquantized product", f"worst relative error {worst:.4f}")

    if ok.failed:
        print(f"{ok.failed} check(s) failed")
        sys.exit(1)
    print("all checks passed")


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    if sys.argv[1] == "selftest":
        selftest()
    else:
        write_fixtures(sys.argv[1])


if __name__ == "__main__":
    main()
