#!/usr/bin/env python3
"""Makes memtune's bundled data (examples/data/): a synthetic instruction task whose
accuracy can be measured before and after fine-tuning, and a small plain-text corpus.

Standard library only; deterministic for a given --seed (the committed files use 1234).

  python3 scripts/make_bundled_data.py [--seed 1234] [--out examples/data]

Task records (instruction format, one JSON object per line):
  {"task": "reverse", "instruction": "Reverse: abc", "output": "cba"}
  {"task": "add",     "instruction": "Add: 12+7",    "output": "19"}
  {"task": "upper",   "instruction": "Upper: hello", "output": "HELLO"}
  {"task": "sort",    "instruction": "Sort: dbca",   "output": "abcd"}
The eval set holds no instruction that is also in the training set.
"""
import argparse
import json
import random
import string
from pathlib import Path

TASKS = ("reverse", "add", "upper", "sort")
WORDS = ("river stone cloud apple maple tiger lemon quiet green silver window garden "
         "candle market pocket bridge forest winter summer yellow little orange purple").split()


def letters(rng, lo=3, hi=6):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def example(rng, task):
    if task == "reverse":
        s = letters(rng)
        return f"Reverse: {s}", s[::-1]
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"Add: {a}+{b}", str(a + b)
    if task == "upper":
        s = rng.choice(WORDS) if rng.random() < 0.5 else letters(rng)
        return f"Upper: {s}", s.upper()
    s = letters(rng, 4, 6)
    return f"Sort: {s}", "".join(sorted(s))


def make_split(rng, count, exclude):
    records, seen = [], set(exclude)
    while len(records) < count:
        task = TASKS[len(records) % len(TASKS)]  # balanced tasks
        instruction, output = example(rng, task)
        if instruction in seen:
            continue
        seen.add(instruction)
        records.append({"task": task, "instruction": instruction, "output": output})
    rng.shuffle(records)
    return records


SUBJECTS = ("The small robot", "A patient gardener", "The old lighthouse keeper", "A curious student",
            "The river", "Every morning the baker", "The tired traveler", "A young fox")
VERBS = ("counted", "watched", "carried", "painted", "followed", "remembered", "planted", "found")
OBJECTS = ("the stars above the hill", "seven green apples", "a map of the northern coast",
           "the sound of the rain", "a letter from an old friend", "the last train home",
           "a basket of warm bread", "the shadows on the wall")
ENDINGS = ("before the sun went down.", "and smiled.", "without saying a word.", "for the first time.",
           "while the town was asleep.", "and then it was quiet again.")


def paragraph(rng):
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}"
                    for _ in range(rng.randint(2, 4)))


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "examples" / "data"))
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--eval", type=int, default=200)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rng = random.Random(args.seed)
    train = make_split(rng, args.train, ())
    evaluation = make_split(rng, args.eval, {r["instruction"] for r in train})
    write_jsonl(out / "tasks_train.jsonl", train)
    write_jsonl(out / "tasks_eval.jsonl", evaluation)

    paragraphs = [paragraph(rng) for _ in range(60)]
    (out / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    write_jsonl(out / "corpus.jsonl", [{"text": p} for p in paragraphs])


if __name__ == "__main__":
    main()
