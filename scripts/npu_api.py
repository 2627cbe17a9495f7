"""The Python API surface of torch_npu and AMCT, taken from the real packages without installing them.

`make npu-api` (python scripts/npu_api.py) downloads the torch-npu wheel of every pair the project pins
(requirements-npu.txt, requirements-npu-amct.txt) with `pip download --no-deps` — never installs it — and reads its
.py files with `ast`: module symbols (functions and classes with their parameters, class members such as enum
constants, module attributes, re-exports resolved through imports) plus every `torch_npu.npu_*` op signature from
the shipped op-plugin docs (`torch_npu/_op_plugin_docs.py`) and the op schema (`npu_native_functions_by_codegen.yaml`).
AMCT is not on PyPI: its surface comes the same way from its public sources (hicann/amct, branches 8.5.0 and
master), read from a git checkout (`--amct-git DIR`). The JSON goes to tests/fixtures/npu_api/; the conformance test
(tests/test_npu_api.py) checks every call the project makes into torch_npu / torch.npu / amct_pytorch against it.

Wheels are cached (only their .py/.yaml members, a few MB) under $LLM_PIPELINE_CACHE or ~/.cache/llm-pipeline.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "npu_api"
REQUIREMENTS = ("requirements-npu.txt", "requirements-npu-amct.txt")
# AMCT releases the project supports (hicann/amct branches; "master" at the commit recorded in the JSON).
AMCT_REFS = ("8.5.0", "master")
# Which modules of each package are described (their direct submodules too); references elsewhere are "external".
TORCH_NPU_MODULES = ("torch_npu", "torch_npu.npu", "torch_npu.profiler", "torch_npu.utils")
AMCT_MODULES = ("amct_pytorch", "amct_pytorch.classic", "amct_pytorch.classic.graph_based.amct_pytorch")
# The platform the snapshot is taken from (the Python sources are the same in every platform's wheel).
PLATFORM = ("3.11", "manylinux_2_28_x86_64")


class DownloadError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------- pins and wheels


def torch_npu_pins(repo: Path = REPO) -> list[str]:
    """torch-npu versions pinned by the requirements files, in file order, unique."""
    out = []
    for name in REQUIREMENTS:
        for line in (repo / name).read_text().splitlines():
            m = re.match(r"\s*torch[-_]npu==([\w.+]+)", line)
            if m and m.group(1) not in out:
                out.append(m.group(1))
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("LLM_PIPELINE_CACHE") or Path.home() / ".cache" / "llm-pipeline") / "npu-api"


def _keep(name: str) -> bool:
    return name.endswith((".py", ".pyi")) or name.endswith("npu_native_functions_by_codegen.yaml")


def slim_wheel(version: str, timeout: int = 600) -> Path:
    """The cached slim copy (.py/.pyi/op-schema members only) of torch_npu's wheel; downloads it when missing."""
    slim = cache_dir() / f"torch_npu-{version}.api.zip"
    if slim.is_file():
        return slim
    slim.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="npu-api-") as tmp:
        py, plat = PLATFORM
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            py,
            "--platform",
            plat,
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"torch-npu=={version}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DownloadError(f"pip download torch-npu=={version}: {e}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise DownloadError(f"pip download torch-npu=={version} failed: {last}")
        wheel = wheels[0]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        part = slim.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if _keep(info.filename):
                    dst.writestr(info.filename, src.read(info))
            dst.writestr("WHEEL_INFO.json", json.dumps({"wheel": wheel.name, "sha256": digest}))
        os.replace(part, slim)
    return slim


# --------------------------------------------------------------------------------------------- AST surface


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> dict:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    if drop_self and positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    n_defaults = len(a.defaults)
    required = positional[: len(positional) - n_defaults] if n_defaults else positional
    return {
        "kind": "function",
        "params": positional,
        "required": required,
        "posonly": [p.arg for p in a.posonlyargs],
        "kwonly": [p.arg for p in a.kwonlyargs],
        "varargs": a.vararg is not None,
        "varkw": a.kwarg is not None,
    }


def _is_static(fn) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _class(node: ast.ClassDef) -> dict:
    members, init = set(), None
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
            if item.name == "__init__":
                init = _params(item, drop_self=True)
        elif isinstance(item, ast.ClassDef):
            members.add(item.name)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
    bases = [ast.unparse(b) for b in node.bases]
    return {"kind": "class", "init": init, "members": sorted(members), "bases": bases}


def _resolve_relative(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def module_surface(source: str, module: str, is_pkg: bool) -> dict:
    """Top-level symbols of one module: definitions, attributes, imports (as references) and star imports."""
    tree = ast.parse(source)
    symbols: dict[str, dict] = {}
    star: list[str] = []
    has_getattr = False

    def visit(body):
        nonlocal has_getattr
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                symbols[node.name] = _params(node, drop_self=False)
                has_getattr |= node.name == "__getattr__"
            elif isinstance(node, ast.ClassDef):
                symbols[node.name] = _class(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and n.id not in symbols:
                            symbols[n.id] = {"kind": "attribute"}
            elif isinstance(node, ast.ImportFrom):
                src = _resolve_relative(module, is_pkg, node.level, node.module) if node.level else node.module
                for alias in node.names:
                    if alias.name == "*":
                        star.append(src)
                    else:
                        symbols[alias.asname or alias.name] = {
                            "kind": "ref",
                            "target": f"{src}.{alias.name}",
                            "from": src,
                        }
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        symbols[alias.asname] = {"kind": "ref", "target": alias.name}
                    elif "." in alias.name and alias.name.startswith(module + "."):
                        child = alias.name[len(module) + 1 :].split(".")[0]
                        symbols.setdefault(child, {"kind": "ref", "target": f"{module}.{child}"})
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))

    visit(tree.body)
    out = {"symbols": dict(sorted(symbols.items()))}
    if star:
        out["star"] = star
    if has_getattr:
        out["dynamic"] = True  # module __getattr__ (PEP 562): names resolved at run time
    return out


def _module_name(path: str) -> tuple[str, bool]:
    p = path[:-4] if path.endswith(".pyi") else path[:-3]
    parts = p.split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _wanted(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or (module.startswith(r + ".") and module.count(".") == r.count(".") + 1) for r in roots)


def surface_from_files(files: dict[str, str], roots: tuple[str, ...]) -> dict:
    """{path: source} → {module: surface} for the modules under `roots` (and their direct submodules)."""
    modules = {}
    for path in sorted(files):
        if not path.endswith((".py", ".pyi")):
            continue
        module, is_pkg = _module_name(path)
        if not _wanted(module, roots):
            continue
        try:
            surf = module_surface(files[path], module, is_pkg)
        except SyntaxError as e:
            surf = {"symbols": {}, "syntax_error": str(e)}
        if module in modules and path.endswith(".py"):  # a .pyi stub wins over its .py
            continue
        modules[module] = surf
    for module in list(modules):  # a package knows its submodules as attributes
        parent, _, child = module.rpartition(".")
        if parent in modules:
            modules[parent]["symbols"].setdefault(child, {"kind": "ref", "target": module})
    return dict(sorted(modules.items()))


# --------------------------------------------------------------------------------------------- op signatures


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([<":
            depth += 1
        elif ch in ")]>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_schema(args: str) -> dict:
    """'Tensor self, Tensor gamma, float epsilon=1e-06, *, int? x=None' → parameter names (kw-only after *)."""
    params, kwonly, required, star = [], [], [], False
    for arg in _split_args(args):
        if arg == "*":
            star = True
            continue
        decl, _, default = arg.partition("=")
        name = decl.split()[-1] if decl.split() else decl
        (kwonly if star else params).append(name)
        if not default and not star:
            required.append(name)
    return {
        "kind": "function",
        "params": params,
        "required": required,
        "posonly": [],
        "kwonly": kwonly,
        "varargs": False,
        "varkw": False,
    }


_DOC_SIG = re.compile(r'_add_torch_npu_docstr\(\s*"(\w+)",\s*"""\s*torch_npu\.(\w+)\((.*?)\)\s*->', re.S)
_YAML_SIG = re.compile(r"^\s*-?\s*func:\s*(\w+)(?:\.\w+)?\((.*)\)\s*->", re.M)


def op_signatures(docs: str, schema_yaml: str) -> dict:
    """torch_npu.npu_* ops: the documented signature (op-plugin docs) first, else the op schema's first overload."""
    ops = {}
    for name, _, args in _DOC_SIG.findall(docs or ""):
        ops.setdefault(name, dict(parse_schema(args), source="_op_plugin_docs"))
    for name, args in _YAML_SIG.findall(schema_yaml or ""):
        if name.startswith("npu_"):
            ops.setdefault(name, dict(parse_schema(args), source="npu_native_functions_by_codegen.yaml"))
    return dict(sorted(ops.items()))


def torch_npu_snapshot(version: str, slim: Path | None = None) -> dict:
    slim = slim or slim_wheel(version)
    with zipfile.ZipFile(slim) as z:
        info = json.loads(z.read("WHEEL_INFO.json"))
        files = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith((".py", ".pyi"))}
        yaml_name = next((n for n in z.namelist() if n.endswith("npu_native_functions_by_codegen.yaml")), None)
        schema = z.read(yaml_name).decode("utf-8", "replace") if yaml_name else ""
    return {
        "package": "torch_npu",
        "version": version,
        "wheel": info["wheel"],
        "wheel_sha256": info["sha256"],
        "generated_by": "scripts/npu_api.py",
        "aliases": {"torch.npu": "torch_npu.npu"},
        "modules": surface_from_files(files, TORCH_NPU_MODULES),
        "ops": op_signatures(files.get("torch_npu/_op_plugin_docs.py", ""), schema),
    }


def amct_git_problem(git_dir: Path) -> str | None:
    """Why `--amct-git DIR` / $AMCT_GIT_DIR cannot give the AMCT snapshots, in one line (None: it can): not a git
    directory, or one without a release of AMCT_REFS. Checked first, so no snapshot is half refreshed."""
    given = f"--amct-git / AMCT_GIT_DIR {git_dir}"
    fix = (
        "clone it (git clone --mirror https://github.com/hicann/amct) or unset AMCT_GIT_DIR to keep the committed ones"
    )
    try:
        where = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "--git-dir"], capture_output=True)
    except OSError as e:  # no git on PATH
        return f"{given}: cannot run git ({e.strerror or e}); install git, or {fix}"
    if where.returncode != 0:
        return f"{given} is not a git directory of hicann/amct; {fix}"
    for ref in AMCT_REFS:
        found = subprocess.run(
            ["git", "--git-dir", str(git_dir), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            capture_output=True,
        )
        if found.returncode != 0:
            fetch = f"git --git-dir {git_dir} fetch origin {ref}:{ref}"
            return f"{given} has no {ref!r} (branches {', '.join(AMCT_REFS)} are read); fetch it: {fetch}"
    return None


def amct_snapshot(git_dir: Path, ref: str) -> dict:
    """AMCT's surface from a git checkout of hicann/amct at `ref` (no work tree needed)."""

    def git(*args) -> bytes:
        return subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True, check=True).stdout

    commit = git("rev-parse", f"{ref}^{{commit}}").decode().strip()
    archive = git("archive", "--format=zip", commit, "amct_pytorch")
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        files = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist() if n.endswith(".py")}
    version = ""
    try:
        version = git("show", f"{commit}:amct_pytorch/.version").decode().strip()
    except subprocess.CalledProcessError:
        pass
    modules = surface_from_files(files, AMCT_MODULES)
    return {
        "package": "amct_pytorch",
        "version": ref,
        "package_version": version,
        "commit": commit,
        "source": "github.com/hicann/amct",
        "generated_by": "scripts/npu_api.py",
        # master resolves the classic flow lazily (amct_pytorch.__getattr__ → graph_based.amct_pytorch)
        "getattr_delegates": {"amct_pytorch": ["amct_pytorch.classic.graph_based.amct_pytorch"]}
        if "amct_pytorch.classic.graph_based.amct_pytorch" in modules
        else {},
        "modules": modules,
    }


# --------------------------------------------------------------------------------------------- lookups


class Surface:
    """Resolve dotted names (`torch_npu.profiler._ExperimentalConfig`) in one snapshot."""

    def __init__(self, snap: dict):
        self.snap = snap
        self.modules = snap["modules"]
        self.aliases = snap.get("aliases", {})
        self.delegates = snap.get("getattr_delegates", {})

    def _symbol(self, module: str, name: str, depth: int = 0):
        """→ ("def", entry) | ("module", name) | ("external", target) | (None, None)."""
        if depth > 20:
            return None, None
        mod = self.modules.get(module)
        if mod is None:
            return ("external", f"{module}.{name}") if not self._ours(module) else (None, None)
        entry = mod["symbols"].get(name)
        if entry is None:
            for src in mod.get("star", []):
                kind, found = self._symbol(src, name, depth + 1)
                if kind not in (None, "external") and not name.startswith("_"):
                    return kind, found
            for src in self.delegates.get(module, []):
                kind, found = self._symbol(src, name, depth + 1)
                if kind is not None:
                    return kind, found
            if f"{module}.{name}" in self.modules:
                return "module", f"{module}.{name}"
            if mod.get("dynamic") and module not in self.delegates:  # delegated __getattr__ was followed above
                return "external", f"{module}.{name}"
            return None, None
        if entry["kind"] == "ref":
            target = entry["target"]
            if "from" in entry:  # `from X import n`: X's symbol n first, X's submodule n otherwise
                parent, leaf = entry["from"], target[len(entry["from"]) + 1 :]
                if not self._ours(parent):
                    return "external", target
                if (parent, leaf) != (module, name):  # `from pkg import sub` inside pkg itself: the submodule
                    kind, found = self._symbol(parent, leaf, depth + 1)
                    if kind is not None:
                        return kind, found
                return ("module", target) if target in self.modules else (None, None)
            if target in self.modules:
                return "module", target
            parent, _, leaf = target.rpartition(".")
            if not self._ours(parent) and not self._ours(target):
                return "external", target
            return self._symbol(parent, leaf, depth + 1)
        return "def", entry

    def _ours(self, module: str) -> bool:
        """Described in this snapshot (anything else is "external": not followed, accepted)."""
        return module in self.modules

    def resolve(self, dotted: str):
        """The entry a dotted name denotes: ("def", entry) | ("module", m) | ("op", sig) | ("external", x) |
        ("member", None) | (None, why)."""
        for alias, real in self.aliases.items():
            if dotted == alias or dotted.startswith(alias + "."):
                dotted = real + dotted[len(alias) :]
        parts = dotted.split(".")
        if parts[0] not in {m.split(".")[0] for m in self.modules}:
            return None, f"{parts[0]} is not in this snapshot"
        kind, cur = "module", parts[0]
        for i, part in enumerate(parts[1:], start=1):
            if kind == "module":
                nk, found = self._symbol(cur, part)
                if nk is None and cur == "torch_npu" and part in self.snap.get("ops", {}):
                    nk, found = "op", self.snap["ops"][part]
                if nk is None:
                    return None, f"{'.'.join(parts[:i])} has no attribute {part!r}"
                kind, cur = nk, found
            elif kind == "def" and cur["kind"] == "class":
                if part not in cur["members"]:
                    if cur.get("bases"):
                        return "external", dotted  # may be inherited from a base we do not follow
                    return None, f"{'.'.join(parts[:i])} has no member {part!r}"
                kind, cur = "member", None
            elif kind in ("external", "member"):
                return kind, cur
            else:
                return "external", dotted
        return kind, cur

    def check_call(
        self, dotted: str, n_positional: int, keywords: list[str], has_star_args: bool = False
    ) -> str | None:
        """None when the call matches the signature, else why not."""
        kind, entry = self.resolve(dotted)
        if kind is None:
            return entry
        if kind in ("external", "member", "module"):
            return None
        sig = entry.get("init") if entry.get("kind") == "class" else entry
        if entry.get("kind") == "attribute" or sig is None:
            return None
        allowed = [p for p in sig["params"] if p not in sig.get("posonly", [])] + sig.get("kwonly", [])
        bad = [k for k in keywords if k not in allowed]
        if bad and not sig.get("varkw"):
            return f"{dotted}() has no parameter {', '.join(map(repr, bad))} (parameters: {', '.join(allowed)})"
        if not has_star_args and not sig.get("varargs") and n_positional > len(sig["params"]):
            return f"{dotted}() takes {len(sig['params'])} positional arguments, the call passes {n_positional}"
        return None


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def snapshot_path(package: str, version: str) -> Path:
    return OUT_DIR / f"{package}-{version}.json"


def write(snap: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--amct-git",
        default=os.environ.get("AMCT_GIT_DIR"),
        help="a git directory of hicann/amct (a clone or mirror) to snapshot AMCT from; without it the "
        "committed AMCT snapshots are kept",
    )
    args = p.parse_args(argv)
    if args.amct_git and (problem := amct_git_problem(Path(args.amct_git))):
        print(f"npu-api: {problem}", file=sys.stderr)  # before any download: nothing is rewritten
        return 2
    for version in torch_npu_pins():
        try:
            snap = torch_npu_snapshot(version)
        except DownloadError as e:
            print(f"npu-api: {e}; the committed snapshot stays", file=sys.stderr)
            return 1
        write(snap, snapshot_path("torch_npu", version))
        print(f"npu-api: torch_npu {version}: {len(snap['modules'])} modules, {len(snap['ops'])} ops ({snap['wheel']})")
    if args.amct_git:
        for ref in AMCT_REFS:
            snap = amct_snapshot(Path(args.amct_git), ref)
            write(snap, snapshot_path("amct_pytorch", ref))
            print(f"npu-api: amct_pytorch {ref} ({snap['commit'][:10]}): {len(snap['modules'])} modules")
    else:
        print("npu-api: AMCT snapshots kept (pass --amct-git DIR, a hicann/amct git directory, to refresh)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
