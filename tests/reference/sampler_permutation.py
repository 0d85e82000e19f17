"""Reference for memtune's Sampler shuffle, written from its documented algorithm:
splitmix64 (Steele, Lea, Flood 2014), the epoch's stream state = first output of the
seed's stream XOR (epoch * 0xd1b54a32d192ed03), then Fisher-Yates from the end with
j = (next() * (i + 1)) >> 64.

usage: sampler_permutation.py N SEED EPOCH   -> prints the permutation, space separated
"""
import sys

MASK = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def permutation(n, seed, epoch):
    _, first = splitmix64(seed)
    state = first ^ ((epoch * 0xD1B54A32D192ED03) & MASK)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        state, r = splitmix64(state)
        j = (r * (i + 1)) >> 64
        p[i], p[j] = p[j], p[i]
    return p


if __name__ == "__main__":
    n, seed, epoch = (int(a) for a in sys.argv[1:4])
    print(" ".join(str(x) for x in permutation(n, seed, epoch)))
