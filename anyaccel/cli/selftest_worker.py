"""The checks of ``anyaccel test``, run inside every worker of a short real job.

``anyaccel test`` (:mod:`anyaccel.selftest`) starts this module through the same launcher as
``anyaccel launch``: ``anyaccel launch -m anyaccel.cli.selftest_worker --out DIR --expect ...``. Every
rank runs the same checks in the same order, so the collectives they make line up; a check that
fails on one rank still makes all of its collectives before it reports, and the next check runs.
Each rank writes its results to ``DIR/rank<N>.json`` after every check (a crash or a timeout
leaves what was already found); the launcher merges the ranks' files into one line per check.

A result is ``pass``, ``fail`` or ``skip`` with one line of detail. Nothing here prints to stdout
(``anyaccel test --json`` owns it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

from ..backends import config_device, transport_for
from ..environment.detectors import Topology, detect_topology

__all__ = ["CHECKS", "CheckFailed", "expect", "main"]

# (name shown to the user, function name below); the order is the order of the lines printed
CHECKS = (
    ("process group formed", "check_group"),
    ("device placement", "check_device"),
    ("gather", "check_gather"),
    ("gather_object", "check_gather_object"),
    ("reduce", "check_reduce"),
    ("broadcast", "check_broadcast"),
    ("pad_across_processes", "check_pad"),
    ("barrier", "check_barrier"),
    ("mixed precision", "check_precision"),
    ("training steps agree across ranks", "check_training"),
    ("save_state / load_state round trip", "check_checkpoint"),
    ("hang doctor: mismatched collectives", "check_mismatch"),  # last: it provokes an error on purpose
)


class Skip(Exception):
    """The check does not apply to this job (e.g. one process); the message says why."""


class CheckFailed(AssertionError):
    """A check's expectation did not hold; the message says what was found and what was expected."""


def expect(condition: Any, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds. An explicit test,
    not an ``assert`` statement: ``python -O`` removes those, and every check would report ✓."""
    if not condition:
        raise CheckFailed(message)


class Recorder:
    """This rank's results, rewritten to ``DIR/rank<N>.json`` after every check."""

    def __init__(self, out_dir: str, rank: int):
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.rank = rank
        self.results: List[Dict[str, Any]] = []
        self.done = False

    def add(self, name: str, status: str, detail: str, seconds: float) -> None:
        self.results.append({"name": name, "status": status, "detail": detail, "seconds": round(seconds, 3)})
        self.flush()

    def flush(self) -> None:
        from ..fileio import atomic_write_text

        atomic_write_text(self.path, json.dumps({"rank": self.rank, "done": self.done, "checks": self.results}))


class Checks:
    """The job's checks; each ``check_*`` returns a one-line detail or raises (:class:`CheckFailed`:
    a failed expectation; :class:`Skip`: not applicable)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.accelerator: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        self.loader: Any = None

    # -- helpers -------------------------------------------------------------------------------
    @property
    def acc(self) -> Any:
        if self.accelerator is None:
            raise CheckFailed("no Accelerator: the process group check failed")
        return self.accelerator

    def _vector(self, value: float, n: int = 3) -> torch.Tensor:
        return torch.full((n,), float(value), device=self.acc.device)

    # -- the checks ----------------------------------------------------------------------------
    def check_group(self) -> str:
        from ..accelerator import Accelerator

        self.accelerator = acc = Accelerator()
        world = acc.num_processes
        expected = self.args.expect_world
        expect(world == expected, f"{world} process(es) in the group, expected {expected}")
        ranks = acc.gather_object(acc.process_index)
        expect(ranks == list(range(world)), f"ranks {ranks}, expected 0..{world - 1}")
        backend = acc.environment.backend if world > 1 else "none (one process)"
        return f"{world} process{'es' if world != 1 else ''}, ranks 0..{world - 1}, backend {backend}"

    def check_device(self) -> str:
        acc = self.acc
        device = torch.device(acc.device)
        want = self.args.expect_device
        facts = config_device(want)  # the device the plan named (None: auto, decided at launch)
        if facts is not None:
            expect(device.type == facts.device_type, f"device {device}, expected {facts.device_type} ({facts.name})")
            local = acc.local_process_index
            if facts.indexed and self.args.gpus_per_machine and self.args.gpus_per_machine >= self.args.nproc_per_node:
                expect(device.index == local, f"local rank {local} is on {device}, expected {facts.device_type}:{local}")
        t = torch.ones(2, device=device)
        devices = acc.gather_object(str(device))
        return f"rank→device: {', '.join(f'{r}:{d}' for r, d in enumerate(devices))}; tensor on {t.device}"

    def check_gather(self) -> str:
        acc = self.acc
        got = acc.gather(self._vector(acc.process_index, 2))
        want = torch.arange(acc.num_processes, dtype=torch.float32).repeat_interleave(2)
        expect(torch.equal(got.cpu(), want), f"got {got.tolist()}, expected {want.tolist()}")
        return f"{acc.num_processes}×2 values in rank order"

    def check_gather_object(self) -> str:
        acc = self.acc
        got = acc.gather_object({"rank": acc.process_index, "t": self._vector(acc.process_index, 1)})
        ranks = [g["rank"] for g in got]
        expect(ranks == list(range(acc.num_processes)), f"got ranks {ranks}, expected 0..{acc.num_processes - 1}")
        values = [float(g["t"].cpu()) for g in got]
        expect(values == [float(r) for r in range(acc.num_processes)], f"got tensor values {values}")
        mine = torch.device(acc.device)
        if not transport_for(mine.type).objects_keep_device:  # XLA's hand tensors back on the CPU
            return "one object per rank"
        elsewhere = [str(g["t"].device) for g in got if g["t"].device != mine]
        expect(not elsewhere, f"tensors from other ranks arrived on {elsewhere}, not on this rank's {mine}")
        return f"one object per rank; their {mine.type} tensors arrive on this rank's device"

    def check_reduce(self) -> str:
        acc = self.acc
        n = acc.num_processes
        total = acc.reduce(self._vector(acc.process_index + 1), "sum")
        mean = acc.reduce(self._vector(acc.process_index + 1), "mean")
        want = n * (n + 1) / 2
        expect(torch.allclose(total.cpu(), torch.full((3,), want)), f"sum {total.tolist()}, expected {want}")
        expect(torch.allclose(mean.cpu(), torch.full((3,), want / n)), f"mean {mean.tolist()}, expected {want / n}")
        return f"sum {want:g}, mean {want / n:g}"

    def check_broadcast(self) -> str:
        acc = self.acc
        got = acc.broadcast(self._vector(100 + acc.process_index), from_process=0)
        expect(torch.equal(got.cpu(), torch.full((3,), 100.0)), f"got {got.tolist()}, expected rank 0's 100s")
        return "rank 0's values on every rank"

    def check_pad(self) -> str:
        acc = self.acc
        n = acc.num_processes
        mine = torch.ones(acc.process_index + 1, 2, device=acc.device)
        padded = acc.pad_across_processes(mine, dim=0, pad_index=-1)
        expect(tuple(padded.shape) == (n, 2), f"shape {tuple(padded.shape)}, expected {(n, 2)}")
        expect(int((padded[:, 0] == 1).sum()) == acc.process_index + 1, f"padding overwrote data: {padded.tolist()}")
        return f"rows 1..{n} padded to {n}"

    def check_barrier(self) -> str:
        acc = self.acc
        t0 = time.perf_counter()
        acc.wait_for_everyone()
        return f"all ranks arrived ({(time.perf_counter() - t0) * 1000:.1f} ms)"

    def _build(self) -> None:
        if self.model is not None:
            return
        acc = self.acc
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(256, 16, generator=g)
        y = x @ torch.randn(16, 1, generator=g) / 4
        data = torch.utils.data.TensorDataset(x, y)
        layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)]
        if acc.mixed_precision == "fp8":  # a middle layer to convert (the first and the last stay in high precision)
            layers[2:2] = [torch.nn.Linear(32, 32), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
        self.model, self.optimizer, self.loader = acc.prepare(model, optimizer, loader)

    def _steps(self, n: int) -> List[float]:
        acc, losses = self.acc, []
        for i, (x, y) in enumerate(self.loader):
            if i == n:
                break
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y.float())
            acc.backward(loss)
            self.optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def _checksum(self) -> float:
        state = self.acc.get_state_dict(self.model)
        return float(sum(v.detach().double().sum().item() for v in state.values())) if state else float("nan")

    def check_precision(self) -> str:
        from ..precision import autocast_dtype

        acc = self.acc
        want = self.args.expect_precision
        expect(acc.mixed_precision == want, f"Accelerator runs mixed precision {acc.mixed_precision!r}, expected {want!r}")
        self._build()
        seen: Dict[str, torch.dtype] = {}
        inner = acc.unwrap_model(self.model)[0]

        def record(module: Any, inputs: Any, output: torch.Tensor) -> None:
            seen.setdefault("dtype", output.dtype)

        handle = inner.register_forward_hook(record)
        try:
            x = torch.randn(4, 16, device=acc.device)
            with torch.no_grad():
                self.model(x)
        finally:
            handle.remove()
        expected = autocast_dtype(want) or torch.float32
        got = seen.get("dtype")
        expect(got == expected, f"a Linear layer computed in {got} under mixed precision {want!r}, expected {expected}")
        scaler = "with a gradient scaler" if acc.scaler is not None else "no gradient scaler"
        expect((acc.scaler is not None) == (want == "fp16"), f"{scaler} under {want!r}")
        fp8 = ""
        if want == "fp8":
            from ..training.precision_fp8 import report

            found = report(self.model)
            expect(found is not None and len(found.converted) == 1, f"fp8 converted {found and found.converted}, "
                                                                    "expected the middle layer")
            fp8 = f", 1 of 3 linear layers in fp8{' (emulated)' if found is not None and found.emulated else ''}"
        return f"{want}: layers compute in {str(got).replace('torch.', '')}{fp8}, {scaler}"

    def check_training(self) -> str:
        from ..envvars import worker_settings

        acc = self.acc
        self._build()
        before = self._checksum()
        losses = self._steps(self.args.steps)
        after = self._checksum()
        sums = acc.gather_object(after)  # NaN on ranks a sharding strategy leaves without the full weights
        expect(all(v == v and abs(v) != float("inf") for v in losses), f"losses not finite: {losses}")
        full = [s for s in sums if s == s]
        expect(full, "no rank holds the full weights after training")
        expect(after != before or after != after, "the parameters did not change")
        spread = max(full) - min(full)
        expect(spread <= 1e-6 * max(1.0, abs(full[0])), f"parameter checksums differ across ranks: {sums}")
        agree = "same weights on every rank" if len(full) == len(sums) else "full weights gathered on rank 0 (sharded)"
        wrapper = type(self.model).__name__
        backend = worker_settings().dynamo_backend
        compiled = getattr(acc.unwrap_model(self.model), "_compiled_call_impl", None) is not None
        if backend:
            expect(compiled, f"the launcher asked for torch.compile ({backend}) but the prepared model is not compiled")
            wrapper += f", compiled with {backend}"
        return f"{len(losses)} steps ({wrapper}), loss {losses[0]:.4f} → {losses[-1]:.4f}, {agree}"

    def check_checkpoint(self) -> str:
        import shutil

        acc = self.acc
        self._build()
        mine = os.path.join(self.args.out, "checkpoint") if acc.is_main_process else None
        path = acc.gather_object(mine)[0]  # rank 0's directory, on every rank
        acc.save_state(path)
        if not os.path.isdir(path):  # several machines without a shared filesystem
            acc.wait_for_everyone()
            raise Skip(f"rank 0 saved to {path}, which this machine cannot see (no shared filesystem)")
        saved = self._checksum()
        self._steps(1)
        changed = self._checksum()
        acc.load_state(path)
        restored = self._checksum()
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(path, ignore_errors=True)
        if saved == saved:
            expect(changed != saved, "a training step after save_state did not change the weights")
            expect(abs(restored - saved) <= 1e-9 * max(1.0, abs(saved)), (
                f"load_state restored checksum {restored}, saved {saved}"))
        return "weights restored exactly after one more step"

    def check_mismatch(self) -> str:
        from ..errors import CollectiveMismatchError

        acc = self.acc
        if acc.num_processes < 2:
            raise Skip("needs 2 or more processes")
        t = torch.ones(2, device=acc.device)
        raised: Optional[BaseException] = None
        try:
            acc.gather(t) if acc.process_index == 0 else acc.reduce(t)
        except CollectiveMismatchError as exc:
            raised = exc
        outcomes = acc.gather_object(type(raised).__name__ if raised else "nothing")
        expect(all(o == "CollectiveMismatchError" for o in outcomes), (
            "rank 0 in gather() and the others in reduce() should raise CollectiveMismatchError on every rank; "
            f"raised: {', '.join(f'rank {r}: {o}' for r, o in enumerate(outcomes))}"))
        text = str(raised)
        expect("rank 0: gather()" in text and "rank 1: reduce()" in text, f"the error does not name each rank's call: {text}")
        after = acc.reduce(torch.ones(1, device=acc.device), "sum")
        expect(float(after) == acc.num_processes, f"the next reduce gave {float(after)}, expected {acc.num_processes}")
        return "CollectiveMismatchError on every rank, naming each rank's collective; the next collective works"


def main(argv: Optional[List[str]] = None) -> int:
    """Run every check in this worker; returns 0 (the launcher reads the results files, not the
    exit status, to judge). Called once per rank."""
    p = argparse.ArgumentParser(prog="anyaccel.cli.selftest_worker")
    p.add_argument("--out", required=True)
    p.add_argument("--expect_world", type=int, required=True)
    p.add_argument("--expect_device", required=True)
    p.add_argument("--expect_precision", default="no")
    p.add_argument("--nproc_per_node", type=int, default=1)
    p.add_argument("--gpus_per_machine", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    # The command's stdout is its report (one JSON object with --json): what libraries print there
    # from C++ (torch 2.9's gloo prints a line per rank when the group forms) goes to stderr instead.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), 1)
    rank = (detect_topology() or Topology()).rank
    recorder = Recorder(args.out, rank)
    checks = Checks(args)
    for name, method in CHECKS:
        fn: Callable[[], str] = getattr(checks, method)
        t0 = time.perf_counter()
        try:
            recorder.add(name, "pass", fn(), time.perf_counter() - t0)
        except Skip as why:
            recorder.add(name, "skip", str(why), time.perf_counter() - t0)
        except CheckFailed as exc:
            recorder.add(name, "fail", str(exc), time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - every error becomes a ✗ line, not a traceback
            last = traceback.extract_tb(exc.__traceback__)[-1]
            where = f" (at {os.path.basename(last.filename)}:{last.lineno})"
            recorder.add(name, "fail", f"{type(exc).__name__}: {str(exc)[:600]}{where}", time.perf_counter() - t0)
            if name == "process group formed":
                break  # nothing else can run without the group
    recorder.done = True
    recorder.flush()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
