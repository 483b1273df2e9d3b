"""The fused survivor kernel: filter and count a CPU score block in one pass (compiled C).

A score block's survivors (scores at or above their query's lowest threshold edge) are
located among the query's merged thresholds and counted into the histograms in the same
pass that finds them, with one read of each score; the near-ties come out for the exact
resolution after the pass (docs/simulator.md, "The fused survivor kernel").  The C source
(``kernels/survivor_count.c``) is compiled once per machine with the system C compiler into
``$RAYCOMPAT_CACHE/kernels`` (default ``~/.cache/raycompat/kernels``); without a compiler
the passes keep their torch filter and count, with one warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

__all__ = ["SOURCE", "fused_enabled", "load_kernel", "BandBuffer", "count_block"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "survivor_count.c"
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99", "-fno-strict-aliasing"]
_lock = threading.Lock()
_loaded: dict[str, object] = {}

_i64p = ctypes.POINTER(ctypes.c_int64)
_argtypes = [
    ctypes.c_void_p,  # S
    ctypes.c_int64,  # R
    ctypes.c_int64,  # B
    ctypes.c_int64,  # ld
    ctypes.c_int64,  # q0
    ctypes.c_void_p,  # lo_min
    ctypes.c_void_p,  # off
    ctypes.c_void_p,  # lo
    ctypes.c_void_p,  # hi
    ctypes.c_int64,  # n_seg
    ctypes.c_void_p,  # seg (int64 const * const *)
    ctypes.c_void_p,  # base
    ctypes.c_int64,  # width
    ctypes.c_void_p,  # acc (or NULL)
    ctypes.c_int64,  # band_cap
    ctypes.c_void_p,  # band_col
    ctypes.c_void_p,  # band_val
    ctypes.c_void_p,  # band_hi
    ctypes.c_void_p,  # band_lo
    _i64p,  # n_band
]


def _cache_dir() -> Path:
    root = Path(os.environ.get("RAYCOMPAT_CACHE", Path.home() / ".cache" / "raycompat"))
    return root / "kernels"


def _compile(target: Path) -> None:
    """Compile the source into ``target`` (atomically: a half-written library is never seen)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [cc, *_FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
        )
        if run.returncode != 0:
            raise OSError(f"{cc} failed on {SOURCE}: {run.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fused_enabled() -> bool:
    """Whether the passes use the kernel by default (``RAYCOMPAT_FUSED_KERNEL=0`` turns it
    off, e.g. to time the torch filter and count against it)."""
    return os.environ.get("RAYCOMPAT_FUSED_KERNEL", "1") != "0"


def load_kernel():
    """The compiled ``survivor_count`` function, or ``None`` (with one warning) where no C
    compiler is available.  Compiled once per machine, keyed by the source, the flags and
    the platform."""
    with _lock:
        if "fn" in _loaded:
            return _loaded["fn"]
        fn = None
        try:
            key = hashlib.sha256(
                SOURCE.read_bytes() + " ".join(_FLAGS).encode() + platform.machine().encode()
            ).hexdigest()[:16]
            target = _cache_dir() / f"survivor_count-{key}.so"
            if not target.exists():
                _compile(target)
            fn = ctypes.CDLL(str(target)).survivor_count
            fn.restype = ctypes.c_int64
            fn.argtypes = _argtypes
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("fused survivor kernel unavailable (%s); using the torch filter", exc)
            fn = None
        _loaded["fn"] = fn
        return fn


class BandBuffer:
    """A worker's output buffers for the near-ties of one block (grown when a block has more)."""

    def __init__(self, cap: int = 4096):
        self.resize(cap)

    def resize(self, cap: int) -> None:
        self.cap = int(cap)
        self.col = np.empty(self.cap, dtype=np.int64)
        self.val = np.empty(self.cap, dtype=np.float32)
        self.hi = np.empty(self.cap, dtype=np.int64)
        self.lo = np.empty(self.cap, dtype=np.int64)


def _ptr(a) -> int:
    return a.data_ptr() if isinstance(a, torch.Tensor) else a.ctypes.data


def count_block(
    fn,
    S: torch.Tensor,
    q0: int,
    tables: dict,
    seg_cols: list[torch.Tensor],
    bases: np.ndarray,
    acc: torch.Tensor,
    buf: BandBuffer,
) -> tuple[int, tuple[np.ndarray, ...] | None]:
    """Count the survivors of CPU float32 block ``S`` (rows: queries ``q0:``) into ``acc``:
    ``(survivors, band)`` with ``band = (block column, score, b_hi, b_lo)`` of the near-ties
    (``None`` when there are none).  ``tables``: the thresholds' ``lo_min``, ``off``, ``lo``,
    ``hi`` arrays; ``seg_cols``: per counted segmentation, the segment of each block column
    (contiguous int64); ``bases``: their offsets in ``acc``."""
    if S.dtype != torch.float32 or S.device.type != "cpu" or S.stride(1) != 1:
        raise ValueError("the fused kernel takes a CPU float32 block with unit column stride")
    R, B = S.shape
    seg_ptrs = np.array([c.data_ptr() for c in seg_cols], dtype=np.uint64)
    n_band = ctypes.c_int64(0)

    def call(acc_ptr: int | None) -> int:
        return fn(
            S.data_ptr(), R, B, S.stride(0), int(q0),
            _ptr(tables["lo_min"]), _ptr(tables["off"]), _ptr(tables["lo"]), _ptr(tables["hi"]),
            len(seg_cols), seg_ptrs.ctypes.data, bases.ctypes.data, int(tables["width"]),
            acc_ptr, buf.cap, buf.col.ctypes.data, buf.val.ctypes.data, buf.hi.ctypes.data,
            buf.lo.ctypes.data, ctypes.byref(n_band),
        )  # fmt: skip

    survivors = call(acc.data_ptr())
    n = int(n_band.value)
    if n > buf.cap:  # rerun for the near-ties only, into buffers that hold them all
        buf.resize(max(n, 2 * buf.cap))
        call(None)
    if n == 0:
        return int(survivors), None
    return int(survivors), tuple(a[:n].copy() for a in (buf.col, buf.val, buf.hi, buf.lo))
