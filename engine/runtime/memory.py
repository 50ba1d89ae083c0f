"""How much memory MLX may use on this device, and what the engine does with it.

On a GPU the weights, the caches and the activations all live in device memory (CUDA) or in
the GPU's share of unified memory (Metal), so the budget follows MLX's limits, not host RAM.
The decisions are pure functions of a `DeviceMemory` (tested without a GPU); only
`device_memory()` asks MLX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30
MIN_BUDGET = 64 << 20  # snapshots of a small model still fit: the engine stays useful
# Of what the weights leave free, the share for cached state: the rest is for activations
# (a 512-token prefill chunk), the live caches of the turn running, and the allocator.
BUDGET_SHARE = 0.5
# mlx-lm warns above this share of Metal's recommended working set ("this can be slow").
LARGE_MODEL_SHARE = 0.9


@dataclass(frozen=True)
class DeviceMemory:
    kind: str  # "cpu", "metal" or "cuda"
    limit: int  # mx.get_memory_limit(): what MLX's allocator may hold
    total: int | None = None  # device memory size (device_info "memory_size"), if known
    recommended: int | None = None  # Metal's max recommended working set, if known

    @property
    def usable(self) -> int:
        """The most the weights, caches and activations together may take."""
        return min(x for x in (self.limit, self.total, self.recommended) if x)


def device_memory() -> DeviceMemory:
    """This process's MLX device and its memory limits."""
    import mlx.core as mx

    from kernels.choice import device_kind

    info = mx.device_info()
    limit = mx.get_memory_limit() or _host_ram()
    return DeviceMemory(
        device_kind(), limit, info.get("memory_size"), info.get("max_recommended_working_set_size")
    )


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def fits(weights_bytes: int, mem: DeviceMemory) -> str | None:
    """None if the weights fit the device, else why not (model size and limit, in GiB)."""
    if weights_bytes <= mem.usable:
        return None
    return (
        f"the weights need {weights_bytes / GiB:.1f} GiB, more than the {mem.usable / GiB:.1f} "
        f"GiB MLX may use on this {mem.kind} device; use a quantized checkpoint or a smaller "
        "model"
    )


def default_budget(weights_bytes: int, mem: DeviceMemory) -> int:
    """Byte budget for all cached state: a share of what the weights leave of the limit."""
    return max(MIN_BUDGET, int((mem.usable - weights_bytes) * BUDGET_SHARE))


def wired_limit(weights_bytes: int, mem: DeviceMemory) -> tuple[int | None, str | None]:
    """(wired limit to set, warning) as mlx-lm does on Metal: wire the recommended working set
    so the weights are not paged out between turns; warn when they nearly fill it."""
    if mem.kind != "metal" or not mem.recommended:
        return None, None
    warning = None
    if weights_bytes > LARGE_MODEL_SHARE * mem.recommended:
        warning = (
            f"the model takes {weights_bytes / GiB:.1f} GiB, close to the "
            f"{mem.recommended / GiB:.1f} GiB Metal recommends: generation may be slow"
        )
    return mem.recommended, warning


def clear_between_chunks(kind: str) -> bool:
    """Release MLX's buffer cache between prefill chunks? On a GPU the cache holds device
    memory the budget does not count (mlx-lm clears it there too); on the CPU it is host
    RAM that the next chunk reuses, and clearing would only cost page faults."""
    return kind != "cpu"
