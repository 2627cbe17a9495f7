"""The project's calls into torch_npu / torch.npu / amct_pytorch, checked against the real packages' API surface.

tests/fixtures/npu_api/*.json are snapshots of the torch-npu wheels the project pins (requirements-npu.txt,
requirements-npu-amct.txt) and of AMCT's public sources (hicann/amct 8.5.0 and master), written by `make npu-api`
(scripts/npu_api.py, which never installs torch_npu). This test walks the project's code (AST) for every call and
attribute it reaches in those packages and checks that the name and the keyword arguments exist in each supported
version; a second test regenerates the snapshots from the wheels so a stale snapshot cannot hide a change.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = REPO / "tests" / "fixtures" / "npu_api"
SCAN = ("tasks", "data_prep", "dags", "bench", "plugins", "scripts")

_spec = importlib.util.spec_from_file_location("npu_api", REPO / "scripts" / "npu_api.py")
npu_api = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(npu_api)

# Project functions that hand back one of these packages (tasks/device.py, tasks/quant/amct_backend.py).
SOURCES = {
    "import_torch_npu": "torch_npu",
    "_torch_npu": "torch_npu",
    "device_module": "torch.npu",
    "_amct": "amct_pytorch",
}
ROOTS = ("torch_npu", "torch.npu", "amct_pytorch")


class Ref:
    def __init__(self, path, where, call=None):
        self.path, self.where, self.call = path, where, call  # call: (n_positional, keywords, has_star)

    def __repr__(self):
        return f"{self.where}: {self.path}{'()' if self.call else ''}"


def _under(path: str | None) -> bool:
    return bool(path) and any(path == r or path.startswith(r + ".") for r in ROOTS)


class _Walker(ast.NodeVisitor):
    """Follows names bound to the packages (imports, `x = import_torch_npu().profiler`, `mod = device_module(k)`)
    within each scope and records every call and attribute chain that reaches into them."""

    def __init__(self, filename: str):
        self.filename = filename
        self.scopes: list[dict] = [{}]
        self.refs: list[Ref] = []
        self._inner: set[int] = set()

    # -- name resolution
    def resolve(self, node) -> str | None:
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.IfExp):  # `mod = device_module(k) if … else None`
            return self.resolve(node.body) or self.resolve(node.orelse)
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in SOURCES:
                return SOURCES[name]
            if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                base = self.resolve(node.args[0])
                return f"{base}.{node.args[1].value}" if base else None
        return None

    def bind(self, name: str, value: str | None) -> None:
        if value and (_under(value) or value == "torch"):
            self.scopes[-1][name] = value
        else:
            self.scopes[-1].pop(name, None)
            if any(name in s for s in self.scopes[:-1]):
                self.scopes[-1][name] = None  # shadowed locally

    # -- binding statements
    def visit_Import(self, node):
        for a in node.names:
            if a.asname:
                self.bind(a.asname, a.name)
            else:
                self.bind(a.name.split(".")[0], a.name.split(".")[0])

    def visit_ImportFrom(self, node):
        if node.module and not node.level:
            for a in node.names:
                self.bind(a.asname or a.name, f"{node.module}.{a.name}")

    def visit_Assign(self, node):
        self.visit(node.value)
        value = self.resolve(node.value)
        for t in node.targets:
            if isinstance(t, ast.Name):
                self.bind(t.id, value)
            else:
                self.visit(t)

    def _function(self, node):
        for d in node.decorator_list:
            self.visit(d)
        scope = {}
        for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
            scope[a.arg] = None
        self.scopes.append(scope)
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    # -- uses
    def visit_Call(self, node):
        path = self.resolve(node.func)
        if _under(path):
            keywords = [k.arg for k in node.keywords if k.arg]
            has_star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
            self.refs.append(Ref(path, f"{self.filename}:{node.lineno}", (len(node.args), keywords, has_star)))
            self._mark_inner(node.func)
        self.generic_visit(node)

    def _mark_inner(self, node):
        while isinstance(node, ast.Attribute):
            self._inner.add(id(node))
            node = node.value

    def visit_Attribute(self, node):
        if id(node) not in self._inner:
            path = self.resolve(node)
            if _under(path) and path not in ROOTS:
                self.refs.append(Ref(path, f"{self.filename}:{node.lineno}"))
                self._mark_inner(node)
        self.generic_visit(node)


def refs_in_source(source: str, filename: str) -> list[Ref]:
    w = _Walker(filename)
    w.visit(ast.parse(source))
    return w.refs


def project_refs() -> list[Ref]:
    out = []
    for top in SCAN:
        for path in sorted((REPO / top).rglob("*.py")):
            if path.name == "npu_api.py" and path.parent.name == "scripts":
                continue
            out += refs_in_source(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return out


def snapshots(package: str) -> dict[str, "npu_api.Surface"]:
    return {
        p.stem.split("-", 1)[1]: npu_api.Surface(npu_api.load(p)) for p in sorted(SNAPSHOTS.glob(f"{package}-*.json"))
    }


def problems(refs: list[Ref], surfaces: dict) -> list[str]:
    """One line per call site that does not match a version: 'file:line: package version: why'."""
    out = []
    for ref in refs:
        for version, s in surfaces.items():
            pkg = s.snap["package"]
            if ref.call:
                why = s.check_call(ref.path, *ref.call)
            else:
                kind, why = s.resolve(ref.path)
                why = None if kind else why
            if why:
                out.append(f"{ref.where}: {pkg} {version}: {why}")
    return out


def _torch_npu_refs(refs):
    return [r for r in refs if not r.path.startswith("amct_pytorch")]


def test_snapshots_cover_every_pinned_torch_npu():
    pins = npu_api.torch_npu_pins(REPO)
    assert {"2.12.0", "2.7.1.post4"} <= set(pins)
    assert set(snapshots("torch_npu")) == set(pins), "run `make npu-api` after changing the NPU pins"
    assert set(snapshots("amct_pytorch")) == set(npu_api.AMCT_REFS)


def test_walker_finds_the_projects_npu_calls():
    found = {r.path for r in project_refs()}
    for expected in (
        "torch_npu.profiler._ExperimentalConfig",
        "torch_npu.profiler.profile",
        "torch_npu.profiler.schedule",
        "torch_npu.profiler.tensorboard_trace_handler",
        "torch.npu.is_bf16_supported",
        "torch.npu.is_available",
        "amct_pytorch.quantize",
        "amct_pytorch.convert",
        "amct_pytorch.create_quant_config",
        "torch_npu.npu_rms_norm",
        "torch_npu.npu_rotary_mul",
        "torch_npu.npu_swiglu",
    ):
        assert expected in found, (expected, sorted(found))


def test_every_torch_npu_call_exists_in_every_pinned_version():
    surfaces = snapshots("torch_npu")
    bad = problems(_torch_npu_refs(project_refs()), surfaces)
    assert not bad, "calls that do not match the real torch_npu:\n" + "\n".join(bad)


def test_every_amct_call_exists_where_its_flow_is_offered():
    """The LLM flow (quantize/convert) exists in every supported AMCT; classic-flow names may be absent from a release
    (8.5.0 has none), and the project must then gate them on what the installed package exposes."""
    from tasks.quant.amct_backend import FLOW_API

    surfaces = snapshots("amct_pytorch")
    gated = {name for names in FLOW_API.values() for name in names}
    bad = []
    for ref in [r for r in project_refs() if r.path.startswith("amct_pytorch")]:
        have = {v: s for v, s in surfaces.items() if s.resolve(ref.path)[0] is not None}
        if not have:
            bad.append(f"{ref.where}: {ref.path} exists in no supported AMCT ({', '.join(surfaces)})")
            continue
        name = ref.path.split(".")[1]
        if len(have) < len(surfaces) and name not in gated:
            missing = sorted(set(surfaces) - set(have))
            bad.append(
                f"{ref.where}: {ref.path} is missing from AMCT {', '.join(missing)} and is not gated in "
                f"amct_backend.FLOW_API"
            )
        bad += problems([ref], have)
    assert not bad, "calls that do not match the real AMCT:\n" + "\n".join(bad)


def test_a_misspelt_keyword_fails_with_the_call_site():
    source = (
        "from tasks.device import import_torch_npu\n"
        "def f():\n"
        "    prof = import_torch_npu().profiler\n"
        "    return prof._ExperimentalConfig(export_type=prof.ExportType.Text, profiler_levle=1)\n"
    )
    bad = problems(refs_in_source(source, "tasks/example.py"), snapshots("torch_npu"))
    assert bad and all(b.startswith("tasks/example.py:4: torch_npu ") for b in bad)
    assert "has no parameter 'profiler_levle'" in bad[0] and len(bad) == len(snapshots("torch_npu"))
    bad = problems(refs_in_source("import torch\ntorch.npu.is_bf16_supportd()\n", "x.py"), snapshots("torch_npu"))
    assert bad and "has no attribute 'is_bf16_supportd'" in bad[0]


def test_profile_choices_are_real_members():
    """profile.npu_level / aic_metrics values are ProfilerLevel / AiCMetrics members of the newest pinned version
    (older releases lack some: tasks.profiling.collect checks the installed one at run time)."""
    import typing

    from tasks.config import ProfileConfig

    s = snapshots("torch_npu")[npu_api.torch_npu_pins(REPO)[0]]
    for field, cls in (("npu_level", "ProfilerLevel"), ("aic_metrics", "AiCMetrics")):
        values = typing.get_args(ProfileConfig.model_fields[field].annotation)
        assert len(values) >= 4, (field, values)
        for value in values:
            assert s.resolve(f"torch_npu.profiler.{cls}.{value}")[0] == "member", (field, value)


@pytest.mark.parametrize("version", npu_api.torch_npu_pins(REPO))
def test_snapshot_regenerates_from_the_wheel(version):
    """Download the pinned wheel (pip download --no-deps, cached) and rebuild its snapshot: it must equal the
    committed one. Needs PyPI; skipped with the reason when the download fails."""
    try:
        slim = npu_api.slim_wheel(version, timeout=300)
    except npu_api.DownloadError as e:
        pytest.skip(f"torch-npu {version} wheel not downloadable here ({e}); the committed snapshot is unchecked")
    fresh = npu_api.torch_npu_snapshot(version, slim)
    committed = npu_api.load(npu_api.snapshot_path("torch_npu", version))
    assert fresh == committed, f"tests/fixtures/npu_api/torch_npu-{version}.json is stale: run `make npu-api`"


def test_amct_snapshot_regenerates_from_its_sources():
    import os

    git_dir = os.environ.get("AMCT_GIT_DIR")
    if not git_dir or not Path(git_dir).exists():
        pytest.skip(
            "AMCT_GIT_DIR (a hicann/amct git directory) not set: AMCT is not on PyPI, its snapshots are "
            "refreshed by `make npu-api AMCT_GIT_DIR=...`"
        )
    for ref in npu_api.AMCT_REFS:
        committed = npu_api.load(npu_api.snapshot_path("amct_pytorch", ref))
        fresh = npu_api.amct_snapshot(Path(git_dir), committed["commit"])
        fresh["version"] = ref
        assert fresh == committed, f"amct_pytorch-{ref}.json is stale"
