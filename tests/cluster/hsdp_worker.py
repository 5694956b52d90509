"""Worker of tests/cluster/test_hsdp_two_hosts.py: tests/strategies/nd/nd_checks.py's HSDP training (its ``check("hsdp")``)
(2 replicas x 2 shards, checked against the same training in one process), plus where this rank
ran: OUT/host<rank>.json with its host name and the device mesh (global ranks, rows = replicas,
columns = shards).

    anyaccel launch --num_machines 2 ... --num_processes 4 hsdp_worker.py OUT
"""

import json
import os
import runpy
import socket
import sys
from pathlib import Path

out = sys.argv[1]
script = Path(__file__).resolve().parents[1] / "strategies" / "nd" / "nd_checks.py"
checks = runpy.run_path(str(script))  # (not as __main__: its check() runs one layout, as test_nd's job does)
rank, result = checks["check"]("hsdp")
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
with open(os.path.join(out, f"host{rank}.json"), "w") as f:
    json.dump({"host": socket.gethostname(), "dims": result["mesh_dims"], "mesh": result["mesh_ranks"]}, f)
