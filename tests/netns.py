"""Separate hosts on one machine, for tests: a network, mount and UTS namespace per host.

:class:`Hosts` makes a Linux bridge in the root namespace (``10.77.X.1/24``,
``X`` picked per instance) and, per host, a network namespace joined to it by
a veth pair, with address ``10.77.X.N``. Each process started on a host also
gets a private mount namespace with its own ``/dev/shm`` (a fresh tmpfs) and
its own hostname, so kvpool's host id differs from every other host's and a
client on another host cannot map a node's arena: it must use the network.
:meth:`Host.link` cuts or restores a host's link (``ip link set ... down``);
:meth:`Host.block` drops only what the host sends to one TCP address and port
(a policy-routing rule in its namespace), leaving the rest of its network up.

Needs root and iproute2 (tests/run.sh installs it). Without them the
harness fails loudly: a test that cannot make its hosts errors, never skips.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from pathlib import Path


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


class Host:
    """One namespace host: its ``name``, ``address``, and the processes started on it."""

    def __init__(self, hosts: Hosts, name: str, number: int):
        self.name = name
        self.ns = f"kvp{hosts.tag}{name}"
        self.address = f"{hosts.prefix}.{number}"
        self.veth = f"kv{hosts.tag}{name}"[:15]  # the root-namespace end (interface names: 15 characters at most)
        self.procs: list[subprocess.Popen] = []
        inner = f"kv{hosts.tag}{name}i"[:15]
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.ns)
        _ip("link", "set", self.veth, "master", hosts.bridge, "up")
        _ip("-n", self.ns, "addr", "add", f"{self.address}/24", "dev", inner)
        _ip("-n", self.ns, "link", "set", inner, "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def popen(self, args: list[str], log: Path, shm_bytes: int = 1 << 30) -> subprocess.Popen:
        """Run ``args`` on this host: in its network namespace, with a private /dev/shm and hostname."""
        setup = f"mount -t tmpfs -o size={shm_bytes} tmpfs /dev/shm && hostname {self.name} && exec \"$@\""
        command = ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--propagation", "private",
                   "sh", "-c", setup, "sh", *args]
        proc = subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``args`` on this host to completion; its output captured."""
        setup = "mount -t tmpfs -o size=64m tmpfs /dev/shm && hostname " + self.name + " && exec \"$@\""
        command = ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--propagation", "private",
                   "sh", "-c", setup, "sh", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    def link(self, up: bool) -> None:
        """Restore or cut this host's only link (its veth's root-namespace end)."""
        _ip("link", "set", self.veth, "up" if up else "down")

    def block(self, address: str, port: int, blocked: bool = True) -> None:
        """Drop (or stop dropping) every TCP packet this host sends to ``address:port``, open connections too."""
        _ip("-n", self.ns, "rule", "add" if blocked else "del", "to", f"{address}/32", "ipproto", "tcp", "dport",
            str(port), "blackhole")


class Hosts:
    """A bridge and namespace hosts on it; :meth:`close` stops every process and removes them all."""

    def __init__(self) -> None:
        assert os.geteuid() == 0, "the multi-host tests need root (network namespaces)"
        assert shutil.which("ip") and shutil.which("unshare"), \
            "the multi-host tests need iproute2 and util-linux (tests/run.sh installs them)"
        self.tag = uuid.uuid4().hex[:4]
        self.prefix = f"10.77.{random.randrange(2, 250)}"
        self.bridge = f"kvbr{self.tag}"
        self.gateway = f"{self.prefix}.1"  # the root namespace's address on the bridge (etcd listens here)
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        host = self.hosts[name] = Host(self, name, len(self.hosts) + 2)
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in host.procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(15)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
