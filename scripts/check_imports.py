"""The package map, checked: which component may import which, and no module-level state.

    python scripts/check_imports.py           # exit 1 and one line per violation
    python scripts/check_imports.py --table   # print the allowed arrows

A component is a top-level package (`kernels`, `transfer`, `prefill`, `decode`) or a
first-level part of `pdserve` (`pdserve.engine`, `pdserve.router`, ...). ALLOWED below is
the one place the arrows are written down; docs/architecture.md draws the same picture.
Every `import` counts, also those inside functions and under TYPE_CHECKING: an arrow is an
arrow whenever it is taken. Three more rules:

- roles reach the engine core only through its public API: no attribute named in
  CORE_INTERNALS is touched from `prefill/` or `decode/`;
- no module-level mutable state: a module's top level may not bind a dict, list or set
  display or comprehension, nor call a constructor of mutable state (MUTABLE_CALLS);
  constants are tuples, frozensets, MappingProxyType or a pdserve.registry.Registry
  (`__all__` is the one list allowed, by convention);
- no `global` statements.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pdserve", "kernels", "transfer", "prefill", "decode")
GENERATED = ("pdserve/rpc/pdserve_pb2.py", "pdserve/rpc/pdserve_pb2_grpc.py")

# Leaves import nothing of ours (except each other) and anyone may import them.
LEAVES = frozenset(
    {
        "pdserve.config",
        "pdserve.failpoints",
        "pdserve.registry",
        "pdserve.sampling_params",
        "pdserve.outputs",
        "pdserve.trace",
        "pdserve.progress",
        "pdserve.lifetime",
    }
)
_CORE = frozenset(
    {
        "pdserve.attention",
        "pdserve.models",
        "pdserve.parallel",
        "pdserve.tokenizer",
        "pdserve.weights",
    }
)
_EDGE = frozenset({"pdserve.serving", "pdserve.rpc", "pdserve.validation"})

# component -> the components it may import (besides itself and the leaves)
ALLOWED: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "kernels": frozenset(),
        "transfer": frozenset(),
        "pdserve.attention": frozenset({"kernels"}),
        # tensor parallelism's collectives and shard arithmetic (torch.distributed only)
        "pdserve.parallel": frozenset(),
        # CPU kernels a layer calls: a Linear's few-row product, RMSNorm, SwiGLU, RoPE
        "pdserve.models": frozenset({"pdserve.attention", "pdserve.parallel", "kernels"}),
        "pdserve.tokenizer": frozenset(),
        "pdserve.weights": frozenset({"pdserve.models", "pdserve.tokenizer"}),
        # the KV core: bookkeeping here, bytes moved by kernels (pack/unpack) and transfer.tiers
        "pdserve.kv": frozenset({"kernels", "transfer"}),
        "pdserve.validation": frozenset({"pdserve.tokenizer"}),
        "pdserve.engine": _CORE | {"pdserve.kv", "pdserve.validation", "kernels", "transfer"},
        "pdserve.llm": frozenset({"pdserve.engine", "pdserve.validation"}),
        "pdserve": frozenset({"pdserve.llm"}),
        "pdserve.rpc": frozenset(),
        # process-edge plumbing shared by every role: proto conversion, servers, registration,
        # the KV pool as the transfer layer sees it
        "pdserve.serving": frozenset(
            {"pdserve.rpc", "pdserve.engine", "pdserve.kv", "pdserve.parallel", "transfer"}
        ),
        # the roles: the core, the edge and the data plane, never each other
        "prefill": _EDGE | {"pdserve.engine", "pdserve.kv", "transfer"},
        "decode": _EDGE | {"pdserve.engine", "pdserve.kv", "transfer"},
        "pdserve.router": _EDGE | {"pdserve.weights", "pdserve.tokenizer"},
        # front doors and clients talk to the router over gRPC only
        "pdserve.client": frozenset({"pdserve.serving", "pdserve.rpc"}),  # convert, auth, limits
        # the front door validates text prompts with the edges' one validator
        "pdserve.openai": frozenset(
            {"pdserve.client", "pdserve.rpc", "pdserve.tokenizer", "pdserve.validation"}
        ),
        "pdserve.launch": frozenset({"pdserve.rpc", "pdserve.serving"}),  # serving.auth only
        # the top: benchmarks, the command line and the wiring that starts roles
        "pdserve.bench": _CORE
        | _EDGE
        | {
            "pdserve",
            "pdserve.kv",
            "pdserve.engine",
            "pdserve.llm",
            "pdserve.client",
            "pdserve.launch",
            "kernels",
            "transfer",
            "prefill",
            "decode",
        },
        # the simulator: the real scheduler, books and policies of every role, on a clock
        "pdserve.sim": _CORE
        | _EDGE
        | {
            "pdserve.kv",
            "pdserve.engine",
            "pdserve.bench",
            "pdserve.router",
            "pdserve.launch",
            "kernels",
            "transfer",
            "prefill",
            "decode",
        },
        "pdserve.cli": frozenset(
            {
                "pdserve.sim",
                "pdserve",
                "pdserve.llm",
                "pdserve.engine",
                "pdserve.weights",
                "pdserve.bench",
                "pdserve.launch",
                "pdserve.client",
                "pdserve.router",
                "pdserve.openai",
                "pdserve.serving",
                "pdserve.rpc",
                "prefill",
                "decode",
                "transfer",
            }
        ),
    }
)

# what roles may not reach into: the engine core's parts
CORE_INTERNALS = frozenset({"scheduler", "allocator", "spiller", "prefixes", "offload", "kv"})
ROLE_COMPONENTS = frozenset({"prefill", "decode"})
MUTABLE_CALLS = frozenset(
    {
        "dict",
        "list",
        "set",
        "bytearray",
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "count",
        "WeakValueDictionary",
        "WeakKeyDictionary",
        "WeakSet",
        "Lock",
        "RLock",
        "Event",
        "Queue",
    }
)


def component(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pdserve" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path = ROOT) -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if str(path.relative_to(root)) not in GENERATED:
                yield path


def imported(tree: ast.AST, module: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield node.lineno, name


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


def check_file(path: Path, root: Path = ROOT) -> list[str]:
    rel = path.relative_to(root)
    module = module_name(path, root)
    mine = component(module)
    tree = ast.parse(path.read_text(), str(rel))
    problems = []
    allowed = frozenset() if mine in LEAVES else ALLOWED.get(mine)
    if allowed is None:
        problems.append(f"{rel}: component {mine!r} is not in ALLOWED; add its arrows")
        allowed = frozenset()
    for line, name in imported(tree, module):
        if name.split(".")[0] not in PACKAGES:
            continue
        target = component(name)
        if target == mine or target in LEAVES:
            continue
        if mine in LEAVES or target not in allowed:
            problems.append(f"{rel}:{line}: {mine} may not import {target} ({name})")
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if targets and _mutable(value) and ast.unparse(targets[0]) != "__all__":
            names = ", ".join(ast.unparse(t) for t in targets)
            problems.append(f"{rel}:{node.lineno}: module-level mutable state ({names})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            problems.append(f"{rel}:{node.lineno}: `global` statement")
        if (
            mine in ROLE_COMPONENTS
            and isinstance(node, ast.Attribute)
            and node.attr in CORE_INTERNALS
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            problems.append(
                f"{rel}:{node.lineno}: a role reaches into the engine core (.{node.attr})"
            )
    return problems


def check(root: Path = ROOT) -> list[str]:
    problems = []
    for path in source_files(root):
        problems += check_file(path, root)
    return problems


def table() -> str:
    lines = [f"leaves (anyone may import them): {', '.join(sorted(LEAVES))}"]
    for name, targets in ALLOWED.items():
        lines.append(f"{name:<20} -> {', '.join(sorted(targets)) or '(leaves only)'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", action="store_true", help="print the allowed arrows")
    if parser.parse_args().table:
        print(table())
        return 0
    problems = check()
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
