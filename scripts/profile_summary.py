#!/usr/bin/env python3
"""Self time per op of a Chrome trace written with MEMTUNE_PROFILE=STEP:FILE.

    python3 scripts/profile_summary.py FILE [--top N]

An op's self time is its duration less that of the ops nested in it on the same thread,
so the column sums to the traced time. A trace of a run on a GPU (Kineto's) also has the
GPU's kernels, copies and fills: a second table gives their time by name, and how much of
the span from the first to the last of them the GPU was busy (time covered by at least
one), which says whether the host kept it fed. Where the trace links each kernel to its
launch (Kineto's `correlation`), a third table gives the GPU's time by where it was
launched: the innermost of memtune's scopes (`memtune::q_proj`, `memtune::attention`,
`memtune::loss`, ...: RECORD_FUNCTION in the source) or autograd's backward node around the
launch, and the op inside it that launched it. Standard library only.
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
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    launches = [e for e in events if e.get("cat") in LAUNCHES]
    events = [e for e in events if e.get("cat") in HOST_OPS]
    self_us, total_us, calls = collections.Counter(), collections.Counter(), collections.Counter()
    for e, around in nested(events):
        if around:
            self_us[around[-1]["name"]] -= e["dur"]
        self_us[e["name"]] += e["dur"]
        total_us[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    traced = sum(self_us.values())
    print(f"{'self ms':>9} {'%':>6} {'total ms':>9} {'calls':>6}  op   (traced {traced / 1000:.1f} ms)")
    for name, us in self_us.most_common(a.top):
        print(f"{us / 1000:9.1f} {100 * us / traced:6.1f} {total_us[name] / 1000:9.1f} {calls[name]:6d}  {name}")
    if gpu:
        gpu_summary(gpu, a.top)
        by_scope(gpu, events, launches, a.top)


GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# The host's ops: the legacy profiler's events have no category, Kineto's are cpu_op and
# user_annotation. Left out: launches (cuda_runtime, cuda_driver: inside the ops that make
# them), the span of the whole recording (Trace) and the profiler's own overhead.
HOST_OPS = {None, "cpu_op", "user_annotation", "python_function"}
LAUNCHES = {"cuda_runtime", "cuda_driver"}
SCOPE = "memtune::"
BACKWARD = "autograd::engine::evaluate_function: "


def gpu_summary(events, top):
    """Time per kernel name, and the busy share of the GPU's span."""
    us, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e["name"] if len(e["name"]) <= 100 else e["name"][:97] + "..."
        us[name] += e["dur"]
        calls[name] += 1
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    busy, end = 0.0, spans[0][0]
    for t0, t1 in spans:
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
    span = max(end - spans[0][0], 1e-3)
    print(f"\nGPU: {len(events)} kernels, copies and fills, {sum(us.values()) / 1000:.1f} ms in all; busy "
          f"{busy / 1000:.1f} ms of the {span / 1000:.1f} ms from the first to the last ({100 * busy / span:.0f} %)")
    print_times(us, calls, top, "kernel")


def print_times(us, calls, top, what):
    """The `top` largest of the times `us` (microseconds by name): ms, share of all, calls."""
    total = sum(us.values())
    print(f"{'ms':>9} {'%':>6} {'calls':>6}  {what}")
    for name, t in us.most_common(top):
        print(f"{t / 1000:9.1f} {100 * t / total:6.1f} {calls[name]:6d}  {name}")


def nested(events):
    """Each event with the events around it on its thread (outermost first; the list is the
    walk's own, copy it to keep it), thread by thread in order of start."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            yield e, stack
            stack.append(e)


def scope_of(names):
    """(scope, op) for a launch inside the ops `names` (outermost first): the innermost of
    memtune's scopes or backward nodes, and the innermost op inside it (memtune's own kernel
    where there is none). A scope inside a backward node is a checkpointed layer's rerun."""
    for k in range(len(names) - 1, -1, -1):
        name = names[k]
        if name.startswith(SCOPE) or name.startswith(BACKWARD):
            op = names[-1] if k + 1 < len(names) else "(its own kernels)"
            if name.startswith(BACKWARD):
                return "backward: " + name[len(BACKWARD):], op
            rerun = any(n.startswith(BACKWARD) for n in names[:k])
            return name + (" (rerun in backward)" if rerun else ""), op
    return "(outside memtune's scopes)", names[-1] if names else "(no op)"


def by_scope(gpu, ops, launches, top):
    """The GPU's time by the scope and op that launched each kernel, copy and fill."""
    around = {id(e): [x["name"] for x in stack] for e, stack in nested(ops + launches)}
    launch_of = {}
    for e in launches:
        c = e.get("args", {}).get("correlation")
        if c is not None:
            launch_of[c] = e
    us, calls = collections.Counter(), collections.Counter()
    us_op, calls_op = collections.Counter(), collections.Counter()
    linked = 0
    for e in gpu:
        launch = launch_of.get(e.get("args", {}).get("correlation"))
        if launch is None:
            scope, op = "(no launch in the trace)", "-"
        else:
            linked += 1
            scope, op = scope_of(around[id(launch)])
        us[scope] += e["dur"]
        calls[scope] += 1
        us_op[f"{scope} / {op}"] += e["dur"]
        calls_op[f"{scope} / {op}"] += 1
    if not linked:
        return
    print(f"\nGPU time by where it was launched ({linked} of {len(gpu)} linked to their launch): memtune's "
          f"scopes, autograd's backward nodes")
    print_times(us, calls, top, "scope")
    print()
    print_times(us_op, calls_op, top, "scope / the op that launched it")


if __name__ == "__main__":
    main()
