"""The test suite's own shape: a test module never imports another test module (nor conftest); what tests share
lives in tests/helpers/. Function-level imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, `from . import x` and `from .x import y` resolved to `x`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                out.append((node.lineno, node.module))
            if node.level or node.module in ("tests", None):
                out += [(node.lineno, a.name) for a in node.names]
    return out


def test_no_test_module_imports_another():
    forbidden = {p.stem for p in TESTS.glob("test_*.py")} | {"conftest"}
    bad = []
    for path in sorted([*TESTS.glob("*.py"), *(TESTS / "helpers").glob("*.py")]):
        for line, module in _imported(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            name = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
            if name in forbidden:
                bad.append(f"{path.relative_to(TESTS.parent)}:{line} imports {module}")
    assert not bad, "move what is shared into tests/helpers/:\n" + "\n".join(bad)


# Slow to import and needed by few tests: imported inside the test or fixture, so that collecting the suite (once per
# xdist worker) does not pay for them. torch is not here: the project's own modules the tests import load it anyway.
LAZY = ("transformers", "mlflow", "airflow", "lm_eval")


def _at_import_time(tree: ast.Module) -> ast.Module:
    """The statements that run when the module is imported: all but the bodies of functions."""
    keep, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            keep.append(node)
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return ast.Module(body=[n for n in keep if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])


def test_test_modules_import_slow_libraries_lazily():
    bad = []
    for path in sorted([*TESTS.glob("*.py"), *(TESTS / "helpers").glob("*.py")]):
        for line, module in _imported(_at_import_time(ast.parse(path.read_text(), str(path)))):
            if module.split(".")[0] in LAZY:
                bad.append(f"{path.relative_to(TESTS.parent)}:{line} imports {module} at the top level")
    assert not bad, "import it inside the test or fixture that needs it:\n" + "\n".join(bad)


ONCE = """
import os, sys, time
from pathlib import Path
from tests.helpers.dags import once

def make(d):
    with open(d.parent / "calls", "a") as f:
        f.write("x")
    time.sleep(0.5)  # the others arrive while it runs
    return {"pid": os.getpid()}

print(once(Path(sys.argv[1]), "run", make)["pid"])
"""


def test_a_session_run_is_made_once_whichever_worker_asks(tmp_path):
    """tests/helpers/dags.py once(): three processes (as xdist workers) ask together; one makes, all read its result."""
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ONCE, str(tmp_path)], cwd=TESTS.parent, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    pids = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert (tmp_path / "calls").read_text() == "x" and len(pids) == 1, pids


LEAVES = """
import os, subprocess, sys, tempfile

def test_leaves_temporary_files():
    print("TMP=" + tempfile.gettempdir())
    open(os.path.join(tempfile.gettempdir(), "a-file"), "w").close()
    child = [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"]
    print("CHILD=" + subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip())
"""


def test_a_session_leaves_nothing_in_the_systems_temporary_directory(tmp_path):
    """tests/conftest.py: a session's processes (its own and their children) write their temporary files into the
    session's directory, which the session removes at its end; pytest's basetemp stays in the system's."""
    import os
    import subprocess
    import sys

    system = tmp_path / "system-tmp"
    system.mkdir()
    (tmp_path / "test_leaves.py").write_text(LEAVES)
    env = {k: v for k, v in os.environ.items() if k not in ("LLM_PIPELINE_TEST_TMPDIR", "PYTEST_DEBUG_TEMPROOT")}
    env.update(TMPDIR=str(system), PYTHONPATH=str(TESTS.parent))
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest"]
    out = subprocess.run(
        [*argv, "--rootdir", str(TESTS.parent), str(tmp_path / "test_leaves.py")],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    session = Path(out.stdout.split("TMP=")[1].split()[0])
    child = Path(out.stdout.split("CHILD=")[1].split()[0])
    assert session.parent == system and child.parent == session  # the session's directory, inherited by children
    assert not session.exists()  # removed at the end
    assert [p.name for p in system.iterdir() if not p.name.startswith("pytest-of-")] == []  # nothing beside basetemp
