"""``python -m tests.accelerate_compat``: the compatibility table (see :mod:`.harness`).

    python -m tests.accelerate_compat                      # anyaccel against the stored baseline
    python -m tests.accelerate_compat --impl accelerate --write-baseline   # re-measure Accelerate
    python -m tests.accelerate_compat --script test_ops.py --verbose
    python -m tests.accelerate_compat --spare-test-utils  # keep accelerate.test_utils (the former variant)
"""

from __future__ import annotations

import argparse
import json
import sys

from . import harness


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.accelerate_compat")
    parser.add_argument("--impl", choices=("accelerate", "anyaccel"), default="anyaccel")
    parser.add_argument("--script", action="append", choices=harness.SCRIPTS, help="only this script (repeatable)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per 2-process job")
    parser.add_argument("--isolate", action="store_true", help="every call in its own job (slower)")
    parser.add_argument("--write-baseline", action="store_true", help="store the results as baseline.json")
    parser.add_argument("--json", help="also write the full results here")
    parser.add_argument("--verbose", action="store_true", help="print each call as it finishes")
    parser.add_argument("--spare-test-utils", action="store_true",
                        help="keep Accelerate's own accelerate.test_utils (the former variant) instead of the full swap")
    args = parser.parse_args(argv)
    scripts = tuple(args.script or harness.SCRIPTS)
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    if args.impl == "accelerate":
        import accelerate

        results = harness.run_all("accelerate", args.timeout, scripts, isolate=args.isolate, progress=progress)
        results["accelerate_version"] = accelerate.__version__
        results["command"] = "python -m tests.accelerate_compat --impl accelerate --write-baseline"
        if args.write_baseline:
            if args.script:  # only these scripts were measured again: keep the others
                stored = harness.load_baseline()
                stored["scripts"].update(results["scripts"])
                results["scripts"] = stored["scripts"]
            for report in results["scripts"].values():
                for call in report["calls"].values():
                    call.pop("traceback", None)
            with open(harness.BASELINE, "w") as f:
                json.dump(results, f, indent=1)  # calls in the order main() makes them
        print(harness.table(results, results))
    else:
        baseline = harness.load_baseline()
        baseline["scripts"] = {s: v for s, v in baseline["scripts"].items() if s in scripts}
        swap = "spare_test_utils" if args.spare_test_utils else "full"
        results = harness.run_all("anyaccel", args.timeout, scripts, baseline=baseline, isolate=args.isolate,
                                   progress=progress, swap=swap)
        print(harness.table(baseline, results))
        for script, report in results["scripts"].items():
            if report["missing"]:
                print(f"\n{script}: names anyaccel lacks: {', '.join(report['missing'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)  # calls in the order main() makes them
    return 0


if __name__ == "__main__":
    sys.exit(main())
