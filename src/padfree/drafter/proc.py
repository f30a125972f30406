"""Memory read from Linux ``/proc``: what this machine can still give a process, this process's resident
memory and its high-water mark (``check-drafter``'s refusal, the drafter example's peak line and the memory
model's tests read them). No torch; elsewhere than Linux each says it does not know."""

from __future__ import annotations


def available_bytes() -> int | None:
    """Memory this machine can still give a process without swapping (Linux ``MemAvailable``; None where
    unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; 0 elsewhere)."""
    return _status("VmRSS")


def peak_resident_bytes() -> int:
    """This process's resident high-water mark (Linux ``/proc``; 0 elsewhere)."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Restart the high-water mark at the current resident memory (Linux ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
