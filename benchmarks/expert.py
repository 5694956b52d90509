"""Expert-parallel benchmark (``expert``), as result rows: the ep step through the ``Accelerator``
against the same thing written by hand after torchtitan, and what each rank holds and moves.

* step: 2 CPU processes on gloo, ep over both (each holds half the experts of every MoE block):
  ``Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, ep_size=2))`` (``prepare``,
  ``accelerator.backward``: anyaccel's all-to-all dispatcher, FSDP2 over the experts' and the
  other parameters' meshes) vs a hand-written torchtitan-style ``AllToAllTokenDispatcher`` +
  ``GroupedExperts`` with ``fully_shard`` as torchtitan applies it under ep; same model, weights,
  batches and AdamW; rounds alternating in one job; target <= 1.02. A second hand-written copy
  gives the noise floor.
* proof: the first loss of each on the same weights and batch; the bytes each all-to-all handed
  to the other rank in one step against the theory for the routing seen (pairs whose expert is on
  the other rank, out and back, forward and backward, ``hidden x 4`` bytes a row); expert parameters
  and AdamW state per rank against the whole (1/ep); tokens per expert summed over the ranks.

CPU only::

    python -m benchmarks --only expert [--quick]
    python benchmarks/expert.py [--quick]
"""

from __future__ import annotations

import os
import sys
from typing import List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expert_worker.py")
HAND = "hand-written (torchtitan-style)"
OURS = "anyaccel ep (Accelerator)"


def run(quick: bool = False) -> List[dict]:
    flag = ["--quick"] if quick else []
    try:
        res = common.run_torchrun_json(WORKER, flag, timeout=1500, nproc=2)
    except RuntimeError as exc:
        return [common.skip_row("expert", "ep step, 2 procs", OURS, f"failed: {exc}"[:300], target="<= 1.02")]
    return _step_rows(res) + _proof_rows(res)


def _model(res: dict) -> str:
    s = res["sizes"]
    return (f"{s['layers']} MoE blocks x {s['experts']} SwiGLU experts ({s['hidden']} -> {s['intermediate']}), "
            f"top-{s['top_k']}, {s['tokens']} tokens per rank")


def _step_rows(res: dict) -> List[dict]:
    losses = res["proof"]["first loss"]
    name = f"ep x FSDP2 step + AdamW, ep {res['world']}, {res['world']} CPU procs, {_model(res)}"
    notes = {HAND: f"first loss {losses[HAND]:.6f}", OURS: common.first_loss_note(losses, HAND, OURS)}
    return (common.wall_rows("expert", name, res["step"], HAND, OURS, notes)
            + common.cpu_rows("expert", "same step, CPU time of all ranks and Python calls (rank 0)", res["step"],
                              res["calls"], HAND))


def _proof_rows(res: dict) -> List[dict]:
    proof, rows = res["proof"], []
    for contender in (HAND, OURS):
        moved, theory = proof["bytes"][contender], proof["theory"][contender]
        rows.append(common.row(
            "expert", "all-to-all bytes handed to other ranks in one step (largest rank) vs the routing's theory",
            contender, max(moved) / 1024, "KiB", ratio=max(moved) / max(theory) if max(theory) else None,
            baseline="theory", note=f"per rank {moved} B; theory {theory} B "
                                    f"({'equal' if moved == theory else 'DIFFERENT'})"))
    for contender in (HAND, OURS):
        held = proof["expert bytes"][contender]
        note = f"AdamW state for them {held['optimizer'] / 2**20:.2f} MiB per rank"
        if contender == OURS:
            note += f"; tokens per expert (block 0, all ranks): {proof.get('tokens per expert (block 0, all ranks)')}"
        rows.append(common.row("expert", "expert parameters per rank vs the whole model's experts", contender,
                               held["params"] / 2**20, "MiB", ratio=held["params"] / held["full"],
                               baseline="all experts", note=note))
    return rows


if __name__ == "__main__":
    common.print_table(run("--quick" in sys.argv))
