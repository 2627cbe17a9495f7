"""Environment validation: versions and their compatibility, devices, a real collective probe, host checks.

Writes <run-dir>/env/env.json (every fact and a list of checks, each ok|warn|fail with a one-line detail; the
runner's <run-dir>/env.json is the small result), prints a short summary to stderr, logs params, metrics and
env.json to the stage's MLflow run. Any failed check fails the stage with the first failure as its one-line cause;
warnings don't fail.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tasks import device, npu_smi, tracking
from tasks.config import PipelineConfig, repo_path
from tasks.envcheck import check, compat, npu_health, probe, system, versions, worst
from tasks.errors import ConfigError, StageError
from tasks.fsutil import atomic_write_json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-probe", action="store_true", help="skip the torchrun collective probe")
    parser.add_argument(
        "--ascend-root",
        default=None,
        help=f"Ascend install root holding driver/, firmware/ and the CANN toolkit "
        f"(default {versions.DEFAULT_ASCEND_ROOT}; $ASCEND_HOME_PATH is searched first)",
    )


def _device_facts(backend: device.Backend) -> list[dict]:
    """Name and memory of each visible accelerator (CPU: the host facts say it all)."""
    mod = device.device_module(backend.kind)
    if mod is None:
        return []
    return [
        {
            "index": i,
            "name": mod.get_device_name(i),
            "memory_gb": round(mod.get_device_properties(i).total_memory / system.GB, 2),
        }
        for i in range(backend.device_count)
    ]


def _backend_checks(cfg: PipelineConfig, facts: dict, checks: list) -> device.Backend | None:
    try:
        backend = device.detect(cfg.hardware.device)
    except device.BackendUnavailable as e:
        checks.append(check("backend", "fail", str(e)))
        return None
    facts["backend"] = {
        "kind": backend.kind,
        "dist_backend": backend.dist_backend,
        "device_count": backend.device_count,
    }
    facts["devices"] = _device_facts(backend)
    chips = (facts.get("npu_smi") or {}).get("chips", [])
    installed = facts["versions"].get("torch_npu")
    if installed and backend.kind != "npu":
        try:  # with TORCH_DEVICE_BACKEND_AUTOLOAD=0 torch imports fine and only this says why the NPUs are unused
            device.import_torch_npu()
            why = "torch_npu imports but sees no NPU"
        except device.BackendUnavailable as e:
            why = str(e)
        checks.append(
            check("backend", "warn", f"torch_npu {installed} is installed but the backend is {backend.kind}: {why}")
        )
    elif chips and backend.kind != "npu":
        checks.append(
            check(
                "backend",
                "warn",
                f"npu-smi lists {len(chips)} NPU chips but the backend is "
                f"{backend.kind}: torch_npu is missing or hardware.device excludes it",
            )
        )
    else:
        unit = "cores" if backend.kind == "cpu" else "devices"
        checks.append(check("backend", "ok", f"{backend.kind} ({backend.dist_backend}), {backend.device_count} {unit}"))
    return backend


def _system_checks(cfg: PipelineConfig, ctx, backend: device.Backend | None, facts: dict, checks: list) -> None:
    """Host checks; those about devices need a backend (none when torch itself fails to import)."""
    hw = cfg.hardware
    kind = backend.kind if backend else ("npu" if facts["versions"].get("torch_npu") else hw.device)
    host = facts["host"] = system.host_facts()
    clock = facts["clock"] = system.clock_status()
    checks.append(system.check_clock(clock, hw.nnodes, hw.max_clock_offset_ms, hw.warn_clock_offset_ms))
    hccl = dict(device.hccl_env(hw))
    if os.environ.get("HCCL_EVENT_TIMEOUT"):
        hccl["HCCL_EVENT_TIMEOUT"] = os.environ["HCCL_EVENT_TIMEOUT"]
    facts["hccl_env"] = hccl
    mode = facts["hccl_op_expansion_mode"] = os.environ.get("HCCL_OP_EXPANSION_MODE")
    checks.append(system.check_hccl(hccl, kind, cfg.train.timeout_s, mode))
    if backend:
        var = device.visible_devices_env(kind)
        chips = (facts.get("npu_smi") or {}).get("chips")
        checks.append(
            system.check_visible(
                kind,
                var,
                os.environ.get(var) if var else None,
                backend.device_count,
                hw.nproc_per_node,
                len(chips) if chips and kind == "npu" else None,
            )
        )
    checks.extend(filter(None, [_device_memory_check(cfg, facts)]))
    checks.append(system.check_host_memory(host["memory_available_gb"], host["memory_total_gb"], hw.min_host_memory_gb))
    disk_check, facts["free_disk_gb"] = system.check_disk(
        {"shards": repo_path(cfg.data.out_dir), "checkpoints": ctx.run_dir}, hw.min_free_disk_gb
    )
    checks.append(disk_check)
    _network_checks(cfg, kind, facts, checks)


def _device_memory_check(cfg: PipelineConfig, facts: dict) -> dict | None:
    """The measured per-device memory (npu-smi's HBM total; torch's total_memory on CUDA) against the figure the plan,
    smoke and rehearsal size with: hardware.device_memory_gb, else hardware.cluster's preset (tasks/planner/cluster.py,
    as tasks/stages/plan.py and tasks/model/sibling.py read it). Only for an accelerator cluster: a CPU preset's
    figure is host memory per rank, not a device's."""
    from tasks.planner.cluster import PRESETS

    hw = cfg.hardware
    preset = PRESETS.get(hw.cluster)
    if preset is None or preset.kind == "cpu":
        return None
    measured = system.measured_device_memory(preset.kind, facts)
    sizing = hw.device_memory_gb or preset.memory_gb
    source = "hardware.device_memory_gb" if hw.device_memory_gb else f"hardware.cluster {hw.cluster}'s preset memory"
    if measured is not None:
        facts["device_memory"] = {"measured_gb": measured["gb"], "measured": measured["source"], "sizing_gb": sizing}
    return system.check_device_memory(measured, sizing, source)


def _network_checks(cfg: PipelineConfig, kind: str, facts: dict, checks: list) -> None:
    """RoCE NICs (hccn_tool), HCCL socket variables vs this host, rendezvous port, HCCL_ALGO / HCCL_BUFFSIZE."""
    from tasks.envcheck import network

    chips = (facts.get("npu_smi") or {}).get("chips") or []
    facts["network"], net_checks = network.preflight(kind, cfg.hardware, devices=nic_devices(chips))
    facts["network"]["checks"] = net_checks
    checks.extend(net_checks)
    tracking.log_json_artifact(facts["network"], "env/network.json")
    tracking.log_metrics(
        {f"env.network.checks_{s}": sum(c["status"] == s for c in net_checks) for s in ("ok", "warn", "fail")}
    )


def nic_devices(chips: list[dict]) -> list[int]:
    """The device ids hccn_tool -i takes, for the chips npu-smi lists: the chip's Phy-ID / Device column when npu-smi
    prints one (A3/910C, 310B), else the NPU id; a host that sees only NPU 3 asks about device 3, not 0."""
    ids = [c["device_id"] if c.get("device_id") is not None else c["npu"] for c in chips]
    return list(dict.fromkeys(ids))


def probe_sizes(cfg: PipelineConfig) -> list[float]:
    sizes = cfg.hardware.probe_sizes_mb
    try:
        out = [float(s) for s in sizes]
    except (TypeError, ValueError):
        out = []
    if len(out) != len(sizes) or any(s <= 0 for s in out):
        raise ConfigError(f"hardware.probe_sizes_mb: {sizes!r} must be positive message sizes in MB")
    return out


def check_eval_tasks(cfg: PipelineConfig, lm_eval_tasks: bool = True) -> None:
    """evaluate.tasks refused at the run's first task: a YAML path naming no file or a name lm-eval's task index does
    not know (tasks.harness.suite.check_names: the lines the shard stage's full load gives, there only after
    tokenizing). Costs lm-eval's index (about 7 s of CPU) only for a name no listed YAML's folder defines;
    `lm_eval_tasks` False: those folders' tasks only."""
    from tasks.harness.suite import check_names

    check_names(list(cfg.evaluate.tasks), defaults=lm_eval_tasks)


def _probe(cfg: PipelineConfig, ctx, backend: device.Backend, facts: dict, checks: list) -> None:
    if getattr(ctx.args, "no_probe", False) or not cfg.hardware.collective_probe:
        how = "--no-probe" if getattr(ctx.args, "no_probe", False) else "hardware.collective_probe false"
        checks.append(check("allreduce", "warn", f"collective probe skipped ({how})"))
        return
    if any(c["status"] == "fail" for c in checks):
        checks.append(check("allreduce", "warn", "collective probe skipped: an earlier check failed"))
        return
    from tasks.launch.torchrun import launcher

    nproc = cfg.hardware.nproc_per_node or (backend.device_count if backend.is_accelerator else 2)
    if cfg.hardware.nnodes > 1:  # every node, through the rendezvous training will use (tasks/envcheck/crossnode.py)
        from tasks.envcheck import crossnode

        result = crossnode.run(
            backend.kind,
            nproc,
            cfg.hardware,
            probe_sizes(cfg),
            ctx.run_dir,
            rdzv_id=f"{ctx.run_dir.name}-env",
            join_timeout_s=cfg.timeouts.rendezvous_s,
            env_extra=device.launch_env(backend, cfg.hardware),
            launcher=launcher(backend.kind),  # the ranks start as training's do (forked on CPU)
        )
        facts["probe"] = result
        if "error" not in result:
            checks.extend(probe.judge(result, backend.kind, *probe.expected_bus(backend.kind, cfg.hardware)))
        checks.extend(crossnode.judge(result, cfg.hardware))
        return
    result = probe.run(
        backend.kind,
        nproc,
        probe_sizes(cfg),
        ctx.run_dir / "env" / "probe.json",
        env_extra=device.launch_env(backend, cfg.hardware),
        launcher=launcher(backend.kind),  # the ranks start as training's do (forked on CPU)
    )
    facts["probe"] = result
    checks.extend(probe.judge(result, backend.kind, *probe.expected_bus(backend.kind, cfg.hardware)))


def _summary(facts: dict) -> str:
    """One line: '<kind> ×<ranks>, torch X, all_reduce ok 1.4 GB/s' (the end-of-run table's key figure)."""
    v, b, p = facts["versions"], facts.get("backend"), facts.get("probe") or {}
    parts = [
        f"{b['kind']} ×{p.get('world_size', b['device_count'])}" if b else "no backend",
        f"torch {compat.base_version(v.get('torch') or '?')}",
    ]
    if v.get("torch_npu"):
        parts.append(f"torch_npu {v['torch_npu']}, CANN {(v.get('cann') or {}).get('version', '?')}")
    if p.get("sizes") and p.get("world_size") == 1:
        parts.append(f"all_reduce {'ok' if p['allreduce_ok'] else 'WRONG'} on one rank (no link measured)")
    elif p.get("sizes"):
        best = max(s["busbw_gbps"] for s in p["sizes"])
        parts.append(f"all_reduce {'ok' if p['allreduce_ok'] else 'WRONG'} {best:.1f} GB/s")
    return ", ".join(parts)


def _log(facts: dict, checks: list[dict], path) -> None:
    v = facts["versions"]
    b = facts.get("backend") or {}
    tracking.log_params(
        {
            "env.python": v["python"],
            "env.torch": v.get("torch"),
            "env.torch_npu": v.get("torch_npu"),
            "env.cann": (v.get("cann") or {}).get("version"),
            "env.driver": (v.get("driver") or {}).get("version"),
            "env.firmware": (v.get("firmware") or {}).get("version"),
            "env.backend": b.get("kind"),
            "env.device_count": b.get("device_count"),
        }
    )
    metrics = {f"env.checks_{s}": sum(c["status"] == s for c in checks) for s in ("ok", "warn", "fail")}
    for s in (facts.get("probe") or {}).get("sizes", []):
        metrics[f"env.busbw_gbps.{s['size_mb']:g}mb"] = s["busbw_gbps"]
    if (facts.get("clock") or {}).get("offset_ms") is not None:
        metrics["env.clock_offset_ms"] = facts["clock"]["offset_ms"]
    for label, gb in (facts.get("free_disk_gb") or {}).items():
        metrics[f"env.free_disk_gb.{label}"] = gb
    if facts.get("host"):
        metrics["env.host_memory_available_gb"] = facts["host"]["memory_available_gb"]
    tracking.log_metrics(metrics)
    tracking.log_artifact(path)


def check_ascend_root(given: str) -> None:
    """An --ascend-root that exists but holds no Ascend install (a toolkit directory, /usr/local) would read as "no
    Ascend software installed": refused in one line, naming the root to give instead."""
    root = Path(given).absolute()
    if any(d.is_dir() for d in versions.install_dirs(root)):
        return
    if list(root.glob("*-linux/ascend_toolkit_install.info")) or (root / "set_env.sh").is_file():
        parent = root.parent.parent if root.parent.name == "ascend-toolkit" else root.parent
        raise ConfigError(
            f"--ascend-root {given} is a CANN toolkit directory, not the Ascend install root: pass the root above "
            f"it (--ascend-root {parent}) or set ASCEND_HOME_PATH={given}"
        )
    raise ConfigError(
        f"--ascend-root {given} holds no Ascend install (none of driver/, firmware/, ascend-toolkit/latest, cann, "
        f"cann-*): give the Ascend install root (default {versions.DEFAULT_ASCEND_ROOT}) or leave the flag out"
    )


def run(cfg: PipelineConfig, ctx) -> dict:
    probe_sizes(cfg)  # a bad value fails now, not after the slow checks
    check_eval_tasks(cfg)  # a mistyped evaluate.tasks entry: now, not at shard
    given = getattr(ctx.args, "ascend_root", None)
    if given and not os.path.isdir(given):  # a mistyped root would read as "no CANN here": said, not a warning
        raise ConfigError(
            f"--ascend-root {given} is not a directory; give the Ascend install root (the one holding driver/ and "
            f"the CANN toolkit, default {versions.DEFAULT_ASCEND_ROOT}) or leave the flag out"
        )
    if given:
        check_ascend_root(given)
    root = given or versions.DEFAULT_ASCEND_ROOT
    facts: dict = {"versions": versions.collect(root, os.environ.get("ASCEND_HOME_PATH"))}
    checks = compat.version_checks(facts["versions"])
    imp = facts["import_torch"] = versions.import_torch_status()
    checks.append(
        check("import-torch", "ok", f"torch {imp['torch']} imports")
        if imp["ok"]
        else check("import-torch", "fail", f"{imp['cause']}; fix: {imp['fix']}" if imp["fix"] else imp["cause"])
    )
    text = npu_smi.run()
    if text:
        facts["npu_smi"] = npu_smi.parse(text)
        checks.extend(npu_health.checks(facts["npu_smi"]))
    backend = _backend_checks(cfg, facts, checks) if imp["ok"] else None
    _system_checks(cfg, ctx, backend, facts, checks)
    if backend is not None:
        _probe(cfg, ctx, backend, facts, checks)

    status = worst(checks)
    summary = _summary(facts)
    report = {"status": status, "summary": summary, "checks": checks, **facts}
    path = atomic_write_json(ctx.run_dir / "env" / "env.json", report)
    print(f"env: {status.upper()} — {summary}", file=sys.stderr)
    for c in checks:
        print(f"  [{c.get('severity', c['status']):>4}] {c['name']}: {c['detail']}", file=sys.stderr)
    _log(facts, checks, path)

    failed = [c for c in checks if c["status"] == "fail"]
    if failed:
        more = f" (+{len(failed) - 1} more failed checks in {path})" if len(failed) > 1 else ""
        raise StageError(f"{failed[0]['name']}: {failed[0]['detail']}{more}")
    b = facts["backend"]
    return {
        "status": status,
        "summary": summary,
        "env_json": str(path),
        "backend": b["kind"],
        "device_count": b["device_count"],
        "warnings": [c["name"] for c in checks if c["status"] == "warn"],
    }
