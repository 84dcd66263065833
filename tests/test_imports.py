"""The package map holds: every import is an allowed arrow (scripts/check_imports.py), roles
use only the engine core's public API, and no module keeps mutable state at its top."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checker():
    spec = importlib.util.spec_from_file_location(
        "check_imports", ROOT / "scripts" / "check_imports.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    return module


def test_the_tree_takes_only_allowed_arrows():
    problems = checker().check()
    assert not problems, "\n".join(problems)


def test_the_checker_catches_each_kind_of_violation(tmp_path):
    files = {
        "decode/bad.py": "from prefill.worker import PrefillWorker\n",  # role -> role
        "pdserve/engine/bad.py": "def f():\n    import pdserve.router.service\n",  # core -> router
        "pdserve/kv/state.py": "CACHE = {}\nNAMES = ('a',)\n",  # module-level mutable state
        "prefill/peek.py": "def f(core):\n    return core.scheduler.running\n",  # into the core
        "transfer/g.py": "def f():\n    global X\n",
        "pdserve/newpart/x.py": "",  # a component nobody wrote arrows for
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    problems = "\n".join(checker().check(tmp_path))
    assert "decode may not import prefill (prefill.worker)" in problems
    assert "pdserve.engine may not import pdserve.router (pdserve.router.service)" in problems
    assert "module-level mutable state (CACHE)" in problems
    assert "NAMES" not in problems  # a tuple is a constant
    assert "a role reaches into the engine core (.scheduler)" in problems
    assert "`global` statement" in problems
    assert "component 'pdserve.newpart' is not in ALLOWED" in problems


def test_an_engine_is_built_and_steps_without_torch_dynamo():
    """torch._dynamo costs over a second to import; nothing an engine does needs it (a meta-
    device op on the build path imported it once: pdserve/models/rope.py)."""
    code = (
        "import sys\n"
        "from pdserve import LLM, SamplingParams\n"
        "for model in ('tiny-llama', 'tiny-deepseek'):\n"
        "    LLM(model).generate('hi', SamplingParams(max_tokens=2))\n"
        "print('torch._dynamo' in sys.modules, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].split() == ["False", "True"]
