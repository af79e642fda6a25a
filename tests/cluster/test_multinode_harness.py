"""The set-up and tear-down of tests/cluster/test_multinode.py's network namespace, driven
with a fake `ip` (no root, no kernel state): whatever stops the building, nothing it made
stays on the machine."""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Callable

import pytest
import test_multinode as mn


class FakeIp:
    """`ip` as the harness calls it, on a machine of its own: namespaces, veth pairs (each end
    in the host or a namespace) and the host's addresses. `interrupt(cmd)` may raise before a
    command runs, as Ctrl-C or a timeout would."""

    def __init__(self, interrupt: Callable[[tuple[str, ...]], None] = lambda cmd: None) -> None:
        self.interrupt = interrupt
        self.namespaces: set[str] = set()
        self.links: dict[str, str | None] = {}  # name -> namespace (None: the host)
        self.peers: dict[str, str] = {}
        self.host_addrs: dict[str, str] = {}  # host link -> address/prefix

    def __call__(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.interrupt(cmd)
        rc, out = self._do(list(cmd[1:]))
        if check and rc:
            raise subprocess.CalledProcessError(rc, cmd, out, "RTNETLINK answers: File exists")
        return subprocess.CompletedProcess(cmd, rc, out, "")

    def _del_link(self, name: str) -> None:
        for end in (name, self.peers.pop(name, "")):
            self.links.pop(end, None)
            self.host_addrs.pop(end, None)
            self.peers.pop(end, None)

    def _do(self, a: list[str]) -> tuple[int, str]:
        match a:
            case ["netns", "add", name]:
                if name in self.namespaces:
                    return 1, ""
                self.namespaces.add(name)
            case ["netns", "del", name]:
                if name not in self.namespaces:
                    return 1, ""
                self.namespaces.discard(name)
                for link in [k for k, ns in self.links.items() if ns == name]:
                    self._del_link(link)  # a veth end dies with its namespace, and takes its peer
            case ["netns", "exec", name, "ip", *_]:
                return (0, "") if name in self.namespaces else (1, "")
            case ["link", "add", veth, "type", "veth", "peer", "name", peer]:
                if veth in self.links or peer in self.links:
                    return 2, ""
                self.links |= {veth: None, peer: None}
                self.peers |= {veth: peer, peer: veth}
            case ["link", "set", link, "netns", name]:
                self.links[link] = name
            case ["link", "set", link, "up"]:
                return (0, "") if self.links.get(link, "gone") is None else (1, "")
            case ["addr", "add", cidr, "dev", link]:
                self.host_addrs[link] = cidr
            case ["link", "show", link]:
                return (0, link) if self.links.get(link, "gone") is None else (1, "")
            case ["link", "del", link]:
                if link not in self.links:
                    return 1, ""
                self._del_link(link)
            case ["-4", "-o", "addr", "show"]:
                return 0, "".join(f"9: {link}    inet {cidr} scope global {link}\\       valid_lft forever\n"
                                  for link, cidr in self.host_addrs.items())
            case _:
                raise AssertionError(f"the fake does not know `ip {' '.join(a)}`")
        return 0, ""


def _stop_at(step: str, exc: BaseException) -> Callable[[tuple[str, ...]], None]:
    def interrupt(cmd: tuple[str, ...]) -> None:
        if step in " ".join(cmd):
            raise exc
    return interrupt


TIMEOUT_FAILURE = pytest.fail.Exception("Timeout >1200.0s")  # what pytest-timeout raises in the test


@pytest.mark.parametrize("step", ["link add", "addr add 198.18.0.1", "lo up"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), subprocess.TimeoutExpired("ip", 30), TIMEOUT_FAILURE],
                         ids=["ctrl-c", "ip-timeout", "pytest-timeout"])
def test_a_namespace_stopped_while_building_leaves_nothing(monkeypatch: pytest.MonkeyPatch, step: str,
                                                           exc: BaseException) -> None:
    ip = FakeIp(_stop_at(step, exc))
    monkeypatch.setattr(mn, "_run", ip)
    with pytest.raises(type(exc)), mn._netns("pdserve-mn-t", "pdmnth", "198.18.0.1", "198.18.0.2"):
        pass
    assert (ip.namespaces, ip.links, ip.host_addrs) == (set(), {}, {})


@pytest.mark.parametrize("other_pid", [1000, 1000 + 2 ** 15], ids=["same-pid-other-pid-namespace", "pid-2**15-apart"])
def test_two_runs_at_once_share_no_name_or_address(monkeypatch: pytest.MonkeyPatch, other_pid: int) -> None:
    """Two runs on one machine's network: a run in another pid namespace (a container on the
    host's network) may have this run's pid, and pids past 2**15 (pid_max is 4194304 on most
    64-bit systems) fold onto the 2**15 /30s of 198.18.0.0/15."""
    ip = FakeIp()
    monkeypatch.setattr(mn, "_run", ip)
    monkeypatch.setattr(mn.os, "getpid", lambda: 1000)
    (netns, veth), (head_ip, node_ip) = mn._names(), mn._subnet()
    with mn._netns(netns, veth, head_ip, node_ip):
        monkeypatch.setattr(mn.os, "getpid", lambda: other_pid)
        (netns2, veth2), (head_ip2, node_ip2) = mn._names(), mn._subnet()
        assert netns2 != netns and veth2[:-1] != veth[:-1]  # the peer is the name but its last letter
        assert {head_ip2, node_ip2}.isdisjoint({head_ip, node_ip}), "the second run's /30 is the first's"
        assert len(veth2) <= 15  # IFNAMSIZ
        with mn._netns(netns2, veth2, head_ip2, node_ip2):
            assert len(ip.namespaces) == 2
    assert (ip.namespaces, ip.links) == (set(), {})


def test_a_subnet_in_use_on_the_machine_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every /30 of 198.18.0.0/15 but one holds an address here (another run's, a leftover of a
    killed one): the run takes the free one."""
    ip = FakeIp()
    base, free = ipaddress.IPv4Address("198.18.0.0"), 12345
    ip.host_addrs = {f"x{k}": f"{base + 4 * k + 1 + k % 3}/30" for k in range(2 ** 15) if k != free}
    monkeypatch.setattr(mn, "_run", ip)
    assert mn._subnet() == (str(base + 4 * free + 1), str(base + 4 * free + 2))
    ip.host_addrs["last"] = f"{base + 4 * free + 3}/30"
    with pytest.raises(pytest.skip.Exception, match="no /30 of 198.18.0.0/15"):
        mn._subnet()
