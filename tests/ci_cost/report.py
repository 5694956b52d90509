"""Summarise a ``CI_COST_LOG`` (docs/contributing/testing.md, "CI's time"): CPU seconds, wall seconds and Python
process starts per test file and for the slowest tests. ``python tests/ci_cost/report.py LOG [N]``."""

from __future__ import annotations

import collections
import json
import sys


def main(argv: list) -> None:
    log, top = argv[0], int(argv[1]) if len(argv) > 1 else 25
    tests: dict = collections.defaultdict(lambda: [0.0, 0.0])  # test -> [cpu, wall]
    for line in open(log):
        r = json.loads(line)
        tests[r["test"]][0] += r["cpu_self"] + r["cpu_children"]
        tests[r["test"]][1] += r["wall"]
    starts: collections.Counter = collections.Counter()
    forks: collections.Counter = collections.Counter()
    try:
        for line in open(log + ".procs", errors="replace"):
            test, kind, _ = (line.rstrip("\n").split("\t") + ["", ""])[:3]
            (starts if kind == "start" else forks)[test] += 1
    except FileNotFoundError:
        pass
    files: dict = collections.defaultdict(lambda: [0.0, 0.0, 0, 0, 0])
    for test, (cpu, wall) in tests.items():
        f = files[test.split("::")[0]]
        f[0] += cpu; f[1] += wall; f[2] += starts[test]; f[3] += forks[test]; f[4] += 1
    print(f"{'file':58} {'tests':>5} {'CPU s':>8} {'wall s':>8} {'starts':>6} {'forks':>6}")
    for name, (cpu, wall, s, k, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:58} {n:5d} {cpu:8.1f} {wall:8.1f} {s:6d} {k:6d}")
    total = [sum(v[i] for v in files.values()) for i in range(5)]
    print(f"{'total':58} {total[4]:5d} {total[0]:8.1f} {total[1]:8.1f} {total[2]:6d} {total[3]:6d}")
    _workers(log)
    print(f"\nslowest {top} tests by CPU")
    for test, (cpu, wall) in sorted(tests.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f} {starts[test]:4d}  {test}")


def _workers(log: str) -> None:
    """Per xdist worker: when its first test phase started and its last ended (seconds from the
    first start), and the seconds it spent in tests: a worker that ends long before the other
    idled at the end (the long files were handed out late)."""
    spans: dict = collections.defaultdict(lambda: [float("inf"), 0.0, 0.0])  # worker -> [first, last, busy]
    for line in open(log):
        r = json.loads(line)
        if "start" not in r:
            return  # a log from before the plugin recorded start times
        w = spans[r.get("worker") or "main"]
        w[0], w[1], w[2] = min(w[0], r["start"]), max(w[1], r["start"] + r["wall"]), w[2] + r["wall"]
    t0 = min(w[0] for w in spans.values())
    print("\nworker  starts    ends  busy s")
    for name, (first, last, busy) in sorted(spans.items()):
        print(f"{name:6} {first - t0:7.0f} {last - t0:7.0f} {busy:7.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
