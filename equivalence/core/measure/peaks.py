"""The memory a check took, as figures (issue 59): this process's peak resident memory on the host, and each
device's peak bytes in use where the backend counts them (a TPU's or a GPU's allocator; the CPU backend
counts none). Read when a check's clock sums it up (``clock.Clock.summary``), and by ``bench --cost`` in each
bare run's and each check's own process, so that the two are compared as measured, not estimated."""

import resource
import sys


def host_peak_bytes() -> int:
    """This process's peak resident set, in bytes (Linux counts ``ru_maxrss`` in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == 'darwin' else peak * 1024)


def device_peak_bytes() -> dict[str, int] | None:
    """``{device: peak bytes in use}`` of this process's devices, or None where the backend counts none."""
    if 'jax' not in sys.modules:
        return None
    import jax

    out = {}
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 -- a backend without the call: no figure
            stats = None
        if stats and 'peak_bytes_in_use' in stats:
            out[str(d)] = int(stats['peak_bytes_in_use'])
    return out or None


def device_limit_bytes() -> int | None:
    """The bytes one device may hold (its allocator's ``bytes_limit``), or None where the backend says none."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats['bytes_limit']) if stats and 'bytes_limit' in stats else None


def measured() -> dict:
    """``{'host_peak_bytes': ..., 'device_peak_bytes': {device: ...} or None}``."""
    return {'host_peak_bytes': host_peak_bytes(), 'device_peak_bytes': device_peak_bytes()}


def line(memory: dict | None) -> str:
    """``memory: host peak 1.23 GB; device peak 3.40 GB (TPU_0)``; '' where nothing was measured."""
    if not memory:
        return ''
    said = f'memory: host peak {memory["host_peak_bytes"] / 1e9:.2f} GB (this process)'
    devices = memory.get('device_peak_bytes')
    if devices:
        top = max(devices, key=devices.get)
        said += f'; device peak {devices[top] / 1e9:.2f} GB ({top}, the most of {len(devices)})'
    else:
        said += "; device peak: not counted by this backend (the CPU's)"
    return said
