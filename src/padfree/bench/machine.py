"""What machine a benchmark ran on: platform, CPUs, library versions, device and load."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def machine(device: str, dtype: str | None = None) -> dict:
    import torch

    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if dtype is not None:
        out["dtype"] = dtype
        out["precision"] = (
            "float32"
            if dtype == "float32"
            else f"float32 weights and AdamW, forward + loss under torch.autocast({dtype})"
        )
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    if hasattr(os, "getloadavg"):
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def machine_info() -> dict:
    """CPU, memory, library versions and the load average (other processes share this machine)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": list(os.getloadavg()),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for pkg in ("numpy", "numba", "torch", "transformers", "trl", "lhotse", "datasets", "pyarrow"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    info["versions"] = versions
    return info
