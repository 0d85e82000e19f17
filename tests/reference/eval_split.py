"""Reference for data.eval_split: which documents of a file are held out for evaluation.

The count is datasets' train_test_split(test_size=split): ceil(split * n) for a share in
(0, 1), the number itself for a whole number >= 1 (in Python floats, as datasets computes
it). With shuffling, the held-out documents are the first `count` entries of the sampler's
permutation of the n documents at epoch -1 (sampler_permutation.py); without, the last
`count` documents, as train_test_split(shuffle=False) takes its test rows.

usage: eval_split.py N SPLIT SEED SHUFFLE(0|1)   -> the held-out indices, ascending
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampler_permutation import permutation  # noqa: E402


def held_out(n, split, seed, shuffle):
    count = math.ceil(split * n) if split < 1 else int(split)
    if not 0 < count < n:
        raise SystemExit(f"count {count} of {n}")
    if not shuffle:
        return list(range(n - count, n))
    return sorted(permutation(n, seed, -1)[:count])


if __name__ == "__main__":
    n, split, seed, shuffle = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    print(" ".join(str(i) for i in held_out(n, split, seed, shuffle)))
