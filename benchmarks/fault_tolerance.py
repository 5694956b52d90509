"""Per-step fault tolerance: what a step costs with torchft against plain DDP on the same processes,
and how many bytes a heal moves.

* **step time**: an MLP (256 → 1024 → 1024 → 10, batch 64 per process, AdamW) on 2 CPU processes,
  launched as ``anyaccel launch --num_processes 2`` (DDP) and as ``anyaccel launch
  --fault_tolerance on --num_processes 2`` (2 replica groups of 1 process); and on 4, as HSDP
  (``--parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 2``: FSDP2 in
  pairs, replicas across them, all in torch) and with ``--fault_tolerance on`` added (2 replica
  groups of 2 FSDP2 processes: torchft averages across the groups); the 4-process layout again with
  a GPT-2 of 4 blocks (transformers, width 128, 4 sequences of 128 tokens per process), which
  anyaccel's FSDP2 wraps per block (the model's ``_no_split_modules``), as it would a user's language
  model: a step about four times the MLP's, whose blocks' averages start during ``backward`` (the
  root unit, the embedding and head, is averaged last, as HSDP's), against which the same fixed cost
  per step weighs less (the MLP is one FSDP2 unit, averaged only once FSDP2's reduce-scatter at the
  end of ``backward`` is done: the fixed cost at its largest); and on 2, as plain FSDP2
  (``--parallelism_config_dp_shard_size 2``) and as **one** replica group of those 2 processes
  (told so by ``ANYACCEL_REPLICA_GROUP=0 ANYACCEL_REPLICA_GROUPS=1``, the SLURM path, with a
  Lighthouse this process serves: ``--fault_tolerance on`` starts 2 groups or more): every per-step
  piece of the protocol (the quorum through the Lighthouse, the boundary's healing state, the
  buckets, the group's vote) with a core per process on a 2-core machine, where the 2 x 2 layout
  puts 4 processes on 2 cores (the average is then over one group: no traffic between groups,
  which HSDP has as well); each pair of jobs alternating over ``ROUNDS`` rounds. Each job reports the median wall time of a loop iteration (fetch,
  forward, backward, step; the quorum included: it forms at the batch boundary) after a warm-up,
  on rank 0 / group 0, over iterations in which both groups took part (the group that starts
  first trains alone until the other heals in: those iterations are not counted). Ratio:
  fault-tolerant over DDP, per round, median. Where the extra time goes (fault tolerance, timed
  inside group 0's rank 0): the quorum's start at the batch boundary (the boundary's healing state
  taken, the request sent: torchft's asynchronous quorum), the wait for its answer at the step's
  first gradient bucket (what the forward pass did not hide), the gradient average's wait after
  ``backward``, the commit (a group of one process decides alone; the ranks of a larger group agree
  by one all-reduce of one integer over their own process group); and deterministic counts per
  step: buckets (and their bytes of gradients) started during ``backward`` out of all, bytes copied
  to flatten buckets; and the CPU seconds per step of rank 0 (every thread of the process) in both
  jobs, which a loaded machine distorts far less than wall time.
* **phases** of an iteration (:data:`PHASES`), medians on the reporting rank of both jobs: which part of
  the iteration the extra time falls in. And, not in the default set, ``--layouts 2x2-wait``: the 2 x 2
  MLP with a 30 ms wait an iteration between forward and ``backward`` that uses no core, as a GPU
  job's host waits for its device (an emulation, named so in its row): whether the extra time is the
  quorum's CPU, which such idle time absorbs, or waits on the step's path, which it does not.
* **heal bytes**: the healing state of that MLP with AdamW, serialised as the transfer does
  (``torch.save`` stream): a deterministic count, against the model's and the optimizer's tensor
  bytes.

Kill-to-commit and heal seconds come from the multi-process test
(``FT_FIGURES=out.json pytest tests/fault_tolerance/test_fault_tolerance_multiprocess.py``), as the cluster's
fault figures come from its tests.

    python -m benchmarks --only fault_tolerance [--quick]
    python benchmarks/fault_tolerance.py [--quick] [--rounds N]   # the same, alone
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

ROUNDS, STEPS, WARMUP, BATCH = 3, 60, 10, 64
#: an iteration's phases, timed on the reporting rank (medians over the measured iterations): the
#: batch fetched (the quorum's start at the boundary included), forward and loss, the layout's wait
#: (:class:`Layout`), ``accelerator.backward`` (the average over the groups included), ``optimizer.step()``
#: (the commit included), ``zero_grad``
PHASES = ("fetch", "forward", "wait", "backward", "step", "zero_grad")


def _model(kind: str = "mlp"):
    import torch

    torch.manual_seed(0)
    if kind == "gpt2":  # a language model in transformers' shape: FSDP2 makes each block a unit of its own
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()

        return GPT2LMHeadModel(GPT2Config(vocab_size=GPT2_VOCAB, n_positions=GPT2_SEQ, n_embd=128, n_layer=4,
                                          n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))


#: the layouts, each a pair of jobs on the same processes: ``flags`` for ``anyaccel launch`` (both
#: jobs), the ``model`` (:func:`_model`), the ``baseline`` job's name and the fault-tolerant job's
#: ``groups``; ``told``: the fault-tolerant job is one replica group told so by the environment
#: (``ANYACCEL_REPLICA_GROUP``/``ANYACCEL_REPLICA_GROUPS``, the SLURM path) and given a Lighthouse
#: this process serves (:func:`_job`), since ``--fault_tolerance on`` starts 2 groups or more.
#: 2 groups of 1 process (against DDP); 2 groups of 2 FSDP2 processes (against HSDP on the same 4
#: processes: FSDP2 within pairs, replicas across them, all in torch), with the MLP (one FSDP2
#: unit: the groups' average waits for the end of backward) or with a GPT-2 of 4 blocks (FSDP2 units
#: per block, as anyaccel wraps a transformers model: each block's average starts during backward,
#: the root unit's last; needs transformers, else the layout is skipped); and 1 group of 2 FSDP2
#: processes (against FSDP2 on the same 2): every per-step piece of the protocol (the quorum through
#: the Lighthouse, the boundary's healing state, the average's buckets, the group's vote) with a core
#: per process on a 2-core machine, the average itself over one group only: what the 2 x 2 layout
#: costs once its 4 processes no longer share 2 cores, apart from the traffic between groups, which
#: HSDP has too.
#: ``wait_ms``: each iteration's main thread also waits that long between forward and ``backward``
#: without using a core (a sleep), as a GPU job's host waits for the device's kernels: the layout
#: ``2x2-wait`` asks whether the 2 x 2 MLP's extra CPU (torchft's quorum threads, above all) still
#: lengthens the step once the cores have idle time, which a GPU job's host has and this CPU
#: benchmark's does not. An emulation, named so in its row, not a GPU measurement.
class Layout(NamedTuple):
    flags: List[str]
    model: str
    baseline: str
    groups: str
    told: bool = False
    wait_ms: float = 0.0


_HSDP_2X2 = ["--num_processes", "4", "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2"]
LAYOUTS = {
    "2x1": Layout(["--num_processes", "2"], "mlp", "DDP (2 processes)", "2 replica groups"),
    "2x2": Layout(_HSDP_2X2, "mlp", "HSDP (2 x 2 FSDP2, 4 processes)", "2 replica groups x 2 FSDP2 processes"),
    "2x2-gpt2": Layout(_HSDP_2X2, "gpt2", "HSDP (2 x 2 FSDP2, 4 processes)",
                       "2 replica groups x 2 FSDP2 processes, an FSDP2 unit per block"),
    "2x2-wait": Layout(_HSDP_2X2, "mlp", "HSDP (2 x 2 FSDP2, 4 processes)",
                       "2 replica groups x 2 FSDP2 processes", wait_ms=30.0),
    "1x2": Layout(["--num_processes", "2", "--parallelism_config_dp_shard_size", "2"], "mlp", "FSDP2 (2 processes)",
                  "1 replica group x 2 FSDP2 processes: the protocol's fixed cost, a core per process", told=True),
}
DEFAULT_LAYOUTS = "2x1,2x2,2x2-gpt2,1x2"
#: the GPT-2's tokens: batches of GPT2_BATCH sequences of GPT2_SEQ per process
GPT2_VOCAB, GPT2_SEQ, GPT2_BATCH = 4096, 128, 4


def _job(mode: str, steps: int, warmup: int, layout: str = "2x1") -> Dict:
    spec = LAYOUTS[layout]
    lighthouse = None
    extra: Dict[str, str] = {}
    flags = ["--fault_tolerance", "on"] if mode == "ft" else []
    if mode == "ft" and spec.told:  # one group, told so, with a Lighthouse served here (Layout)
        from anyaccel.fault_tolerance.lighthouse import Lighthouse

        before = os.environ.get("RUST_LOG")
        os.environ["RUST_LOG"] = before or "error"  # (read as torchft's extension loads: its Lighthouse logs each quorum)
        try:
            lighthouse = Lighthouse(min_replicas=1)
        finally:  # (not left to the later benchmarks' children)
            if before is None:
                del os.environ["RUST_LOG"]
        flags = ["--fault_tolerance", lighthouse.address]
        extra = {"ANYACCEL_REPLICA_GROUP": "0", "ANYACCEL_REPLICA_GROUPS": "1"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, "-m", "anyaccel.cli", "launch", "--cpu", *spec.flags, *flags,
                   os.path.abspath(__file__), "--worker", mode, "--model", spec.model, "--steps", str(steps),
                   "--warmup", str(warmup), "--out", out, "--wait_ms", str(spec.wait_ms)]
            # (cwd: the job's own files, the replica groups' project_dir among them, stay in the temporary directory)
            proc = subprocess.run(cmd, env=common.bench_env(extra=extra), capture_output=True, text=True, timeout=900,
                                  cwd=tmp)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode} job failed ({proc.returncode}): {proc.stderr[-3000:]}")
            with open(out) as fh:
                return json.load(fh)
    finally:
        if lighthouse is not None:
            lighthouse.close()


def heal_bytes() -> Dict[str, int]:
    """The serialised healing state of the benchmark's MLP + AdamW after one step (what a heal
    transfers), and the tensors' own bytes."""
    import torch

    from anyaccel import Accelerator
    from anyaccel.fault_tolerance.healing import HealingState

    acc = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(BATCH, 256)).sum())
    opt.step()
    buffer = io.BytesIO()
    torch.save(HealingState(acc._training_state, exclude=[]).state_dict(), buffer)
    tensors = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights, exp_avg, exp_avg_sq
    return {"serialised": buffer.tell(), "tensors": tensors}


def _pair(layout: str, rounds: int, steps: int, name: str) -> List[dict]:
    """The rows of one layout: the plain job and the fault-tolerant one, alternating over rounds."""
    baseline = LAYOUTS[layout].baseline
    results: Dict[str, List[Dict]] = {"ddp": [], "ft": []}
    for r in range(rounds):
        for mode in (("ddp", "ft") if r % 2 == 0 else ("ft", "ddp")):
            results[mode].append(_job(mode, steps, WARMUP, layout))
    ratios = [f["step_s"] / d["step_s"] for f, d in zip(results["ft"], results["ddp"])]
    cpu = {mode: statistics.median(r["parts"]["cpu"] for r in results[mode]) for mode in results}
    plain = statistics.median(d["step_s"] for d in results["ddp"])
    ft = statistics.median(f["step_s"] for f in results["ft"])
    parts = {k: statistics.median(f["parts"].get(k, 0.0) for f in results["ft"])
             for k in ("quorum", "wait", "average", "commit", "early", "buckets", "copied", "early_bytes")}
    load = statistics.median(r["load"] for r in results["ft"] + results["ddp"])
    phases = {mode: {k: statistics.median(r["phases"][k] for r in results[mode]) for k in PHASES} for mode in results}
    phase_note = ", ".join(f"{k} {phases['ddp'][k] * 1e3:.1f} → {phases['ft'][k] * 1e3:.1f}" for k in PHASES
                           if k != "wait" or LAYOUTS[layout].wait_ms)
    groups = LAYOUTS[layout].groups
    return [
        common.row("fault_tolerance", name, baseline, plain * 1e3, "ms"),
        common.row("fault_tolerance", name, f"fault tolerance ({groups})", ft * 1e3, "ms",
                   ratio=statistics.median(ratios), baseline=baseline, target="<= 1.05",
                   note=(f"per step: quorum started {parts['quorum'] * 1e3:.1f} ms (the boundary's state taken, "
                         f"the request sent), its answer awaited {parts['wait'] * 1e3:.1f} ms, gradient average "
                         f"after backward {parts['average'] * 1e3:.1f} ms ({parts['early']:.0f} of "
                         f"{parts['buckets']:.0f} buckets, {parts['early_bytes']:,.0f} bytes of gradients, started "
                         f"during backward; {parts['copied']:,.0f} bytes flattened), commit {parts['commit'] * 1e3:.1f} ms "
                         f"({results['ft'][0]['votes']}); CPU per step (rank 0, every thread, load-proof) "
                         f"{cpu['ft'] * 1e3:.1f} ms against {cpu['ddp'] * 1e3:.1f} ms ({cpu['ft'] / cpu['ddp']:.2f}x); phases (ms, "
                         f"{baseline.split(' (')[0]} → fault tolerance, medians): {phase_note}; rounds: {', '.join(f'{x:.2f}' for x in ratios)}; load average {load:.1f}")),
    ]


def run(quick: bool = False, rounds: int = 0, layouts: str = DEFAULT_LAYOUTS) -> List[dict]:
    """Rows for ``python -m benchmarks`` (2 x ROUNDS launched jobs per layout, then the byte count);
    ``rounds``: that many rounds instead (of ``--quick``'s 15 iterations when ``quick``); ``layouts``:
    which of :data:`LAYOUTS` (comma-separated)."""
    rounds, steps = (rounds or 1, 15) if quick else (rounds or ROUNDS, STEPS)
    name = f"MLP 256-1024-1024-10 + AdamW, batch {BATCH} per process: loop iteration (median of {steps})"
    chosen = layouts.split(",")
    unknown = [x for x in chosen if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts {layouts!r}: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    rows: List[dict] = []
    if "2x1" in chosen:
        rows += _pair("2x1", rounds, steps, name + ", 2 processes")
    if "2x2" in chosen:
        rows += _pair("2x2", rounds, steps, name + ", 4 processes")
    if "2x2-gpt2" in chosen and not common.have("transformers"):
        print("fault_tolerance: layout 2x2-gpt2 skipped: transformers is not installed (pip install transformers)",
              file=sys.stderr)
    elif "2x2-gpt2" in chosen:
        gpt2 = (f"GPT-2 (4 blocks of width 128, vocabulary {GPT2_VOCAB}) + AdamW, {GPT2_BATCH} sequences of {GPT2_SEQ} "
                f"tokens per process: loop iteration (median of {steps}), 4 processes")
        rows += _pair("2x2-gpt2", rounds, steps, gpt2)
    if "2x2-wait" in chosen:
        rows += _pair("2x2-wait", rounds, steps, name + f", 4 processes, and a wait of {LAYOUTS['2x2-wait'].wait_ms:g} "
                      "ms an iteration that uses no core (emulating a GPU job's host waiting for its device)")
    if "1x2" in chosen:
        rows += _pair("1x2", rounds, steps, name + ", 2 processes in one group")
    counted = heal_bytes()
    rows.append(common.row("fault_tolerance", "healing state of that MLP + AdamW (serialised, what a heal moves)",
                           "anyaccel", counted["serialised"], "bytes",
                           note=f"tensors {counted['tensors']:,} bytes (weights and Adam's two moments)"))
    return rows


# ---- the worker (under anyaccel launch) --------------------------------------------------------------


def _timed(obj, name: str, total: Dict[str, float], key: str) -> None:
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            total[key] += time.perf_counter() - start

    setattr(obj, name, wrapper)


def worker(mode: str, steps: int, warmup: int, out: str, kind: str = "mlp", wait_ms: float = 0.0) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from anyaccel import Accelerator

    torch.set_num_threads(1)
    acc = Accelerator()
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    if kind == "gpt2":  # twice the batches measured (a group that starts first trains alone until the other heals in)
        n = 2 * (steps + warmup) * GPT2_BATCH * 4
        data = TensorDataset(torch.randint(0, GPT2_VOCAB, (n, GPT2_SEQ), generator=generator))
        batch = GPT2_BATCH
    else:
        n = 3 * (steps + warmup) * BATCH * 4  # up to 4 processes; a group that starts first trains alone until the other heals in
        data = TensorDataset(torch.randn(n, 256, generator=generator), torch.randint(0, 10, (n,)))
        batch = BATCH
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=batch))
    replica = acc._replica
    parts = {"quorum": 0.0, "wait": 0.0, "average": 0.0, "commit": 0.0, "early": 0.0, "buckets": 0.0,
             "copied": 0.0, "early_bytes": 0.0, "cpu": time.process_time()}
    if replica is not None:
        acc.resume()
        _timed(replica, "begin_step", parts, "quorum")  # (the loader's boundary looks it up at each call)
        _timed(replica, "_settle", parts, "wait")  # the quorum's answer awaited (asynchronous: at the first bucket)
        _timed(replica, "average_gradients", parts, "average")
        _timed(opt, "commit", parts, "commit")  # the optimizer holds the replica's commit
    times: List[float] = []
    phases: Dict[str, List[float]] = {k: [] for k in PHASES}  # per measured iteration, seconds
    marks: List[float] = []
    at_warmup = at_end = dict(parts)
    last = time.perf_counter()
    together = 0  # iterations with every group in the quorum (fault tolerance; DDP: all of them)
    for batch_ in loader:
        marks[:] = [last, time.perf_counter()]  # the iteration's start, the batch fetched
        if kind == "gpt2":
            loss = model(input_ids=batch_[0], labels=batch_[0]).loss
        else:
            loss = torch.nn.functional.cross_entropy(model(batch_[0]), batch_[1])
        marks.append(time.perf_counter())
        if wait_ms:  # (Layout.wait_ms) the host waiting for a device, no core used
            time.sleep(wait_ms / 1e3)
        marks.append(time.perf_counter())
        acc.backward(loss)
        marks.append(time.perf_counter())
        if replica is not None and replica._average is not None:  # deterministic counts of the step
            parts["early"] += replica._average.started_early
            parts["buckets"] += replica._average.bucket_count
            parts["copied"] += replica._average.copied_bytes
            parts["early_bytes"] += replica._average.early_bytes
        opt.step()
        marks.append(time.perf_counter())
        opt.zero_grad()
        now = time.perf_counter()
        marks.append(now)
        parts["cpu"] = time.process_time()  # this process's CPU seconds so far, every thread (a running total)
        if replica is None or replica.participants == replica.settings.groups:
            together += 1
            if together > warmup and len(times) < steps:
                times.append(now - last)
                for name, (a, b) in zip(PHASES, zip(marks, marks[1:])):
                    phases[name].append(b - a)
                if len(times) == steps:
                    at_end = dict(parts)
            elif together == warmup:
                at_warmup = dict(parts)
        elif replica is not None:  # a group that starts first trains alone until the other heals in: slowly,
            time.sleep(0.2)  # so that it does not use up the loader's batches (those iterations are not measured)
            now = time.perf_counter()
        last = now
    short = len(times) < steps  # (the loader ran out before the groups trained together long enough)
    if acc.process_index == 0 and (replica is None or replica.settings.group == 0) and not short:
        measured = len(times)
        with open(out, "w") as fh:
            json.dump({"step_s": statistics.median(times), "measured": len(times),
                       "phases": {k: statistics.median(v) for k, v in phases.items()},
                       "parts": {k: (at_end[k] - at_warmup[k]) / measured for k in parts},
                       "votes": "decided alone" if replica is None or acc.num_processes == 1 else
                       "one all-reduce of the votes over the group",
                       "load": os.getloadavg()[0]}, fh)
    acc.end_training()
    if short:
        raise SystemExit(f"fault_tolerance worker: only {len(times)} of {steps} iterations with every group together "
                         f"after a warm-up of {warmup}: give the loader more batches")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("ddp", "ft"))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--out")
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    parser.add_argument("--wait_ms", type=float, default=0.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of each pair of jobs (default: 1 quick, 3 full)")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"which layouts, comma-separated (default: {DEFAULT_LAYOUTS})")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out, args.model, args.wait_ms)
    else:
        common.print_table(run(args.quick, args.rounds, args.layouts))
