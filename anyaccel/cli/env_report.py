"""``anyaccel env``: everything a bug report needs, as a list to paste into an issue.

Versions (anyaccel, Python, torch and its CUDA, optional Accelerate and torch-xla — read from the
installed package metadata, never imported), devices, the environment this process resolves to
(:meth:`~anyaccel.environment.Environment.describe`), the launcher variables that are set, and the
configuration file in effect with its values. Local to the calling process; starts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional, Tuple

__all__ = ["add_parser", "run", "collect"]

_VARS = (
    "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "PJRT_DEVICE", "TPU_NAME",
)  # fmt: skip


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect(config_file: Optional[str] = None) -> List[Tuple[str, str]]:
    """The report as ``(label, value)`` pairs. Never raises for a broken setup: the problem is
    reported as the value."""
    from .. import __version__

    rows: List[Tuple[str, str]] = [
        ("anyaccel version", __version__),
        ("Platform", platform.platform()),
        ("Python version", f"{platform.python_version()} ({sys.executable})"),
    ]
    try:
        import torch

        hip, cuda = getattr(torch.version, "hip", None), torch.version.cuda
        build = f"ROCm {hip}" if hip else f"CUDA {cuda}" if cuda else "CPU-only build"
        rows.append(("PyTorch version", f"{torch.__version__} ({build})"))
    except Exception as exc:  # pragma: no cover - torch is a dependency
        rows.append(("PyTorch version", f"cannot import torch: {exc}"))
        torch = None
    for label, dist in (("Accelerate version", "accelerate"), ("torch-xla version", "torch_xla")):
        version = _version(dist) or (_version(dist.replace("_", "-")) if "_" in dist else None)
        if version:
            rows.append((label, version))
    rows.append(("CPU cores", str(os.cpu_count())))
    try:
        import psutil

        rows.append(("RAM", f"{psutil.virtual_memory().total / 2**30:.1f} GiB"))
    except Exception:  # pragma: no cover - psutil is a dependency
        pass
    if torch is not None:
        rows += _devices()
    try:
        from ..environment import resolve_environment

        rows.append(("Detected environment", resolve_environment().describe().replace("\n", "; ")))
    except Exception as exc:
        rows.append(("Detected environment", f"error: {exc}"))
    slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_") and k in (
        "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_PROCID", "SLURM_NODELIST")}  # fmt: skip
    if slurm:
        rows.append(("SLURM", " ".join(f"{k}={v}" for k, v in sorted(slurm.items()))))
    launcher = {k: os.environ[k] for k in _VARS if k in os.environ}
    launcher.update({k: v for k, v in os.environ.items() if k.startswith("ANYACCEL_")})
    rows.append(("Variables", " ".join(f"{k}={v}" for k, v in sorted(launcher.items())) or "none set"))
    rows.append(("Config file", _config(config_file)))
    return rows


def _devices() -> List[Tuple[str, str]]:
    """One row per registered device type other than the CPU, from the device registry
    (:func:`anyaccel.backends.config_device_names` and each device's facts): ``GPUs: 2 — 0: ...``
    for a device used by index, ``Apple MPS device: available`` otherwise. A device that its own
    launcher selects (TPU) is not counted here (its runtime is not started by the report)."""
    from ..backends import config_device, config_device_names

    rows = []
    for name in reversed(config_device_names()[1:]):  # the most preferred first; the CPU has its own rows
        facts = config_device(name)
        if facts is None or facts.selected_by is not None:
            continue
        n = facts.count()
        if not facts.indexed:
            rows.append((facts.label, "available" if n else "not available"))
            continue
        described = []
        for i in range(n):
            try:
                described.append(f"{i}: {facts.describe(i)}" if facts.describe is not None else str(i))
            except Exception as exc:  # pragma: no cover - broken driver
                described.append(f"{i}: error {exc}")
        rows.append((f"{facts.label}s", f"{n} — " + ", ".join(described) if n else "none visible"))
    return rows


def _config(explicit: Optional[str]) -> str:
    try:
        from ..config.file import default_config_path, find_config_file, load_config

        path = find_config_file(explicit)
        if path is None:
            return f"none ({default_config_path()} does not exist; built-in defaults apply)"
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(path)
        values = ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
        return f"{path}\n    {values}"
    except Exception as exc:
        return f"error: {exc}"


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``env`` on the ``anyaccel`` sub-command parsers; it runs :func:`run`."""
    p = subparsers.add_parser(
        "env",
        help="print versions, devices, the detected environment and the config file (for bug reports)",
        description="Print what a bug report needs: versions, devices, the detected distributed environment, "
        "launcher variables and the configuration file in effect. Paste the output into the issue.",
    )
    p.add_argument("--config_file", "--config-file", metavar="PATH", help="report this configuration file instead")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print the report; always exit status 0."""
    print("Copy-and-paste the text below in your GitHub issue:\n")
    for label, value in collect(getattr(args, "config_file", None)):
        print(f"- {label}: {value}")
    return 0
