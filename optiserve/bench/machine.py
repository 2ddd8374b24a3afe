"""One line naming the CPU and the instruction-set flags that decide INT8/BF16 speed, printed beside
every benchmark table: figures from different machines must never be compared as if alike."""

from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_line() -> str:
    """E.g. 'AMD EPYC 7B13 (2 cores; avx2 fma)'; falls back to platform.processor() off Linux."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and model is None:
                    model = value
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or "unknown CPU"
    present = [f for f in FLAGS if f in flags]
    return f"{model} ({os.cpu_count()} cores; {' '.join(present) or 'no AVX2'})"
