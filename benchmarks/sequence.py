"""Sequence-parallelism benchmark (``sequence``), as result rows: Ulysses through anyaccel against
the same thing written by hand, and the activation memory per rank with and without it.

* step: 2 CPU processes on gloo, ``ParallelismConfig(sp_size=2)`` vs a hand-written Ulysses loop
  (an all-to-all attention function registered with transformers, ``fully_shard`` by hand, the
  batch cut and the loss combined by hand; same model — a transformers Llama from a config —,
  same AdamW, same batches), rounds alternating in one job; target <= 1.02. A second hand-written
  loop gives the noise floor. The notes carry the proof that both did what is timed: their first
  losses on the same weights and batch, the local batch each rank's model saw, the attention
  function each config names.
* memory: the measured resident-set peak of a warm training step above what the step starts with
  (kernel high-water mark, reset before the step), per rank: one process holding the whole
  sequence vs each of 2 sp ranks holding half of it, at a length where activations dominate (the
  parameters are a few MiB). The bytes autograd saved for backward are in the note.

With a GPU the same jobs would need NCCL and CUDA memory counters: not implemented (CPU only)::

    python -m benchmarks --only sequence [--quick]
    python benchmarks/sequence.py [--quick]
"""

from __future__ import annotations

import os
import sys
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sequence_worker.py")
HAND = "hand-written Ulysses"
# large tensors mmapped: a freed activation leaves the resident set (what the peak is measured against)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def _mib(n: float) -> float:
    return n / 2**20


def run(quick: bool = False) -> List[dict]:
    if not common.have("transformers"):
        return [common.skip_row("sequence", "Ulysses step, 2 procs", "anyaccel sp", "transformers is not installed",
                                target="<= 1.02")]
    flag = ["--quick"] if quick else []
    rows = []
    try:
        res = common.run_torchrun_json(WORKER, ["--mode", "step", *flag], timeout=1500, nproc=2)
    except RuntimeError as exc:
        rows.append(common.skip_row("sequence", "Ulysses step, 2 procs", "anyaccel sp", f"failed: {exc}"[:300],
                                    target="<= 1.02"))
    else:
        rows += _step_rows(res)
    try:
        one = common.run_torchrun_json(WORKER, ["--mode", "memory", *flag], timeout=1500, nproc=1, env=MALLOC)
        two = common.run_torchrun_json(WORKER, ["--mode", "memory", *flag], timeout=1500, nproc=2, env=MALLOC)
    except RuntimeError as exc:
        rows.append(common.skip_row("sequence", "activation memory per rank", "anyaccel sp", f"failed: {exc}"[:300]))
    else:
        rows += _memory_rows(one, two)
    return rows


def _step_rows(res: dict) -> List[dict]:
    s, proof = res["sizes"], res["proof"]
    model = (f"Llama {s['layers']} x {s['hidden']} ({s['heads']} heads), {s['batch']} x {s['seq']} tokens, "
             f"vocab {s['vocab']}")
    losses = proof["first loss"]
    print(f"mesh (anyaccel): {proof['anyaccel mesh']}")
    for who in (HAND, "anyaccel sp"):
        print(f"{who}: first loss {losses[who]!r}, local batch {proof['local batch'][who]}, "
              f"attention {proof['attention'][who]}")
    name = f"Ulysses step + AdamW, sp 2, {res['world']} CPU procs, {model}"
    seen = {who: f"local batch {proof['local batch'].get(who.rstrip(chr(39)))}" for who in res["step"]}
    notes = {HAND: f"{seen[HAND]}; first loss {losses[HAND]:.6f}", HAND + "'": "",
             "anyaccel sp": f"{seen['anyaccel sp']}; attention {proof['attention']['anyaccel sp']}; "
                            + common.first_loss_note(losses, HAND, "anyaccel sp")}
    return (common.wall_rows("sequence", name, res["step"], HAND, "anyaccel sp", notes)
            + common.cpu_rows("sequence", "same step, CPU time of all ranks and Python calls (rank 0)", res["step"],
                              res["calls"], HAND))


def _memory_rows(one: dict, two: dict) -> List[dict]:
    s = one["sizes"]
    name = (f"activation memory per rank: measured RSS peak of a step above its start, Llama {s['layers']} x "
            f"{s['hidden']}, {s['batch']} x {s['seq']} tokens")
    base = one["ranks"][0]
    rows = [common.row("sequence", name, "1 process, whole sequence", _mib(base["peak"]), "MiB",
                       note=f"saved for backward {_mib(base['saved']):.1f} MiB; {base['local_length']} tokens per "
                            f"rank; parameters {_mib(base['params']):.1f} MiB")]
    worst = max(r["peak"] for r in two["ranks"])
    peaks = ", ".join(f"{_mib(r['peak']):.1f}" for r in two["ranks"])
    saved = ", ".join(f"{_mib(r['saved']):.1f}" for r in two["ranks"])
    rows.append(common.row(
        "sequence", name, "anyaccel sp 2 (largest rank)", _mib(worst), "MiB", ratio=worst / base["peak"],
        baseline="1 process, whole sequence",
        note=f"per rank {peaks} MiB; saved for backward {saved} MiB; {two['ranks'][0]['local_length']} tokens per "
             "rank"))
    return rows


if __name__ == "__main__":
    common.print_table(run("--quick" in sys.argv))
