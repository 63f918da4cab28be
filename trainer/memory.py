"""The trainer process's memory: what it holds, and giving the heap back after each step.

A step allocates and frees activations, gradients and log-prob chunks whose sizes change with every
batch (packed lengths differ step to step). glibc's malloc keeps freed heap memory for reuse, and
raises its mmap threshold after a large free, so later large tensors come from the heap too: the
process's RSS then ratchets up with each new high-water mark and fragmentation, although nothing is
alive. Measured on SmolLM2-135M (float32, CPU, 6 samples of 220-700 tokens a step): RSS 3.0 GB
after one step and 4.8 GB after eight without a trim, 0.80 -> 1.02 GB with ``malloc_trim(0)``
after each step (``bench/trainer_memory.py`` measures it over 200 steps). A trim after each step
costs milliseconds against a step of seconds. CUDA's caching allocator is another matter (reserved
GPU memory is reused, not leaked); its figures are reported, not released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
import sys
from collections.abc import Callable
from functools import cache

import torch


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's malloc.h)."""


def fix_mmap_threshold(kb: int) -> bool:
    """Fix glibc's mmap threshold at ``kb`` (``TrainerConfig.mmap_threshold_kb`` says why and what it
    costs): allocations above it are mapped and unmapped, never kept in the heap. False where the C
    library has no ``mallopt`` or refuses the value."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, kb * 1024))


def freeze_resident() -> int:
    """Put every object alive now out of the cyclic collector's reach (``gc.freeze``); how many.

    Called once the model is loaded, by a process that keeps it to its end (the trainer's): a full
    collection walks every tracked object, and a loaded peft model is hundreds of thousands of them,
    so ``release``'s collection after each step would otherwise cost a fixed ~0.3 s that a GPU step
    of a few seconds feels (measured once, on a 2-core EPYC: Qwen2.5-7B's shape built on the meta
    device with LoRA on every projection, 472k objects; 0.3-1.3 ms a collection after the freeze;
    on an H100's host, the trainer holding the same shape's model, 500k objects frozen and
    0.3-0.6 ms a collection: deploy/README.md, "Measured on one GPU").
    Frozen objects are still freed by reference counting; only a cycle among them is never
    collected, which is why a process that builds many policies (the tests) does not call this.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release() -> None:
    """Collect cycles and hand freed heap pages back to the OS (glibc only; elsewhere a no-op)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def rss_gb() -> float:
    """The process's resident set now (GB), from /proc; the peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 1e9
    except OSError:
        unit = 1 if sys.platform == "darwin" else 1024  # getrusage(2): bytes on macOS, KiB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 1e9


def peak_gb() -> float | None:
    """The resident set's high-water mark (``VmHWM``) since the last ``reset_peak``, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9  # kB
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Start a new high-water mark at the current RSS (writing 5 to ``clear_refs``, Linux >= 4.0);
    False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return peak_gb() is not None


def figures() -> dict[str, float]:
    """The step's ``perf/`` memory figures: RSS now and its peak since the last call (what an OOM
    sees: the step's activations and chunks while they are alive), and on a GPU the allocated and
    reserved peaks. Each call starts the next peak."""
    out = {"perf/rss_gb": rss_gb()}
    peak = peak_gb()
    if peak is not None:
        out["perf/rss_peak_gb"] = peak
    reset_peak()
    if torch.cuda.is_available():
        out["perf/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["perf/cuda_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        torch.cuda.reset_peak_memory_stats()
    return out
