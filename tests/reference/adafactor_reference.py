#!/usr/bin/python3
"""Adafactor as Hugging Face's Trainer runs it for `optim: adafactor`, in PyTorch, for memtune's tests.

Written from the published algorithm (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates
with Sublinear Memory Cost") in the form transformers' optimization.Adafactor gives it, with the
options the Trainer passes: scale_parameter=False, relative_step=False (so the learning rate is
the schedule's), warmup_init=False, beta1=None (no first moment), eps=(1e-30, 1e-3) (only the
first is read with scale_parameter off), clip_threshold=1.0, decay_rate=-0.8, and the weight decay
of the parameter's group. Per tensor, step t (1-based, counted per tensor):

    b2t = 1 - t ** decay_rate                      (Python floats)
    u   = g * g + eps1                             (fp32)
    matrix (2 or more dims), R = mean over the last dim, C = mean over the second-to-last:
        row = row * b2t + (1 - b2t) * R(u)
        col = col * b2t + (1 - b2t) * C(u)
        u   = rsqrt(row / mean(row)) [.., :, None] * rsqrt(col) [.., None, :]  * g
    vector:
        v   = v * b2t + (1 - b2t) * u
        u   = rsqrt(v) * g
    u   = u / max(1, rms(u) / clip_threshold)      rms = ||u||_2 / sqrt(numel)
    u   = u * lr
    p   = p + (-wd * lr) * p                       (only when wd != 0; torch's add with alpha)
    p   = p + (-u)

Gradients are multiplied by the clipping coefficient first (as clip_grad_norm_ does in place).
Every operation is a PyTorch fp32 op on the CPU, as the CPU build of memtune runs them.

Usage: adafactor_reference.py OUT_DIR  -- writes cases.txt ("name steps lr wd gs dims..." per
line) and per case NAME.p0, NAME.g (every step's gradient, concatenated), NAME.p (final) and the
states: NAME.row and NAME.col for a matrix, NAME.sq for a vector (fp32, row-major).
"""
import math
import os
import sys

import numpy as np
import torch

EPS1, CLIP, DECAY = 1e-30, 1.0, -0.8


def rms(t):
    return t.norm(2) / (t.numel() ** 0.5)


def run(p, grads, lr, wd, gs):
    """Steps over `grads` from parameter p (both fp32 tensors); returns p and the states."""
    p = p.clone()
    factored = p.dim() >= 2
    row = torch.zeros(p.shape[:-1]) if factored else None
    col = torch.zeros(p.shape[:-2] + p.shape[-1:]) if factored else None
    sq = None if factored else torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.clone()
        if gs != 1.0:
            g.mul_(gs)
        b2t = 1.0 - math.pow(t, DECAY)
        u = g * g + EPS1
        if factored:
            row.mul_(b2t).add_(u.mean(dim=-1), alpha=1.0 - b2t)
            col.mul_(b2t).add_(u.mean(dim=-2), alpha=1.0 - b2t)
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
            c = col.unsqueeze(-2).rsqrt()
            u = (r * c) * g
        else:
            sq.mul_(b2t).add_(u, alpha=1.0 - b2t)
            u = sq.rsqrt() * g
        u.div_((rms(u) / CLIP).clamp_(min=1.0))
        u.mul_(lr)
        if wd != 0:
            p.add_(p, alpha=-wd * lr)
        p.add_(-u)
    return p, row, col, sq


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    steps = 20
    cases = [  # name, shape, lr, weight decay, gradient scale, gradient size
        ("matrix", (48, 80), 1e-2, 0.0, 1.0, 1.0),
        ("matrix_wd_clip", (33, 17), 3e-3, 0.1, 0.37, 1.0),
        ("tall", (300, 4), 1e-3, 0.01, 1.0, 1e-3),      # a LoRA B: out x r
        ("wide", (4, 300), 1e-3, 0.0, 1.0, 50.0),       # a LoRA A: r x in; the RMS clip acts
        ("vector", (96,), 1e-2, 0.0, 1.0, 1.0),         # a norm weight (never decayed)
        ("tiny_grads", (16, 16), 1e-2, 0.0, 1.0, 1e-20),  # eps1 dominates g^2
    ]
    with open(os.path.join(out, "cases.txt"), "w") as f:
        for name, shape, lr, wd, gs, size in cases:
            p0 = torch.randn(shape)
            grads = [torch.randn(shape) * size for _ in range(steps)]
            p, row, col, sq = run(p0, grads, lr, wd, gs)
            base = os.path.join(out, name)
            p0.numpy().tofile(base + ".p0")
            np.concatenate([g.numpy().ravel() for g in grads]).tofile(base + ".g")
            p.numpy().tofile(base + ".p")
            if row is not None:
                row.numpy().tofile(base + ".row")
                col.numpy().tofile(base + ".col")
            else:
                sq.numpy().tofile(base + ".sq")
            f.write(f"{name} {steps} {lr!r} {wd!r} {gs!r} {' '.join(str(d) for d in shape)}\n")


if __name__ == "__main__":
    main()
