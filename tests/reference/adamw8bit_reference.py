#!/usr/bin/python3
"""bitsandbytes' AdamW8bit (Optimizer2State, optim_bits=8, block_wise) in NumPy, fp32 op by op.

Written from bitsandbytes' published algorithm (csrc/kernels.cu: kOptimizerStatic8bit2StateBlockwise
and kOptimizer32bit2State for ADAM; bitsandbytes/optim/optimizer.py; functional.py's
create_dynamic_map), for memtune's tests. What it computes, per step t (1-based), per tensor:

  * tensors with fewer than min_8bit_size = 4096 elements keep fp32 states (the 32-bit kernel):
      g  = g * gnorm_scale
      m  = m * b1 + (1 - b1) * g
      v  = v * b2 + (1 - b2) * (g * g)
      c1 = 1 - b1^t,  c2 = sqrt(1 - b2^t),  step_size = (-lr * c2) / c1
      p  = p + step_size * (m / (sqrt(v) + eps * c2))
      p  = p * (1 - lr * wd)            (only when wd > 0: decoupled, after the update)
  * larger tensors: states as uint8 codes in blocks of 256 with one fp32 absmax per block and state;
    m on the signed dynamic map, v on the unsigned one. Per block:
      m, v dequantized (code value * old absmax); a non-finite gradient zeroes both and leaves p
      v = v * b2 + ((1 - b2) * g) * g ;  m = m * b1 + (1 - b1) * g
      new absmax = max |.| over the block's 256 lanes; lanes past the tensor's end take part with
        g = 0, code1 = 128, code2 = 0 (as the kernel's padded loads do)
      p = p + step_size * (m / (sqrt(v) + c2 * eps)), then the decay as above
      codes: quantize_2D (binary search over the map, nearer neighbour by an fp32 midpoint) of
        m / absmax1 and v / absmax2; m's code moved one step when its value's sign differs from m's.
    An all-zero block has absmax 0: 0/0 is NaN, the search ends at code 0, and m's sign fix-up
    turns it into 255 (uint8 wrap), as on the GPU.

All arithmetic is IEEE fp32, one rounding per operation, in the kernel's order; beta^t is the
correctly rounded fp32 power. The CUDA build of
bitsandbytes uses --use_fast_math (__fdividef, __powf, fused multiply-adds), so a GPU run may differ
from this in the last bit of a value now and then; the algorithm and the order are the same.

Usage: adamw8bit_reference.py OUT_DIR  -- writes cases.txt and, per case, NAME.p0, NAME.g (all
steps' gradients, concatenated), NAME.p (final), and NAME.state1/.state2 (uint8 codes or fp32) and
NAME.absmax1/.absmax2 (8-bit only); plus dynamic_map and udynamic_map (fp32 [256]).
"""
import os
import sys

import numpy as np
import torch

F32 = np.float32
BLOCK = 256
MIN_8BIT_SIZE = 4096


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """functional.create_dynamic_map with the same torch fp32 operations (linspace, means, scale)."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        if signed:
            items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        else:
            items = 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    # additional_items = 2**(7-7) - 1 = 0 for these arguments
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return np.array(data, dtype=F32)


SIGNED_MAP = create_dynamic_map(True)
UNSIGNED_MAP = create_dynamic_map(False)


def quantize_2d(code, x, signed):
    """quantize_2D<SIGNED> for an fp32 array x: a 7-step binary search from code[127] (the
    kernel's three 'quadrant' values are code[63], code[127], code[191], the same entries the
    plain search visits), then the nearer of the bracketing entries by the fp32 midpoint. NaN
    compares false everywhere."""
    x = x.astype(F32)
    n = x.shape[0]
    pivot = np.full(n, 127, dtype=np.int64)
    upper_pivot = np.full(n, 255, dtype=np.int64)
    lower_pivot = np.zeros(n, dtype=np.int64)
    lower = np.full(n, -1.0 if signed else 0.0, dtype=F32)
    upper = np.ones(n, dtype=F32)
    val = code[pivot]
    i = 64
    while i > 0:
        gt = x > val
        lower_pivot = np.where(gt, pivot, lower_pivot)
        lower = np.where(gt, val, lower)
        upper_pivot = np.where(gt, upper_pivot, pivot)
        upper = np.where(gt, upper, val)
        pivot = np.where(gt, pivot + i, pivot - i)
        val = code[pivot]
        i >>= 1
    gt = x > val
    mid_up = ((upper + val) * F32(0.5)).astype(F32)
    mid_lo = ((lower + val) * F32(0.5)).astype(F32)
    out = np.where(gt, np.where(x > mid_up, upper_pivot, pivot), np.where(x < mid_lo, lower_pivot, pivot))
    return out.astype(np.int64)


class State:
    def __init__(self, n):
        self.n = n
        self.eight_bit = n >= MIN_8BIT_SIZE
        if self.eight_bit:
            self.blocks = (n + BLOCK - 1) // BLOCK
            self.c1 = np.zeros(n, dtype=np.uint8)
            self.c2 = np.zeros(n, dtype=np.uint8)
            self.absmax1 = np.zeros(self.blocks, dtype=F32)
            self.absmax2 = np.zeros(self.blocks, dtype=F32)
        else:
            self.m = np.zeros(n, dtype=F32)
            self.v = np.zeros(n, dtype=F32)


def powf(base, step):
    """powf(base, step) correctly rounded: the fp32 base's power in float64, rounded once. (The
    kernels call powf/__powf; libm's and numpy's float32 power differ in the last bit now and
    then, so both sides of the test use this definition.)"""
    return F32(np.float64(F32(base)) ** np.float64(step))


def scalars(step, lr, b1, b2):
    lr, b1, b2 = F32(lr), F32(b1), F32(b2)
    c1 = F32(F32(1) - powf(b1, step))
    c2 = F32(np.sqrt(F32(F32(1) - powf(b2, step))))
    step_size = F32(F32(-lr * c2) / c1)
    return lr, b1, b2, c1, c2, step_size


def step_32bit(st, p, g, step, lr, b1, b2, eps, wd, gnorm_scale):
    lr, b1, b2, c1, c2, step_size = scalars(step, lr, b1, b2)
    eps, wd = F32(eps), F32(wd)
    g = (F32(gnorm_scale) * g).astype(F32)
    st.m = (st.m * b1 + (F32(1) - b1) * g).astype(F32)
    st.v = (st.v * b2 + (F32(1) - b2) * (g * g)).astype(F32)
    # update_scale is 1.0 without max_unorm: 1.0f * step_size is step_size exactly
    p = (p + step_size * (st.m / (np.sqrt(st.v) + eps * c2))).astype(F32)
    if wd > 0:
        p = (p * (F32(1) - lr * wd)).astype(F32)
    return p


def step_8bit(st, p, g, step, lr, b1, b2, eps, wd, gnorm_scale):
    lr, b1, b2, corr1, corr2, step_size = scalars(step, lr, b1, b2)
    eps, wd, gs = F32(eps), F32(wd), F32(gnorm_scale)
    n, nb = st.n, st.blocks
    full = nb * BLOCK
    # the kernel's padded lanes: g 0, code1 128, code2 0
    gp = np.zeros(full, dtype=F32)
    gp[:n] = g
    c1 = np.full(full, 128, dtype=np.int64)
    c1[:n] = st.c1
    c2 = np.zeros(full, dtype=np.int64)
    c2[:n] = st.c2
    blk = np.arange(full) // BLOCK
    finite = np.isfinite(gp)
    gv = np.where(finite, gp, F32(0)).astype(F32) * gs
    s2 = (UNSIGNED_MAP[c2] * st.absmax2[blk]).astype(F32)
    s2 = (s2 * b2 + (((F32(1) - b2) * gv).astype(F32) * gv)).astype(F32)
    s1 = (SIGNED_MAP[c1] * st.absmax1[blk]).astype(F32)
    s1 = (s1 * b1 + (F32(1) - b1) * gv).astype(F32)
    s1 = np.where(finite, s1, F32(0)).astype(F32)
    s2 = np.where(finite, s2, F32(0)).astype(F32)
    new1 = np.abs(s1).reshape(nb, BLOCK).max(axis=1).astype(F32)
    new2 = np.abs(s2).reshape(nb, BLOCK).max(axis=1).astype(F32)
    st.absmax1, st.absmax2 = new1, new2
    denom = (np.sqrt(s2[:n]) + F32(corr2 * eps)).astype(F32)
    pn = (p + step_size * (s1[:n] / denom)).astype(F32)
    if wd > 0:
        pn = (pn * (F32(1) - lr * wd)).astype(F32)
    p = np.where(finite[:n], pn, p).astype(F32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q1 = quantize_2d(SIGNED_MAP, (s1 / new1[blk]).astype(F32), True)
        q2 = quantize_2d(UNSIGNED_MAP, (s2 / new2[blk]).astype(F32), False)
    # the signed code keeps the sign of m (signbit compares, so -0.0 counts as negative)
    flip = np.signbit(SIGNED_MAP[q1]) != np.signbit(s1)
    q1 = np.where(flip, np.where(s1 > 0, q1 + 1, q1 - 1), q1) & 0xFF
    st.c1 = q1[:n].astype(np.uint8)
    st.c2 = q2[:n].astype(np.uint8)
    return p


def run(n, steps, lr, b1, b2, eps, wd, gnorm_scale, rng, zero_blocks=0, bad=False):
    p = (rng.standard_normal(n) * 0.05).astype(F32)
    st = State(n)
    p0 = p.copy()
    grads = []
    for t in range(1, steps + 1):
        g = (rng.standard_normal(n) * rng.uniform(1e-4, 1e-1)).astype(F32)
        # a tail of very small gradients, so some codes sit near the maps' low end
        g[n // 2: n // 2 + 300] *= F32(1e-5)
        if zero_blocks and t <= 3:
            g[: zero_blocks * BLOCK] = 0  # whole blocks at absmax 0 for the first steps
        if bad and t == 5:
            g[7] = np.inf
            g[n - 3] = np.nan
        grads.append(g)
        if st.eight_bit:
            p = step_8bit(st, p, g, t, lr, b1, b2, eps, wd, gnorm_scale)
        else:
            p = step_32bit(st, p, g, t, lr, b1, b2, eps, wd, gnorm_scale)
    return p0, np.concatenate(grads), p, st


def selftest():
    # the maps: 256 sorted entries, signed symmetric around 0 with 1.0 on top
    assert SIGNED_MAP[127] == 0 and SIGNED_MAP[255] == 1.0 and SIGNED_MAP[0] < -0.99
    assert np.all(np.diff(SIGNED_MAP) > 0) and np.all(np.diff(UNSIGNED_MAP) > 0)
    assert UNSIGNED_MAP[0] == 0 and UNSIGNED_MAP[255] == 1.0
    # every map entry quantizes to itself; a value between two entries to the nearer one
    for code, signed in ((SIGNED_MAP, True), (UNSIGNED_MAP, False)):
        assert np.array_equal(quantize_2d(code, code, signed), np.arange(256))
        lo, hi = code[100].astype(np.float64), code[101].astype(np.float64)
        x = np.array([lo + (hi - lo) * 0.3, lo + (hi - lo) * 0.7], dtype=F32)
        assert list(quantize_2d(code, x, signed)) == [100, 101]
    # 0/0 gives code 255 for m (see the docstring), 0 for v
    st = State(4096)
    p = np.zeros(4096, dtype=F32)
    step_8bit(st, p, np.zeros(4096, dtype=F32), 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)
    assert np.all(st.c1 == 255) and np.all(st.c2 == 0) and np.all(st.absmax1 == 0)
    # one step from zero states: m = 0.1 g, v = 0.001 g^2, update ~ -lr * sign(g)
    g = np.linspace(-1, 1, 4096).astype(F32)
    st = State(4096)
    p = np.zeros(4096, dtype=F32)
    p = step_8bit(st, p, g, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)
    big = np.abs(g) > 1e-3
    assert np.allclose(p[big], -1e-3 * np.sign(g[big]), rtol=1e-4)
    deq1 = SIGNED_MAP[st.c1] * np.repeat(st.absmax1, BLOCK)
    assert np.allclose(deq1, 0.1 * g, atol=0.02 * np.abs(0.1 * g).max())


def main():
    selftest()
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    SIGNED_MAP.tofile(os.path.join(out, "dynamic_map"))
    UNSIGNED_MAP.tofile(os.path.join(out, "udynamic_map"))
    rng = np.random.default_rng(19)
    # quantize_2D on many values: the entries, their midpoints and one step either side, values
    # across every decade of both signs, the edges and NaN
    xs = [SIGNED_MAP, UNSIGNED_MAP]
    for code in (SIGNED_MAP, UNSIGNED_MAP):
        mid = ((code[:-1] + code[1:]) * F32(0.5)).astype(F32)
        xs += [mid, np.nextafter(mid, F32(2)), np.nextafter(mid, F32(-2)),
               np.nextafter(code, F32(2)), np.nextafter(code, F32(-2))]
    mags = (10.0 ** rng.uniform(-9, 0, 200000)).astype(F32)
    xs += [mags, -mags, np.array([0.0, -0.0, 1.0, -1.0, np.nan, 1e-30, -1e-30], dtype=F32)]
    x = np.clip(np.concatenate(xs).astype(F32), F32(-1), F32(1))
    x.tofile(os.path.join(out, "quant_x"))
    with np.errstate(invalid="ignore"):
        quantize_2d(SIGNED_MAP, x, True).astype(np.uint8).tofile(os.path.join(out, "quant_signed"))
        quantize_2d(UNSIGNED_MAP, np.abs(x), False).astype(np.uint8).tofile(os.path.join(out, "quant_unsigned"))
    # name n lr b1 b2 eps wd gnorm_scale zero_blocks bad
    cases = [
        ("big_wd", 5000, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 0, False),
        ("exact_blocks", 8192, 3e-3, 0.9, 0.95, 1e-6, 0.0, 0.7, 2, False),
        ("nonfinite", 4096 + 17, 2e-3, 0.85, 0.99, 1e-8, 0.1, 1.0, 1, True),
        ("small", 4095, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 0, False),
        ("tiny_clipped", 64, 5e-3, 0.9, 0.999, 1e-8, 0.0, 0.25, 0, False),
    ]
    steps = 20
    with open(os.path.join(out, "cases.txt"), "w") as f:
        for name, n, lr, b1, b2, eps, wd, gs, zb, bad in cases:
            p0, grads, p, st = run(n, steps, lr, b1, b2, eps, wd, gs, rng, zb, bad)
            base = os.path.join(out, name)
            p0.tofile(base + ".p0")
            grads.tofile(base + ".g")
            p.tofile(base + ".p")
            if st.eight_bit:
                st.c1.tofile(base + ".state1")
                st.c2.tofile(base + ".state2")
                st.absmax1.tofile(base + ".absmax1")
                st.absmax2.tofile(base + ".absmax2")
            else:
                st.m.tofile(base + ".state1")
                st.v.tofile(base + ".state2")
            f.write(f"{name} {n} {steps} {lr!r} {b1!r} {b2!r} {eps!r} {wd!r} {gs!r} {int(st.eight_bit)}\n")


if __name__ == "__main__":
    main()
