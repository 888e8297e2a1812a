"""Where a figure comes from, for a results record (eaglepipe/tools/results.py): this machine, the commit, the params
hash, the day.

The params hash is the first 16 hex digits of the SHA-256 of the params file's result keys (every key but the speed
knobs, ``config.speed``; defaults filled in), as sorted JSON: two runs with the same hash ran the same result params,
whatever their threads, servers or devices.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel

from eaglepipe.core import config
from eaglepipe.core.codedeps import ROOT
from eaglepipe.tools.results import FLAGS, Machine, Record, Value

CPUINFO, MEMINFO = Path("/proc/cpuinfo"), Path("/proc/meminfo")


def cpu_fields(cpuinfo: str) -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and its flags among FLAGS, from the text of /proc/cpuinfo (its first processor)."""
    fields = {}
    for entry in cpuinfo.splitlines():
        key, _, value = entry.partition(":")
        fields.setdefault(key.strip(), value.strip())
    present = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown CPU"), tuple(flag for flag in FLAGS if flag in present)


def memory_gib() -> float | None:
    """The machine's memory in GiB (/proc/meminfo's MemTotal), None where it cannot be read."""
    if not MEMINFO.exists():
        return None
    for entry in MEMINFO.read_text().splitlines():
        if entry.startswith("MemTotal:"):
            return round(int(entry.split()[1]) / 2**20, 1)
    return None


def gpu() -> str | None:
    """The GPUs ``nvidia-smi`` lists, as ``NAME xN``; None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    listed = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    names = [name.strip() for name in listed.stdout.splitlines() if name.strip()]
    if listed.returncode or not names:
        return None
    return f"{names[0]} x{len(names)}"


def this_machine() -> Machine:
    """This machine as a record holds it: the CPU and its flags, the cores this process may use, memory, GPUs."""
    cpu, flags = cpu_fields(CPUINFO.read_text()) if CPUINFO.exists() else ("unknown CPU", ())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Machine(cpu=cpu, flags=flags, cores=cores, memory_gib=memory_gib(), gpu=gpu())


def commit(root: Path = ROOT) -> str | None:
    """git's short hash of the checkout at ``root``; None outside a git checkout."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else None


def result_values(section):
    """The result keys of a params section and their values, nested as the file nests them; speed knobs left out."""
    if isinstance(section, list | tuple):
        return [result_values(item) for item in section]
    if isinstance(section, dict):
        return {key: result_values(value) for key, value in section.items()}
    if not isinstance(section, BaseModel):
        return section
    kept = section.tracked_keys() if isinstance(section, config.Section) else list(type(section).model_fields)
    return {key: result_values(getattr(section, key)) for key in kept}


def params_hash(params: config.Params) -> str:
    """The hash of ``params``' result keys (this module's docstring)."""
    text = json.dumps(result_values(params), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp(name: str, values: dict[str, Value], command: str, params_path: Path, note: str | None = None) -> Record:
    """A record of figures measured now, here: this machine, the commit of the project's checkout, the hash of the
    params at ``params_path``, today's date (UTC)."""
    return Record(
        name=name,
        values=values,
        machine=this_machine(),
        commit=commit(),
        params_hash=params_hash(config.load(params_path)),
        command=command,
        date=datetime.datetime.now(datetime.UTC).date(),
        note=note,
    )
