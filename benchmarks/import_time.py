"""Import cost on top of ``import torch``, measured in fresh interpreters.

Each sample is one new ``python`` process that imports torch, then the contender, and reports
``perf_counter`` around the second import only -- so the number is exactly "what importing the
framework adds to a script that already imports torch". Contenders rotate every round (fresh
processes, warm page cache after the first round, which is discarded); medians are reported.
Children load bytecode from a cache (``PYTHONPYCACHEPREFIX``, see ``common.bench_env``) as after
a wheel install; one extra row shows anyaccel with its sources recompiled at every import.

* ``import anyaccel``                         the package (lazy: should load almost nothing)
* ``from anyaccel import Accelerator``        touching the façade (loads accelerator.py and its parts)
* ``import accelerate`` / ``from accelerate import Accelerator``
* ``from lightning.fabric import Fabric``     (``lightning/__init__`` also imports the Trainer)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

TARGET = "<= 50 ms"

_PROBE = """
import sys, time, json
import torch
t0 = time.perf_counter()
{stmt}
t1 = time.perf_counter()
print(json.dumps({{"s": t1 - t0, "modules": len(sys.modules)}}))
"""

CONTENDERS = {
    "import anyaccel": ("anyaccel", "import anyaccel"),
    "from anyaccel import Accelerator": ("anyaccel", "from anyaccel import Accelerator"),
    "from anyaccel import Accelerator, no bytecode": ("anyaccel", "from anyaccel import Accelerator"),
    "import accelerate": ("accelerate", "import accelerate"),
    "from accelerate import Accelerator": ("accelerate", "from accelerate import Accelerator"),
    "from lightning.fabric import Fabric": ("lightning", "from lightning.fabric import Fabric"),
}


def _probe(stmt: str, bytecode: bool = True) -> Dict[str, float]:
    env = common.bench_env(bytecode=bytecode)
    if not bytecode:  # sources compiled at every import (editable install + PYTHONDONTWRITEBYTECODE=1)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.pop("PYTHONPYCACHEPREFIX", None)
    proc = subprocess.run([common.PYTHON, "-c", _PROBE.format(stmt=stmt)], capture_output=True, text=True,
                          env=env, cwd=common.REPO, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> List[dict]:
    rows: List[dict] = []
    base = _probe("pass")  # modules loaded by `import torch` alone
    available = {}
    for label, (module, stmt) in CONTENDERS.items():
        if not common.have(module):
            rows.append(common.skip_row("import", label, module, f"{module} not installed"))
            continue
        try:
            _probe(stmt, bytecode="no bytecode" not in label)  # also fills the bytecode cache
            available[label] = stmt
        except Exception as exc:  # noqa: BLE001
            rows.append(common.skip_row("import", label, module, f"import failed: {exc}"[:200]))
    extra_modules: Dict[str, int] = {}

    def one(label: str, stmt: str):
        def f() -> float:
            r = _probe(stmt, bytecode="no bytecode" not in label)
            extra_modules[label] = int(r["modules"] - base["modules"])
            return r["s"]

        return f

    res = common.interleaved({k: one(k, s) for k, s in available.items()}, rounds=3 if quick else 11, warmup=1)
    for label in available:
        module = CONTENDERS[label][0]
        target = TARGET if label in ("import anyaccel", "from anyaccel import Accelerator") else None
        note = f"+{extra_modules[label]} modules"
        if "no bytecode" in label:
            note += "; sources recompiled at each import (editable install with PYTHONDONTWRITEBYTECODE=1)"
        rows.append(common.row("import", f"{label} (after import torch)", module, res[label]["median"] * 1e3, "ms",
                               target=target, note=note))
    return rows


if __name__ == "__main__":
    common.print_table(run(quick="--quick" in sys.argv))
