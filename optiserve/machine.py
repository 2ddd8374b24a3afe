"""The CPU and the instruction-set flags that decide INT8/BF16 speed, printed beside every benchmark
table and recorded in every manifest: figures from different machines must never be compared as if alike."""

from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def cpu_facts() -> dict:
    """{"model": ..., "cores": N, "flags": [the FLAGS present]}; platform.processor() off Linux."""
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
    return {"model": model or platform.processor() or "unknown CPU", "cores": os.cpu_count(),
            "flags": [f for f in FLAGS if f in flags]}


def cpu_line(facts: dict | None = None) -> str:
    """E.g. 'AMD EPYC 7B13 (2 cores; avx2 fma)'."""
    facts = facts or cpu_facts()
    return f"{facts['model']} ({facts['cores']} cores; {' '.join(facts['flags']) or 'no AVX2'})"
