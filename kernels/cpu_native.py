"""Building and loading the C kernels in kernels/csrc/ for the CPU this process runs on.

A kernel is compiled the first time a process needs it, with the machine's C compiler
(`$CC`, else `cc`) for its own instruction set (-march=native; `$PDSERVE_KERNEL_MARCH`
names another target), and cached as a shared library under `$PDSERVE_KERNEL_CACHE`
(default `~/.cache/pdserve/kernels`), named by a hash of the source, the flags, the
compiler and the CPU (its model and its flags), so that another machine sharing
the directory never loads a build it cannot run. Concurrent builds (a prefill and a decode
worker starting together) each write a private file and rename it into place.

No compiler, or a build that fails, is a `NativeUnavailable` with the compiler's message;
callers fall back to the torch path. The libraries link OpenMP as `libgomp.so.1`, the name
torch's own runtime is loaded under, so their parallel regions use torch's thread pool
instead of starting a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC")


def _flags() -> tuple[str, ...]:
    """FLAGS plus the target: this machine's (`-march=native`), or `$PDSERVE_KERNEL_MARCH`
    (e.g. `haswell`: the AVX2 build on an AVX-512 machine, for testing the other path).
    For tests only: a target this CPU lacks builds, loads and then dies on an illegal
    instruction; the cache's promise not to load a build the CPU cannot run holds for
    `native` only."""
    return (*FLAGS, f"-march={os.environ.get('PDSERVE_KERNEL_MARCH') or 'native'}")


BUILD_TIMEOUT_S = 120.0


class NativeUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here (retrying will not help)."""


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pdserve" / "kernels"


# the /proc/cpuinfo fields that say which instructions a build may use: x86's model and
# flags, ARM's implementer, part and features (per-core and changing fields, such as the
# clock, must stay out: the key would change under a running machine)
_CPU_FIELDS = frozenset(
    {"model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant",
     "CPU part"}
)  # fmt: skip


def _cpu_id() -> str:
    """The CPU's model and its instruction-set flags (x86), or its implementer, part and
    features (ARM), from the first processor's block: two VMs of one model may expose
    different sets (AVX-512 masked off), and a build for one must not load on the other."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if found:
                        break  # the first processor's block is enough
                    continue
                key = line.split(":", 1)[0].strip()
                if key in _CPU_FIELDS and key not in found:
                    found[key] = line
    except OSError:
        pass
    return "".join(found.values()) or f"{platform.machine()} {platform.processor()}"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    return cc


def load(name: str) -> ctypes.CDLL:
    """The library built from csrc/<name>.c, compiled on first use; NativeUnavailable if
    it cannot be (the failure is remembered: one try per process)."""
    got = _load_once(name)
    if isinstance(got, NativeUnavailable):
        raise got
    return got


@cache
def _load_once(name: str) -> ctypes.CDLL | NativeUnavailable:
    # Two threads may both build on a first call: each writes its own file and renames it.
    try:
        return ctypes.CDLL(str(_build(name)))
    except NativeUnavailable as exc:
        return exc
    except OSError as exc:
        return NativeUnavailable(str(exc))


def _build(name: str) -> Path:
    source = SOURCES / f"{name}.c"
    cc = _compiler()
    key = hashlib.sha256()
    flags = _flags()
    headers = [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]  # what it may include
    for part in (source.read_bytes(), *headers, " ".join(flags).encode(), cc.encode()):
        key.update(part)
    key.update(_cpu_id().encode())
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    # Compile and link apart: linking with -ffast-math adds crtfastmath.o, whose constructor
    # sets flush-to-zero for the whole process when the library loads.
    obj = tmp[: -len(".so")] + ".o"
    steps = [
        [cc, *flags, "-c", str(source), "-o", obj],
        [cc, "-shared", "-fopenmp", obj, "-o", tmp, "-lm"],
    ]
    try:
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NativeUnavailable(f"{' '.join(cmd)}: {exc}") from exc
            if done.returncode:
                raise NativeUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        for leftover in (obj, tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target
