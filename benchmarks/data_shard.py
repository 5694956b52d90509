"""Sharded DataLoader iteration throughput, one process acting as rank 0 of 2 (no process group).

* ``raw``        ``DataLoader(ds, batch_size, sampler=DistributedSampler(ds, num_replicas=2, rank=0))``
* ``anyaccel``   ``anyaccel.data.prepare_data_loader(DataLoader(ds, batch_size, shuffle=True), cpu, 2, 0)``
* ``accelerate`` ``accelerate.data_loader.prepare_data_loader(..., num_processes=2, process_index=0)``

Two measurements: batches/s over whole epochs of a 32k-sample TensorDataset (batch 64), and the
time to the first batch of an epoch over a 2M-sample dataset (the per-epoch cost of computing
the shuffled shard: anyaccel plans the whole epoch up front, DistributedSampler slices a
permutation). CPU time of the process, medians of rotating rounds.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402


class _Indices:
    """A map-style dataset whose items cost nothing: isolates the sampler/sharding cost."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loaders(ds, batch: int, collate=None) -> Dict[str, object]:
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from anyaccel.data import prepare_data_loader

    kw = {} if collate is None else {"collate_fn": collate}
    out: Dict[str, object] = {
        "raw": DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds, num_replicas=2, rank=0, seed=0), **kw),
        "anyaccel": prepare_data_loader(DataLoader(ds, batch_size=batch, shuffle=True, **kw),
                                        torch.device("cpu"), 2, 0),
    }
    if common.have("accelerate"):
        try:
            from accelerate.data_loader import prepare_data_loader as hf_prepare

            out["accelerate"] = hf_prepare(DataLoader(ds, batch_size=batch, shuffle=True, **kw),
                                           torch.device("cpu"), num_processes=2, process_index=0)
        except Exception as exc:  # noqa: BLE001
            out["accelerate"] = exc
    return out


def _epoch_fn(loader) -> Callable[[], int]:
    sampler = getattr(loader, "sampler", None)
    set_epoch = getattr(sampler, "set_epoch", None) if type(sampler).__name__ == "DistributedSampler" else None
    state = {"epoch": 0}

    def one_epoch() -> int:
        if set_epoch is not None:
            set_epoch(state["epoch"])
        state["epoch"] += 1
        n = 0
        for _ in loader:
            n += 1
        return n

    return one_epoch


def _first_batch_fn(loader) -> Callable[[], None]:
    def first() -> None:
        it = iter(loader)
        next(it)
        del it

    return first


def run(quick: bool = False) -> List[dict]:
    import torch
    from torch.utils.data import TensorDataset

    torch.set_num_threads(1)
    rows: List[dict] = []
    g = torch.Generator().manual_seed(0)
    n = 32_768
    ds = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    loaders = _loaders(ds, 64)
    errors = {k: v for k, v in loaders.items() if isinstance(v, Exception)}
    loaders = {k: v for k, v in loaders.items() if not isinstance(v, Exception)}
    name = "sharded loader, 32k x 32 floats, batch 64, rank 0 of 2"
    counts = {}

    def timed(loader):
        fn = _epoch_fn(loader)

        def one() -> float:
            c0 = time.process_time()
            k = fn()
            counts[id(loader)] = k
            return k / max(time.process_time() - c0, 1e-9)  # batches per CPU-second

        return one

    res = common.interleaved({k: timed(v) for k, v in loaders.items()}, rounds=3 if quick else 15, warmup=1,
                             baseline="raw")
    for k, r in res.items():
        batches = counts[id(loaders[k])]
        rows.append(common.row("data", name, k, r["median"], "batches/s",
                               ratio=None if k == "raw" else r["ratio"], baseline=None if k == "raw" else "raw",
                               target=">= 0.99" if k == "anyaccel" else None,
                               note="; ".join(x for x in (f"{batches} batches/epoch", "" if k == "raw" else common.ci_text(r["ratio_ci"])) if x)))
    for k, e in errors.items():
        rows.append(common.skip_row("data", name, k, f"set-up failed: {e!r}"[:200]))

    # Epoch start: time to the first batch over a large dataset (sharding plan cost).
    big = _Indices(2_000_000)
    collate = lambda items: items  # noqa: E731 - keep collation out of the measurement
    loaders = {k: v for k, v in _loaders(big, 64, collate).items() if not isinstance(v, Exception)}
    name = "epoch start (first batch), 2M samples, rank 0 of 2"
    res = common.interleaved({k: (lambda f=_first_batch_fn(v): _cpu(f)) for k, v in loaders.items()},
                             rounds=3 if quick else 11, warmup=1, baseline="raw")
    for k, r in res.items():
        rows.append(common.row("data", name, k, r["median"] * 1e3, "ms (CPU)",
                               ratio=None if k == "raw" else r["ratio"], baseline=None if k == "raw" else "raw",
                               target="<= 1.0" if k == "anyaccel" else None,
                               note="" if k == "raw" else common.ci_text(r["ratio_ci"])))
    return rows


def _cpu(fn: Callable[[], None]) -> float:
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


if __name__ == "__main__":
    common.print_table(run(quick="--quick" in sys.argv))
