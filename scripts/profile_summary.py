#!/usr/bin/env python3
"""Self time per op of a Chrome trace written with MEMTUNE_PROFILE=STEP:FILE.

    python3 scripts/profile_summary.py FILE [--top N]

An op's self time is its duration less that of the ops nested in it on the same thread,
so the column sums to the traced time. Standard library only.
"""
import argparse
import collections
import json
import signal


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    with open(a.trace) as f:
        data = json.load(f)
    events = data if isinstance(data, list) else data.get("traceEvents", [])
    events = [e for e in events if e.get("ph") == "X"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    self_us, total_us, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[stack[-1]["name"]] -= e["dur"]
            self_us[e["name"]] += e["dur"]
            total_us[e["name"]] += e["dur"]
            calls[e["name"]] += 1
            stack.append(e)
    traced = sum(self_us.values())
    print(f"{'self ms':>9} {'%':>6} {'total ms':>9} {'calls':>6}  op   (traced {traced / 1000:.1f} ms)")
    for name, us in self_us.most_common(a.top):
        print(f"{us / 1000:9.1f} {100 * us / traced:6.1f} {total_us[name] / 1000:9.1f} {calls[name]:6d}  {name}")


if __name__ == "__main__":
    main()
