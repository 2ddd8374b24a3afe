"""The CPU and the instruction-set flags that decide INT8/BF16 speed, printed beside every benchmark
table and recorded in every manifest: figures from different machines must never be compared as if alike.

Every decision that depends on those flags (is there bf16?) asks this module, and
`OPTISERVE_CPU_FLAGS` (e.g. `+avx512_bf16,-amx_int8`) states flags instead of detecting them, so
each hardware path can be run on any machine. A stated set is recorded beside the detected one.
What an engine does with bf16 on a CPU without bf16 instructions differs by engine and by CPU
(docs/optimizer.md, "Precision as it ran"): each variant records the precision its engine reports
and whether these flags compute it natively (`native`).
"""

from __future__ import annotations

import os
import platform

from optiserve.errors import UserError

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPU_FLAGS_ENV = "OPTISERVE_CPU_FLAGS"


def stated_flags(text: str | None = None) -> dict[str, bool]:
    """The flags `OPTISERVE_CPU_FLAGS` states: {flag: present}; `+name` or `name` adds, `-name` removes."""
    text = os.environ.get(CPU_FLAGS_ENV, "") if text is None else text
    stated = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        present, name = (item[0] != "-", item[1:]) if item[0] in "+-" else (True, item)
        if name not in FLAGS:
            raise UserError(f"{CPU_FLAGS_ENV}={text!r}: unknown flag {name!r}; state +FLAG or -FLAG with FLAG one of "
                            f"{', '.join(FLAGS)}")
        stated[name] = present
    return stated


def cpu_facts() -> dict:
    """{"model": ..., "cores": N, "flags": [the FLAGS present]}; platform.processor() off Linux. Where
    OPTISERVE_CPU_FLAGS states flags, `flags` holds them and `flags_detected` what the CPU has."""
    detected = _detected()
    stated = stated_flags()
    if not stated:
        return detected
    flags = [f for f in FLAGS if stated.get(f, f in detected["flags"])]
    return {**detected, "flags": flags, "flags_detected": detected["flags"],
            "flags_stated": os.environ[CPU_FLAGS_ENV]}


def bf16_missing() -> str | None:
    """Why this CPU does not compute bf16 natively (it needs avx512_bf16 or amx_bf16), or None."""
    flags = cpu_facts()["flags"]
    if set(BF16_FLAGS) & set(flags):
        return None
    how = f", as {CPU_FLAGS_ENV} states" if os.environ.get(CPU_FLAGS_ENV) else ""
    return f"this CPU has no bf16 instructions ({' or '.join(BF16_FLAGS)}; it has {' '.join(flags) or 'none'}{how})"


def native(precision: str, flags: list[str] | None = None) -> bool:
    """Whether a CPU with `flags` (by default this one's, detected or stated) has instructions that
    compute `precision`: bf16 needs avx512_bf16 or amx_bf16 (elsewhere an engine emulates it or
    computes f32); fp32 and int8 run on every CPU optiserve supports (VNNI and AMX make int8
    faster, not different); fp16 has no CPU flag here, so it counts as emulated."""
    flags = cpu_facts()["flags"] if flags is None else flags
    if precision == "bf16":
        return bool(set(BF16_FLAGS) & set(flags))
    return precision != "fp16"


def native_facts(precision: str) -> dict:
    """{"native": ...} by the flags in force; where OPTISERVE_CPU_FLAGS states them, also what the
    detected CPU would say (`native_detected`), so a stated run never hides what the CPU itself does."""
    facts = cpu_facts()
    if "flags_detected" not in facts:
        return {"native": native(precision, facts["flags"])}
    return {"native": native(precision, facts["flags"]), "native_detected": native(precision, facts["flags_detected"]),
            "flags_stated": facts["flags_stated"]}


def _detected() -> dict:
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
    """E.g. 'AMD EPYC 7B13 (2 cores; avx2 fma)', with the flags as stated where they were."""
    facts = facts or cpu_facts()
    stated = f", stated by {CPU_FLAGS_ENV}={facts['flags_stated']}" if facts.get("flags_stated") else ""
    return f"{facts['model']} ({facts['cores']} cores; {' '.join(facts['flags']) or 'no AVX2'}{stated})"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's cpuset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
