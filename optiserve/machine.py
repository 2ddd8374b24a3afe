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


def memory_limit_bytes() -> int:
    """The memory this process may use: its cgroup's limit (a container's, as Kubernetes sets it)
    when there is one, else the machine's total memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # cgroup v1 writes a huge number for "no limit"
            return int(text)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
