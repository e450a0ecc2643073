"""Ray nodes for tests: started with a temporary folder of their own, found and stopped by it, and
the sockets their processes listen on."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from tests.inference_fixtures import BASE, internal_headers
from tests.processes import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def ready_replicas(serve_url: str) -> int:
    """The Ray Serve application's ready replicas of the base model (-1 while it does not answer)."""
    try:
        health = httpx.get(f"{serve_url}/health", headers=internal_headers(), timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return -1
    return health["models"][BASE]["ready_replicas"]


def ray_folder() -> Path:
    """A node's temporary folder: short, because Ray's socket paths under it must fit 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))


@contextmanager
def ray_node(arguments: list[str], environment: dict[str, str]) -> Iterator[Path]:
    """``ray start`` with a temporary folder of its own (a host's); stops that node's processes only."""
    folder = ray_folder()
    command = [RAY, "start", *arguments, f"--temp-dir={folder}", "--disable-usage-stats"]
    try:
        subprocess.run(command, env={**os.environ, **environment}, check=True, capture_output=True, timeout=120)
        yield folder
    finally:
        stop_node(folder)


def node_processes(folder: Path) -> list[psutil.Process]:
    """The processes started for the node whose temporary folder is ``folder``, and theirs."""
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        if process.pid == os.getpid():  # named the folder itself
            continue
        if any(str(folder) in part for part in process.info["cmdline"] or []):
            found[process.pid] = process
            try:
                found.update((child.pid, child) for child in process.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return list(found.values())


def stop_node(folder: Path, also: Iterable[psutil.Process] = ()) -> None:
    """Every process of the node whose temporary folder is ``folder`` (and ``also``), killed as a
    host that dies, the replicas' vLLM servers with them; then the folder."""
    doomed = []
    for process in [*node_processes(folder), *also]:
        try:
            doomed += [*process.children(recursive=True), process]
        except psutil.NoSuchProcess:
            pass
    for process in doomed:
        try:
            process.kill()  # psutil checks that the pid is still that process
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(doomed, timeout=10)
    shutil.rmtree(folder, ignore_errors=True)


def worker_node_arguments(head_port: int) -> list[str]:
    """A second node on the same machine: ports of its own for what the head took the defaults of."""
    return [
        f"--address=127.0.0.1:{head_port}", "--num-cpus=1", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}", f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
    ]


@dataclass(frozen=True)
class Listener:
    process: str
    address: str
    port: int
    protocol: str

    def __str__(self) -> str:
        return f"{self.process} {self.protocol} {self.address}:{self.port}"

    @property
    def on_loopback(self) -> bool:
        address = ipaddress.ip_address(self.address)
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket's IPv4 loopback
        return (mapped or address).is_loopback


def listeners(processes: Iterable[psutil.Process]) -> list[Listener]:
    """Every TCP socket listening, and every UDP socket bound without a peer, of ``processes``."""
    found = []
    for process in processes:
        try:
            name = process.name()
            for connection in process.net_connections(kind="inet"):
                tcp = connection.type == socket.SOCK_STREAM
                if (tcp and connection.status == psutil.CONN_LISTEN) or (not tcp and not connection.raddr):
                    found.append(Listener(name, connection.laddr.ip, connection.laddr.port, "tcp" if tcp else "udp"))
        except psutil.NoSuchProcess:
            continue
    return found
