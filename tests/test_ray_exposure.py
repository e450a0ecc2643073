"""Who can reach Ray: whoever reaches its GCS, raylets or workers can run code as the platform.

- ``python -m inference.ray_serve`` on one host (as bin/run starts it) listens on loopback only:
  every socket of every Ray process it starts, Serve's HTTP proxy included;
- a Ray head started with token authentication, as the README starts one, refuses a caller
  without the cluster's token, and ``inference.ray_serve`` presents the token when it joins (and
  says what to fix when it has none, or another);
- ``inference.ray_serve`` refuses to run Ray without token authentication.

The Ray tests start Ray (no vLLM engine: a model scaled to zero, or no Serve at all), so they run
once per test command (marker ``fault``, like the other tests that start real processes to attack
them), not again on SQLite: they read and write no database. Run them alone with
``bin/test tests/test_ray_exposure.py -s`` (``-s`` prints the sockets found).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from core.env import ConfigError
from inference.ray_serve.cluster import make_private_token, prepare_environment
from tests.inference_fixtures import catalog_text, internal_headers
from tests.processes import ROOT, answers, free_port, running, wait_until
from tests.ray_nodes import listeners, node_processes, ray_folder, ray_node, stop_node

START_S = 55  # each test stays under a minute, start-up included


# --- without Ray ----------------------------------------------------------------------------------


def test_ray_runs_with_token_authentication_unless_told_otherwise_and_never_without_it():
    environment: dict[str, str] = {"RAY_ADDRESS": "10.0.0.5:6380"}
    prepare_environment(environment)
    assert environment["RAY_AUTH_MODE"] == "token"  # the processes Ray starts inherit it
    prepare_environment({"RAY_AUTH_MODE": "TOKEN"})
    for mode in ("disabled", "", "k8s"):
        with pytest.raises(ConfigError, match="RAY_AUTH_MODE.*unset RAY_AUTH_MODE or set it to token"):
            prepare_environment({"RAY_AUTH_MODE": mode})


def test_a_ray_of_one_host_stays_on_loopback_and_a_cluster_is_joined_on_its_own_terms():
    one_host: dict[str, str] = {}
    prepare_environment(one_host)
    assert one_host == {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    joining = {"RAY_ADDRESS": "10.0.0.5:6380"}
    prepare_environment(joining)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in joining  # the driver must be reachable from the nodes


def test_the_token_a_ray_of_one_host_gets_is_readable_by_its_owner_only(tmp_path):
    make_private_token({"HOME": str(tmp_path)})
    token = tmp_path / ".ray" / "auth_token"
    assert len(token.read_text()) == 64 and token.stat().st_mode & 0o777 == 0o600
    made = token.read_text()
    make_private_token({"HOME": str(tmp_path)})  # a token there stays the token
    assert token.read_text() == made
    elsewhere = tmp_path / "elsewhere"
    make_private_token({"HOME": str(elsewhere), "RAY_AUTH_TOKEN": "set"})
    make_private_token({"HOME": str(elsewhere), "RAY_AUTH_TOKEN_PATH": str(token)})
    assert not elsewhere.exists()


def test_inference_ray_serve_refuses_to_start_ray_without_token_authentication(tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(catalog_text("ray", autoscaling="min_replicas = 0\nidle = \"stop\""))
    environment = {**os.environ, "MODEL_CATALOG": str(catalog), "RAY_AUTH_MODE": "disabled"}
    result = _ray_serve(environment, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "configuration error: RAY_AUTH_MODE='disabled'" in result.stderr
    assert "Traceback" not in result.stderr


# --- one host -------------------------------------------------------------------------------------


@pytest.mark.fault
def test_a_one_host_ray_serve_listens_on_loopback_only(tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(catalog_text("ray", autoscaling="min_replicas = 0\nidle = \"stop\""))  # no engine: Ray and Serve alone
    serve_port = free_port()
    folder = ray_folder()
    environment = {
        "MODEL_CATALOG": str(catalog), "RAY_SERVE_URL": f"http://127.0.0.1:{serve_port}",
        "RAY_TMPDIR": str(folder),  # its processes are found (and stopped) by their folder
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # nothing written to the home folder
    }
    seen = []
    try:
        with running("ray-serve-loopback", [sys.executable, "-m", "inference.ray_serve"], environment) as process:
            url = f"http://127.0.0.1:{serve_port}/health"
            wait_until(lambda: answers(url, headers=internal_headers()), START_S, "Ray Serve", process)
            driver = psutil.Process(process.pid)
            seen = [driver, *driver.children(recursive=True), *node_processes(folder)]
            found = set(listeners(seen))
    finally:
        stop_node(folder, also=seen)
    print("\nlistening:\n  " + "\n  ".join(sorted(map(str, found))))
    ports = {listener.port for listener in found}
    assert serve_port in ports and len({listener.process for listener in found}) >= 3  # Serve, GCS, raylet, ...
    assert [str(listener) for listener in found if not listener.on_loopback] == []


# --- a cluster with token authentication ----------------------------------------------------------


@dataclass
class Head:
    address: str
    token: str
    folder: Path


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A head node with token authentication, as the README starts one (but on loopback only)."""
    token, port = secrets.token_hex(32), free_port()
    environment = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    arguments = [
        "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
    ]
    with ray_node(arguments, environment) as folder:
        yield Head(f"127.0.0.1:{port}", token, folder)


def _gcs_node_count(head: Head, token: str | None) -> int:
    """The cluster's nodes, asked of its GCS by a bare gRPC client presenting ``token``."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(head.address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), metadata=metadata, timeout=10)
    return len(reply.node_info_list)


@pytest.mark.fault
def test_a_ray_head_with_token_authentication_refuses_a_caller_without_its_token(head):
    for token in (None, "", secrets.token_hex(32)):
        with pytest.raises(grpc.RpcError) as refused:
            _gcs_node_count(head, token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _gcs_node_count(head, head.token) == 1
    found = listeners(node_processes(head.folder))
    print("\nlistening:\n  " + "\n  ".join(sorted(map(str, found))))
    assert found and [str(listener) for listener in found if not listener.on_loopback] == []


def _driver(head: Head, **environment: str) -> dict[str, str]:
    """A driver's environment on another host: none of the head's Ray settings, but ``environment``."""
    driver = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    # The head listens on loopback: a driver that is not told so looks for it on the network.
    return driver | {"RAY_ADDRESS": head.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"} | environment


@pytest.mark.fault
def test_inference_ray_serve_joins_with_the_clusters_token(head):
    # How ``python -m inference.ray_serve`` joins, without deploying the application onto the cluster.
    join = "from inference.ray_serve.cluster import connect; connect({}); import ray; print(len(ray.nodes()))"
    environment = _driver(head, RAY_AUTH_TOKEN=head.token)  # RAY_AUTH_MODE unset: Ray itself would send no token
    joined = subprocess.run(
        [sys.executable, "-c", join], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=START_S
    )
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert joined.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.fault
def test_inference_ray_serve_says_what_to_fix_when_the_cluster_refuses_its_token(head, tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(catalog_text("ray", autoscaling="min_replicas = 0\nidle = \"stop\""))
    no_token = _driver(head, MODEL_CATALOG=str(catalog), HOME=str(tmp_path))  # no ~/.ray/auth_token either
    for environment, says in [
        (no_token, "no Ray token found: give this driver the cluster's token (RAY_AUTH_TOKEN"),
        ({**no_token, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, f"Ray at RAY_ADDRESS={head.address} did not let"),
    ]:
        refused = _ray_serve(environment, timeout=START_S)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "configuration error: " in refused.stderr and says in refused.stderr
        assert "Traceback" not in refused.stderr


def _ray_serve(environment: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inference.ray_serve"], env=environment, cwd=ROOT,
        capture_output=True, text=True, timeout=timeout,
    )
