"""Worker of tests/cluster/test_hsdp_two_hosts.py: tests/strategies/nd/nd_checks.py's HSDP training
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
sys.argv = [str(script), out, "hsdp"]
done = runpy.run_path(str(script), run_name="__main__")
mesh = done["mesh"]
with open(os.path.join(out, f"host{done['accelerator'].process_index}.json"), "w") as f:
    json.dump({"host": socket.gethostname(), "dims": list(mesh.mesh_dim_names), "mesh": mesh.mesh.tolist()}, f)
