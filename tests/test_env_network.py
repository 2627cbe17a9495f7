"""Network pre-flight: hccn_tool outputs in their documented formats (tests/fixtures/env/hccn_tool, sources in its
README), HCCL socket variables against this host's interfaces, the rendezvous port, HCCL_ALGO / HCCL_BUFFSIZE."""

import socket
from pathlib import Path

import psutil
import pytest

from tasks.config import HardwareConfig
from tasks.envcheck import network

FIX = Path(__file__).parent / "fixtures" / "env" / "hccn_tool"


def feed(per_device: dict[int, dict[str, str]]):
    """run(device, query) answering from fixture files; a query without a file is 'not supported' (None)."""

    def run(dev, query):
        name = per_device[dev].get(query)
        return (FIX / name).read_text() if name else None

    return run


GOOD = {
    0: {
        "link": "link-up.txt",
        "ip": "ip-dev0.txt",
        "net_health": "net_health-success.txt",
        "pfc": "pfc-q4.txt",
        "tls": "tls-dev0-off.txt",
    },
    1: {
        "link": "link-up.txt",
        "ip": "ip-dev1.txt",
        "net_health": "net_health-success.txt",
        "pfc": "pfc-q4.txt",
        "tls": "tls-dev0-off.txt",
    },
}


def by_name(checks):
    return {c["name"]: c for c in checks}


def test_parsers_read_the_documented_formats():
    assert network.parse_link((FIX / "link-up.txt").read_text()) == "UP"
    assert network.parse_link((FIX / "link-down.txt").read_text()) == "DOWN"
    assert network.parse_ip((FIX / "ip-dev0.txt").read_text()) == {"ipaddr": "10.0.0.10", "netmask": "255.255.255.0"}
    assert network.parse_ip((FIX / "ip-oneline.txt").read_text()) == {"ipaddr": "10.0.0.11", "netmask": "255.255.255.0"}
    assert network.parse_net_health((FIX / "net_health-init.txt").read_text()) == "Init"
    assert network.parse_pfc((FIX / "pfc-q4.txt").read_text()) == [4]
    assert network.parse_pfc((FIX / "pfc-q3.txt").read_text()) == [3]
    assert network.parse_tls((FIX / "tls-dev0-off.txt").read_text()) == 0
    assert network.parse_tls((FIX / "tls-dev1-on.txt").read_text()) == 1
    assert network.parse_link("usage: hccn_tool …") is None


def test_healthy_nics_pass_every_check():
    nics = network.collect_nics([0, 1], feed(GOOD))
    checks = by_name(network.nic_checks(nics, nnodes=2))
    assert {n: c["status"] for n, c in checks.items()} == {
        "nic-link": "ok",
        "nic-ip": "ok",
        "nic-health": "ok",
        "nic-pfc": "ok",
        "nic-tls": "ok",
    }
    assert "0:10.0.0.10" in checks["nic-ip"]["detail"] and "[4]" in checks["nic-pfc"]["detail"]


def test_faults_are_named_with_their_fix_and_fail_only_across_nodes():
    bad = {
        0: dict(GOOD[0]),
        1: dict(
            GOOD[1],
            link="link-down.txt",
            ip="ip-dev0.txt",
            net_health="net_health-fault.txt",
            pfc="pfc-q3.txt",
            tls="tls-dev1-on.txt",
        ),
    }
    nics = network.collect_nics([0, 1], feed(bad))
    multi = by_name(network.nic_checks(nics, nnodes=2))
    assert multi["nic-link"]["status"] == "fail" and "device(s) [1]" in multi["nic-link"]["detail"]
    assert "duplicate IP 10.0.0.10 on 0 and 1" in multi["nic-ip"]["detail"]
    assert multi["nic-health"]["status"] == "fail" and "1: Fault" in multi["nic-health"]["detail"]
    assert multi["nic-pfc"]["status"] == "fail" and "queue 4" in multi["nic-pfc"]["detail"]
    assert multi["nic-tls"]["status"] == "fail" and "-tls -s enable 0" in multi["nic-tls"]["detail"]
    single = by_name(network.nic_checks(nics, nnodes=1))
    assert single["nic-link"]["status"] == "warn" and "single node" in single["nic-link"]["detail"]


def test_init_health_only_warns_with_the_netdetect_fix():
    cfg = {d: dict(v, net_health="net_health-init.txt") for d, v in GOOD.items()}
    c = by_name(network.nic_checks(network.collect_nics([0, 1], feed(cfg)), nnodes=2))["nic-health"]
    assert c["status"] == "warn" and "-netdetect -s address" in c["detail"]


def test_no_hccn_tool_is_info_not_failure(monkeypatch):
    monkeypatch.setattr(network, "find_hccn_tool", lambda: None)
    facts, checks = network.preflight("npu", HardwareConfig(), env={}, devices=[0, 1])
    nic = by_name(checks)["nic"]
    assert nic["status"] == "ok" and nic["severity"] == "info" and network.NOT_AVAILABLE in nic["detail"]
    assert "nics" not in facts and facts["interfaces"]


def _lo():
    return next(
        n
        for n, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs)
    )


def test_hccl_socket_variables_against_this_hosts_interfaces():
    ifs = network.host_interfaces()
    lo = _lo()
    ok = by_name(
        network.socket_env_checks(
            {"HCCL_IF_IP": "127.0.0.1", "HCCL_SOCKET_IFNAME": lo, "HCCL_SOCKET_FAMILY": "AF_INET"}, ifs, "npu"
        )
    )
    assert ok["hccl-if-ip"]["status"] == "ok" and lo in ok["hccl-if-ip"]["detail"]
    assert ok["hccl-socket-ifname"]["status"] == "ok" and ok["hccl-socket-family"]["status"] == "ok"
    bad = by_name(
        network.socket_env_checks(
            {"HCCL_IF_IP": "203.0.113.7", "HCCL_SOCKET_IFNAME": "10.0.0.5", "HCCL_SOCKET_FAMILY": "AF_UNIX"}, ifs, "npu"
        )
    )
    assert bad["hccl-if-ip"]["status"] == "fail" and "not an address of this host" in bad["hccl-if-ip"]["detail"]
    assert "belongs in HCCL_IF_IP" in bad["hccl-socket-ifname"]["detail"]
    assert bad["hccl-socket-family"]["status"] == "fail"
    assert network.socket_env_checks({"HCCL_IF_IP": "203.0.113.7"}, ifs, "cpu")[0]["status"] == "warn"


def test_ifname_rules_prefix_exact_and_exclude():
    """The four documented forms (HCCL_SOCKET_IFNAME reference): the prefix applies to the whole list."""
    names = ["eth0", "eth1", "enp189s0f0", "lo"]
    assert network.match_ifname("eth,enp", names) == ["eth0", "eth1", "enp189s0f0"]
    assert network.match_ifname("=eth0,enp0", names) == ["eth0"]
    assert network.match_ifname("^eth,enp", names) == ["lo"]
    assert network.match_ifname("^=eth0,enp0", names) == ["eth1", "enp189s0f0", "lo"]


@pytest.mark.parametrize(
    "env,status,needle",
    [
        ({"HCCL_ALGO": "level0:NA;level1:H-D_R"}, "ok", "leave unset"),
        ({"HCCL_ALGO": "allreduce=level0:NA;level1:ring/alltoall=level0:NA;level1:pairwise"}, "ok", "HCCL_ALGO="),
        ({"HCCL_ALGO": "level1:magic"}, "warn", "not in the documented set"),
        ({"HCCL_ALGO": "allreduce=level0:NA;level1:pairwise"}, "warn", "AlltoAll family"),
        ({"HCCL_ALGO": "allsum=level0:NA;level1:ring"}, "warn", "operator 'allsum'"),
        ({"HCCL_ALGO": "level0:ring;level1:ring"}, "fail", "only NA"),
        ({"HCCL_ALGO": "ring"}, "fail", "is not levelN:ALGO"),
        ({"HCCL_BUFFSIZE": "200"}, "ok", "200 MB"),
        ({"HCCL_BUFFSIZE": "0"}, "fail", "integer number of MB >= 1"),
        ({"HCCL_BUFFSIZE": "1.5G"}, "fail", "export HCCL_BUFFSIZE=200"),
    ],
)
def test_hccl_algo_and_buffsize(env, status, needle):
    (c,) = network.algo_checks(env, "npu")
    assert c["status"] == status and needle in c["detail"]


def test_rendezvous_port_listen_test():
    assert network.rendezvous_check("127.0.0.1:29400", 0, 1)["severity"] == "info"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        c = network.rendezvous_check(f"127.0.0.1:{port}", 0, 2)
        assert c["status"] == "fail" and f"sport = :{port}" in c["detail"]
    free = network.rendezvous_check(f"127.0.0.1:{port}", 0, 2)
    assert free["status"] == "ok", free
    assert network.rendezvous_check("no-such-host.invalid:29400", 1, 2)["status"] == "fail"


def test_env_stage_hook_records_network_facts_and_checks():
    from tasks.stages import env
    from tasks.config import load_config

    cfg = load_config("ci-tiny", sets=["tracking.enabled=false"])
    facts, checks = {}, []
    env._network_checks(cfg, "cpu", facts, checks)
    names = [c["name"] for c in checks]
    assert "rendezvous" in names and facts["network"]["checks"] == checks and facts["network"]["interfaces"]
    assert all(c["status"] == "ok" for c in checks if c.get("severity") == "info")


def test_queries_the_tool_does_not_answer_are_info():
    old_driver = {d: {"link": v["link"], "ip": v["ip"]} for d, v in GOOD.items()}  # no net_health/pfc/tls answer
    checks = by_name(network.nic_checks(network.collect_nics([0, 1], feed(old_driver)), nnodes=2))
    assert checks["nic-link"]["status"] == "ok" and checks["nic-ip"]["status"] == "ok"
    for name in ("nic-health", "nic-pfc", "nic-tls"):
        assert checks[name]["severity"] == "info" and network.NOT_AVAILABLE in checks[name]["detail"]
