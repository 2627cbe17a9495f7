"""Network pre-flight (env stage, per node): RoCE NICs through hccn_tool, HCCL socket variables against this host's
interfaces, the rendezvous port, HCCL_ALGO / HCCL_BUFFSIZE.

hccn_tool output formats (documented, fixtures in tests/fixtures/env/hccn_tool/ with their sources):
  -link -g        `link status: UP`
  -ip -g          `ipaddr:10.0.0.10` / `netmask:255.255.255.0` (also seen on one line joined by " / ")
  -net_health -g  `net health status: Success` (Success, Socket fail, Receive timeout, Unreachable, Time exceeded,
                  Fault, Init, Thread error, Detect ip set)
  -pfc -g         `PFC configuration:` / `priority   0 1 … 7` / `enabled    0 0 0 0 1 0 0 0`
  -tls -g         `dev_id:0, tls switch[0](0:disable, 1:enable), …`
RoCE matters between nodes (inside an A2 server the cards talk over HCCS), so on one node a bad NIC only warns.
A command that is not on this host is reported as info ("not available on this host"), never as a failure.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
from typing import Callable

from tasks.envcheck import check

HCCN_TOOL_PATHS = ("/usr/local/Ascend/driver/tools/hccn_tool",)
NOT_AVAILABLE = "not available on this host"
QUERIES = ("link", "ip", "net_health", "pfc", "tls")
HEALTH_OK = "Success"
# HCCL_ALGO as documented (HCCL environment-variable reference): level0 (inside a server) only NA; level1 (between
# servers) ring, H-D_R, NHR, NHR_V1, NB, pipeline, pairwise (AlltoAll family only); per-operator form for these ops.
# An unknown name only warns: new CANN releases add algorithms.
LEVEL1_ALGOS = {"ring", "H-D_R", "NHR", "NHR_V1", "NB", "pipeline", "pairwise"}
ALGO_OPS = {"allgather", "reducescatter", "allreduce", "broadcast", "reduce", "scatter", "alltoall"}
HCCL_BUFFSIZE_DEFAULT_MB = 200


def info(name: str, detail: str) -> dict:
    """An informational result: never fails or warns the stage."""
    return {**check(name, "ok", detail), "severity": "info"}


# ------------------------------------------------------------------------------------------------ parsers


def parse_link(text: str) -> str | None:
    m = re.search(r"link status\s*:\s*(\w+)", text or "", re.I)
    return m.group(1).upper() if m else None


def parse_ip(text: str) -> dict:
    ip = re.search(r"ipaddr\s*:\s*([0-9a-fA-F.:]+)", text or "")
    mask = re.search(r"netmask\s*:\s*([0-9.]+)", text or "")
    return {"ipaddr": ip.group(1) if ip else None, "netmask": mask.group(1) if mask else None}


def parse_net_health(text: str) -> str | None:
    m = re.search(r"net health status\s*:\s*(.+)", text or "", re.I)
    return m.group(1).strip() if m else None


def parse_pfc(text: str) -> list[int] | None:
    """Priorities with PFC enabled, from the `priority` / `enabled` rows."""
    prio = re.search(r"^\s*priority\s+([\d ]+)$", text or "", re.M)
    enabled = re.search(r"^\s*enabled\s+([\d ]+)$", text or "", re.M)
    if not prio or not enabled:
        return None
    ps, es = prio.group(1).split(), enabled.group(1).split()
    return [int(p) for p, e in zip(ps, es) if e == "1"]


def parse_tls(text: str) -> int | None:
    m = re.search(r"tls switch\[(\d)\]", text or "")
    return int(m.group(1)) if m else None


PARSERS = {"link": parse_link, "ip": parse_ip, "net_health": parse_net_health, "pfc": parse_pfc, "tls": parse_tls}


# ------------------------------------------------------------------------------------------------ collection


def find_hccn_tool() -> str | None:
    return shutil.which("hccn_tool") or next((p for p in HCCN_TOOL_PATHS if os.access(p, os.X_OK)), None)


def run_hccn(tool: str) -> Callable[[int, str], str | None]:
    """run(device, query) → hccn_tool's text or None; each failure is kept in run.failures ('-i 3 -link: exit 1:
    <first line>') so a tool that fails everywhere is reported with its cause."""
    from tasks.npu_smi import failure

    failures: list[str] = []

    def run(device: int, query: str) -> str | None:
        what = f"-i {device} -{query}"
        try:
            proc = subprocess.run(
                [tool, "-i", str(device), f"-{query}", "-g"], capture_output=True, text=True, timeout=20
            )
        except subprocess.TimeoutExpired:
            failures.append(f"{what}: no answer in 20 s")
            return None
        except OSError as e:
            failures.append(f"{what}: {e.strerror or e}")
            return None
        if proc.returncode != 0:
            failures.append(f"{what}: {failure(proc)}")
            return None
        return (proc.stdout or "") + (proc.stderr or "")

    run.failures = failures
    return run


def collect_nics(devices: list[int], run: Callable[[int, str], str | None]) -> dict[int, dict]:
    """{device: {query: parsed value, "raw": {query: text}}} for every device and documented query."""
    out = {}
    for dev in devices:
        raw = {q: run(dev, q) for q in QUERIES}
        out[dev] = {q: (PARSERS[q](raw[q]) if raw[q] is not None else None) for q in QUERIES}
        out[dev]["raw"] = raw
    return out


# ------------------------------------------------------------------------------------------------ checks


def nic_checks(nics: dict[int, dict], nnodes: int) -> list[dict]:
    """One check per query over all devices; severity 'fail' only when the run spans nodes. A query the installed
    hccn_tool answers on no device (older driver, no RoCE NIC) is info, not a fault."""
    bad = "fail" if nnodes > 1 else "warn"
    scope = "" if nnodes > 1 else " (single node: only inter-node traffic uses RoCE)"
    out = []
    for query, judge in (("link", _link), ("ip", _ip), ("net_health", _health), ("pfc", _pfc), ("tls", _tls)):
        name = f"nic-{query.replace('net_health', 'health')}"
        if all(n.get("raw", {}).get(query) is None and n.get(query) is None for n in nics.values()):
            out.append(info(name, f"hccn_tool -{query} -g gave no answer on any device: {NOT_AVAILABLE}"))
        else:
            out.append(judge(name, nics, bad, scope))
    return out


def _link(name, nics, bad, scope) -> dict:
    down = [d for d, n in nics.items() if n["link"] != "UP"]
    if down:
        return check(
            name,
            bad,
            f"RoCE link not UP on device(s) {down} "
            f"({', '.join(str(nics[d]['link']) for d in down)}){scope}; fix: check "
            "cable/optical module (hccn_tool -i N -optical -g) and the switch port",
        )
    return check(name, "ok", f"link UP on {len(nics)} device(s)")


def _ip(name, nics, bad, scope) -> dict:
    ips = {d: n["ip"] or {} for d, n in nics.items()}
    missing = [d for d, v in ips.items() if not v.get("ipaddr")]
    seen: dict[str, int] = {}
    dup = []
    for d, v in ips.items():
        if v.get("ipaddr") and v["ipaddr"] in seen:
            dup.append(f"{v['ipaddr']} on {seen[v['ipaddr']]} and {d}")
        elif v.get("ipaddr"):
            seen[v["ipaddr"]] = d
    masks = {v.get("netmask") for v in ips.values() if v.get("netmask")}
    if missing or dup:
        what = "; ".join(([f"no IP on device(s) {missing}"] if missing else []) + [f"duplicate IP {x}" for x in dup])
        return check(
            name,
            bad,
            f"{what}{scope}; fix: hccn_tool -i N -ip -s address A.B.C.D netmask M "
            "(one address per card, /etc/hccn.conf)",
        )
    if len(masks) > 1:
        return check(
            name,
            "warn",
            f"devices use different netmasks {sorted(masks)}: cards in one plane normally "
            "share a subnet; fix: hccn_tool -i N -ip -s … netmask M",
        )
    return check(name, "ok", ", ".join(f"{d}:{v['ipaddr']}" for d, v in ips.items()))


def _health(name, nics, bad, scope) -> dict:
    unhealthy = {d: n["net_health"] for d, n in nics.items() if n["net_health"] != HEALTH_OK}
    if not unhealthy:
        return check(name, "ok", f"net health Success on {len(nics)} device(s)")
    only_init = all(v == "Init" for v in unhealthy.values())
    fix = (
        "no detect IP is configured: hccn_tool -i N -netdetect -s address <gateway or peer IP>"
        if only_init
        else "check link, IP and the peer (hccn_tool -i N -ping -g address <peer IP>)"
    )
    return check(
        name,
        "warn" if only_init else bad,
        f"net health not Success on {', '.join(f'{d}: {v}' for d, v in unhealthy.items())}{scope}; fix: {fix}",
    )


def _pfc(name, nics, bad, scope) -> dict:
    pfc = {d: n["pfc"] for d, n in nics.items() if n["pfc"] is not None}
    variants = {tuple(v) for v in pfc.values()}
    if len(variants) > 1:
        seen = ", ".join(f"{d}:{v}" for d, v in pfc.items())
        return check(
            name,
            bad,
            f"PFC priorities differ across devices: {seen}"
            + "; fix: the same PFC priority on every card and on the switch (hccn_tool -i N -pfc -s bitmap …; "
            "the HCCL guide recommends queue 4)",
        )
    if not variants or not next(iter(variants)):
        return check(
            name,
            "warn",
            "PFC disabled on every priority (or unreadable): RoCE without PFC drops under "
            "congestion; fix: enable the switch's lossless priority (queue 4)",
        )
    return check(name, "ok", f"PFC on priority {list(next(iter(variants)))} on every device (must match the switch)")


def _tls(name, nics, bad, scope) -> dict:
    tls = {d: n["tls"] for d, n in nics.items() if n["tls"] is not None}
    if len(set(tls.values())) > 1:
        return check(
            name,
            bad,
            f"TLS switch differs across devices (enabled on {[d for d, v in tls.items() if v]}, "
            f"disabled on {[d for d, v in tls.items() if not v]}): cards with and without TLS "
            f"cannot link{scope}; fix: hccn_tool -i N -tls -s enable 0 (or 1) on every card of "
            "every node",
        )
    if not tls:
        return check(name, "warn", "TLS switch unreadable on every device (hccn_tool -i N -tls -g)")
    return check(name, "ok", f"TLS switch {next(iter(tls.values()))} on every device")


def host_interfaces() -> dict[str, dict[str, list[str]]]:
    """{interface: {"AF_INET": [addresses], "AF_INET6": [...]}} from psutil."""
    import psutil

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        fam = {"AF_INET": [], "AF_INET6": []}
        for a in addrs:
            if a.family == socket.AF_INET:
                fam["AF_INET"].append(a.address)
            elif a.family == socket.AF_INET6:
                fam["AF_INET6"].append(a.address.split("%")[0])
        out[name] = fam
    return out


def match_ifname(spec: str, names: list[str]) -> list[str]:
    """Interfaces HCCL_SOCKET_IFNAME selects. One rule for the whole comma-separated list (HCCL_SOCKET_IFNAME
    reference): `eth,enp` prefixes, `=eth0,enp0` exact names, `^eth,enp` no interface with those prefixes, `^=eth0`
    not those names. HCCL takes the first match."""
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    items = [i.strip() for i in (rest[1:] if exact else rest).split(",") if i.strip()]

    def hit(name: str) -> bool:
        return any(name == i if exact else name.startswith(i) for i in items)

    return [n for n in names if hit(n) != exclude]


def socket_env_checks(env: dict[str, str], interfaces: dict[str, dict[str, list[str]]], kind: str) -> list[dict]:
    """HCCL_IF_IP / HCCL_SOCKET_IFNAME / HCCL_SOCKET_FAMILY against the interfaces of this host."""
    bad = "fail" if kind == "npu" else "warn"
    unused = "" if kind == "npu" else f" (unused on {kind})"
    out = []
    family = (env.get("HCCL_SOCKET_FAMILY") or "").strip()
    if family and family not in ("AF_INET", "AF_INET6"):
        out.append(
            check(
                "hccl-socket-family",
                bad,
                f"HCCL_SOCKET_FAMILY={family!r} must be AF_INET or AF_INET6"
                f"{unused}; fix: export HCCL_SOCKET_FAMILY=AF_INET",
            )
        )
    elif family:
        out.append(check("hccl-socket-family", "ok", f"HCCL_SOCKET_FAMILY={family}"))
    ip = (env.get("HCCL_IF_IP") or "").strip()
    if ip:
        all_addrs = {a: n for n, fams in interfaces.items() for lst in fams.values() for a in lst}
        try:
            parsed = ipaddress.ip_address(ip)
        except ValueError:
            out.append(
                check(
                    "hccl-if-ip",
                    bad,
                    f"HCCL_IF_IP={ip!r} is not an IP address{unused}; fix: set it to "
                    "this host's address on the inter-node network",
                )
            )
        else:
            if ip not in all_addrs:
                out.append(
                    check(
                        "hccl-if-ip",
                        bad,
                        f"HCCL_IF_IP={ip} is not an address of this host (has "
                        f"{', '.join(sorted(a for a in all_addrs if ':' not in a))})"
                        f"{unused}; fix: export HCCL_IF_IP=<this node's IP>",
                    )
                )
            elif family and (parsed.version == 6) != (family == "AF_INET6"):
                out.append(
                    check(
                        "hccl-if-ip",
                        bad,
                        f"HCCL_IF_IP={ip} is IPv{parsed.version} but HCCL_SOCKET_FAMILY={family}; fix: make them agree",
                    )
                )
            else:
                out.append(
                    check(
                        "hccl-if-ip",
                        "ok",
                        f"HCCL_IF_IP={ip} on {all_addrs[ip]}"
                        + ("; it takes precedence over HCCL_SOCKET_IFNAME" if env.get("HCCL_SOCKET_IFNAME") else ""),
                    )
                )
    spec = (env.get("HCCL_SOCKET_IFNAME") or "").strip()
    if spec:
        fam = family or "AF_INET"
        chosen = match_ifname(spec, sorted(interfaces))
        usable = [n for n in chosen if interfaces[n][fam]]
        looks_like_ip = bool(re.fullmatch(r"[\d.]+|[0-9a-fA-F:]+:[0-9a-fA-F:]*", spec))
        if not usable:
            why = " (it looks like an IP address: that belongs in HCCL_IF_IP)" if looks_like_ip else ""
            out.append(
                check(
                    "hccl-socket-ifname",
                    bad,
                    f"HCCL_SOCKET_IFNAME={spec!r} selects no interface with an {fam} address{why}; this "
                    f"host has {', '.join(sorted(interfaces))}{unused}; fix: export HCCL_SOCKET_IFNAME=<nic>",
                )
            )
        else:
            out.append(check("hccl-socket-ifname", "ok", f"HCCL_SOCKET_IFNAME={spec} → {', '.join(usable)}"))
    return out


def algo_checks(env: dict[str, str], kind: str) -> list[dict]:
    """HCCL_ALGO syntax (`level0:NA;level1:H-D_R`, or per operator `alltoall=level0:NA;level1:pairwise/…`) and
    HCCL_BUFFSIZE (MB, integer ≥ 1, default 200)."""
    out = []
    bad = "fail" if kind == "npu" else "warn"
    algo = (env.get("HCCL_ALGO") or "").strip()
    if algo:
        problems, doubts = [], []
        for group in algo.split("/"):
            op, _, body = group.rpartition("=")
            op = op.strip()
            if op and op not in ALGO_OPS:
                doubts.append(f"operator {op!r} is not one of {sorted(ALGO_OPS)}")
            for part in [p for p in body.split(";") if p.strip()]:
                m = re.fullmatch(r"\s*level(\d)\s*:\s*([\w-]+)\s*", part)
                if not m:
                    problems.append(f"{part!r} is not levelN:ALGO")
                elif m.group(1) == "0" and m.group(2) != "NA":
                    problems.append(f"level0:{m.group(2)} (inside a server only NA is supported)")
                elif m.group(1) == "1" and m.group(2) not in LEVEL1_ALGOS:
                    doubts.append(
                        f"level1 algorithm {m.group(2)!r} is not in the documented set {sorted(LEVEL1_ALGOS)}"
                    )
                elif m.group(2) == "pairwise" and op and op != "alltoall":
                    doubts.append(f"pairwise is for the AlltoAll family, not {op}")
        if problems:
            out.append(
                check(
                    "hccl-algo",
                    bad,
                    f"HCCL_ALGO={algo!r}: {'; '.join(problems)}; fix: unset HCCL_ALGO "
                    "(HCCL picks per topology) or write e.g. level0:NA;level1:H-D_R",
                )
            )
        elif doubts:
            out.append(
                check(
                    "hccl-algo",
                    "warn",
                    f"HCCL_ALGO={algo}: {'; '.join(doubts)}; check the CANN version's HCCL_ALGO page",
                )
            )
        else:
            out.append(
                info(
                    "hccl-algo",
                    f"HCCL_ALGO={algo} (it turns off HCCL's adaptive choice; the msprof-analyze "
                    "advisor: leave unset unless measured faster)",
                )
            )
    size = (env.get("HCCL_BUFFSIZE") or "").strip()
    if size:
        if not re.fullmatch(r"\d+", size) or int(size) < 1:
            out.append(
                check(
                    "hccl-buffsize",
                    bad,
                    f"HCCL_BUFFSIZE={size!r} must be an integer number of MB >= 1 "
                    f"(default {HCCL_BUFFSIZE_DEFAULT_MB}); fix: export "
                    f"HCCL_BUFFSIZE={HCCL_BUFFSIZE_DEFAULT_MB}",
                )
            )
        else:
            out.append(
                check(
                    "hccl-buffsize",
                    "ok",
                    f"HCCL_BUFFSIZE={size} MB per communicator, twice that in "
                    f"device memory (send + receive; default "
                    f"{HCCL_BUFFSIZE_DEFAULT_MB})",
                )
            )
    return out


def rendezvous_check(endpoint: str, node_rank: int, nnodes: int) -> dict:
    """Node 0 must be able to listen on the rendezvous port; other nodes must resolve its host. Reaching it across
    nodes is the cross-node probe's job."""
    if nnodes == 1:
        return info(
            "rendezvous",
            "single node: torchrun --standalone picks a free port itself; hardware.rdzv_endpoint is not used",
        )
    from tasks.config import split_endpoint

    try:
        host, port = split_endpoint(endpoint)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (ValueError, socket.gaierror) as e:
        return check(
            "rendezvous",
            "fail",
            f"hardware.rdzv_endpoint {endpoint!r}: {e}; fix: host:port of node 0, resolvable on every node",
        )
    if node_rank != 0:
        return check("rendezvous", "ok", f"{endpoint} resolves to {infos[0][4][0]} (node 0 listens there)")
    local = {a for fams in host_interfaces().values() for lst in fams.values() for a in lst}
    addr = infos[0][4][0]
    bind_to = addr if addr in local or addr.startswith("127.") else "0.0.0.0"
    with socket.socket(infos[0][0] if bind_to != "0.0.0.0" else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore: TIME_WAIT is no conflict
        try:
            s.bind((bind_to, port))
            s.listen(1)
        except OSError as e:
            return check(
                "rendezvous",
                "fail",
                f"cannot listen on {bind_to}:{port} for hardware.rdzv_endpoint "
                f"({e.strerror or e}); fix: free the port (ss -ltnp 'sport = :{port}') "
                "or choose another in hardware.rdzv_endpoint",
            )
    where = "" if bind_to != "0.0.0.0" else f" ({addr} is not an address of this host: check node 0 is this one)"
    return check("rendezvous", "warn" if where else "ok", f"port {port} is free to listen on {bind_to}{where}")


def loopback_check(endpoint: str, node_rank: int, nnodes: int) -> dict | None:
    """Several nodes meeting at a loopback hardware.rdzv_endpoint (127.0.0.1, localhost, ::1): right only when every
    node runs on this one host (a test, a rehearsal); nodes on other hosts reach their own loopback, never node 0, and
    wait at the rendezvous until torchrun gives up (600 s). Warned, not refused: which hosts the nodes are on is not
    known here (the cross-node probe finds out). A host name counts when it is `localhost`, or when it resolves to
    loopback on a node other than 0 (on node 0 itself a name → 127.0.1.1 in /etc/hosts is harmless: it listens on
    every interface)."""
    if nnodes == 1:
        return None
    from tasks.config import split_endpoint

    try:
        host, port = split_endpoint(endpoint)
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:  # a name
            loopback = host.lower().rstrip(".") in ("localhost", "localhost.localdomain")
            if not loopback and node_rank != 0:
                addrs = {a[4][0].split("%")[0] for a in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
                loopback = bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)
    except (ValueError, socket.gaierror):  # rendezvous_check says what is wrong with it
        return None
    if not loopback:
        return None
    return check(
        "rendezvous-loopback",
        "warn",
        f"hardware.rdzv_endpoint {endpoint} is a loopback address with hardware.nnodes {nnodes}: only nodes on this "
        "host reach it (a node on another host waits at its own loopback until torchrun's 600 s rendezvous timeout); "
        "fix: node 0's address as every node reaches it, e.g. 10.0.0.1:29400 (leave it only if all nodes run here)",
    )


def preflight(
    kind: str,
    hardware,
    env: dict[str, str] | None = None,
    devices: list[int] | None = None,
    run: Callable[[int, str], str | None] | None = None,
) -> tuple[dict, list[dict]]:
    """(facts, checks) of the whole network pre-flight. `run(device, query)` returns hccn_tool's text (tests feed
    fixtures through it); by default the installed hccn_tool, or an info check when there is none."""
    env = dict(os.environ if env is None else env)
    facts: dict = {}
    checks: list[dict] = []
    tool = None
    if run is None:
        tool = find_hccn_tool()
        run = run_hccn(tool) if tool else None
    if run is None:
        checks.append(
            info(
                "nic",
                f"hccn_tool {NOT_AVAILABLE}: RoCE NIC checks skipped"
                + (" (expected on NPU hosts: install the Ascend driver tools)" if kind == "npu" else ""),
            )
        )
    elif devices:
        facts["nics"] = collect_nics(devices, run)
        facts["hccn_tool"] = tool or "given"
        if all(raw is None for n in facts["nics"].values() for raw in n["raw"].values()):
            # installed but answering nothing: a broken driver / container without the devices, not "no tool"
            first = (getattr(run, "failures", None) or ["no output"])[0]
            checks.append(
                check(
                    "nic",
                    "warn",
                    f"hccn_tool {facts['hccn_tool']} failed on every device "
                    f"({', '.join(map(str, devices))}; first: {first}): RoCE NIC checks skipped; fix: check the "
                    "driver (npu-smi info, dmesg) and that the devices are visible to this host/container",
                )
            )
        else:
            checks.extend(nic_checks(facts["nics"], hardware.nnodes))
    else:
        checks.append(info("nic", "no NPU devices listed: RoCE NIC checks skipped"))
    interfaces = host_interfaces()
    facts["interfaces"] = {n: f["AF_INET"] + f["AF_INET6"] for n, f in interfaces.items()}
    facts["hccl_socket_env"] = {
        k: env[k]
        for k in ("HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "HCCL_SOCKET_FAMILY", "HCCL_ALGO", "HCCL_BUFFSIZE")
        if env.get(k)
    }
    checks.extend(socket_env_checks(env, interfaces, kind))
    checks.extend(algo_checks(env, kind))
    checks.append(rendezvous_check(hardware.rdzv_endpoint, hardware.node_rank, hardware.nnodes))
    loopback = loopback_check(hardware.rdzv_endpoint, hardware.node_rank, hardware.nnodes)
    checks.extend([loopback] if loopback else [])
    return facts, checks
