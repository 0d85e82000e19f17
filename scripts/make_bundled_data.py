#!/usr/bin/env python3
"""Makes memtune's bundled data (examples/data/): a synthetic instruction task whose
accuracy can be measured before and after fine-tuning, and a small plain-text corpus.

Standard library only; deterministic for a given --seed (the committed files use 1234).

  python3 scripts/make_bundled_data.py [--seed 1234] [--out examples/data]

Task records (instruction format, one JSON object per line):
  {"task": "parity", "instruction": "Parity: 4817",  "output": "odd"}
  {"task": "last",   "instruction": "Last: qdeur",   "output": "r"}
  {"task": "first",  "instruction": "First: kvnm",   "output": "k"}
  {"task": "length", "instruction": "Length: abcde", "output": "5"}
The eval set holds no instruction that is also in the training set. The four are chosen so
that the quickstart's tiny model (1.1M parameters, LoRA on a base that saw only the corpus)
learns them on two CPU cores in a few minutes: each answer rests on a token at a fixed place
(the last digit, the last or first letter) or on a count, not on copying a whole string, which
a model this small learns only after many more steps.
"""
import argparse
import json
import random
import string
from pathlib import Path

TASKS = ("parity", "last", "first", "length")


def letters(rng, lo=3, hi=6):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def example(rng, task):
    if task == "parity":
        n = rng.randint(0, 9999)
        return f"Parity: {n}", "even" if n % 2 == 0 else "odd"
    if task == "last":
        s = letters(rng)
        return f"Last: {s}", s[-1]
    if task == "first":
        s = letters(rng)
        return f"First: {s}", s[0]
    s = letters(rng, 3, 9)
    return f"Length: {s}", str(len(s))


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

    # The corpus from its own generator, so that changing the tasks leaves it as it is.
    corpus_rng = random.Random(f"{args.seed}-corpus")
    paragraphs = [paragraph(corpus_rng) for _ in range(60)]
    (out / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    write_jsonl(out / "corpus.jsonl", [{"text": p} for p in paragraphs])


if __name__ == "__main__":
    main()
