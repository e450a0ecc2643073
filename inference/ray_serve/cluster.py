"""How ``python -m inference.ray_serve`` reaches Ray, and who else can.

Ray runs whatever code a caller hands its GCS, raylets or workers, so whoever reaches them can run
code as the platform. Two defences:

- where Ray listens. A Ray of one machine listens on loopback only: every process binds the
  node's address when it is loopback, and every interface otherwise. ``ray.init()`` and
  ``ray start`` take the address that reaches the network even when given 127.0.0.1, unless
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (Ray's own switch for a Ray that stays on one machine, its
  default on macOS and Windows; else it only stops ``ray start`` adding a node). Serve's replicas
  are the exception: they open a server for calls between deployments on every
  interface whatever the node's address (Ray 2.60 binds ``[::]:0``), so on one host each worker
  starts with ``keep_serve_replicas_on_loopback``;
- token authentication (``RAY_AUTH_MODE=token``): every Ray process refuses a caller that does not
  present the cluster's token. Ray turns it on by itself for a cluster that ``ray.init()``
  starts, never for one it joins (RAY_ADDRESS): here it is always on. The token comes from
  RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ``~/.ray/auth_token`` (made here, readable
  by its owner only, for a Ray of one host when there is none).

Ray reads both settings once, when it is imported, and the processes it starts inherit them:
``prepare_environment`` runs before Ray is imported.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from core.env import ConfigError

AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
ONE_MACHINE_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node's address is loopback
TOKEN_SOURCES = "RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"


def joins_a_cluster(environ: MutableMapping[str, str] = os.environ) -> bool:
    return bool(environ.get("RAY_ADDRESS"))


def prepare_environment(environ: MutableMapping[str, str] = os.environ) -> None:
    """Token authentication (the default, and the only mode accepted), and, for a Ray of one
    host, loopback only. Before Ray is imported: it reads them once, at import."""
    mode = environ.setdefault(AUTH_MODE_VARIABLE, "token")
    if mode.strip().lower() != "token":
        raise ConfigError(
            f"{AUTH_MODE_VARIABLE}={mode!r}: inference.ray_serve runs Ray with token authentication only "
            f"(whoever reaches Ray can run code on it): unset {AUTH_MODE_VARIABLE} or set it to token"
        )
    if not joins_a_cluster(environ):
        environ[ONE_MACHINE_VARIABLE] = "0"


def make_private_token(environ: MutableMapping[str, str] = os.environ) -> None:
    """The default token file, when no token is set, readable by its owner only: Ray would make
    one readable by every user of the machine (its mode follows the umask), and a user with the
    token can run code on the Ray of this host."""
    if environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path(environ.get("HOME") or Path.home()) / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(descriptor, "w") as token:
        token.write(secrets.token_hex(32))  # as Ray makes one: 256 random bits


def connect(runtime_env: dict[str, Any]) -> None:
    """Join the cluster at RAY_ADDRESS, or start a Ray of one host, on loopback; ConfigError when
    the cluster refuses this driver's token (or it has none)."""
    settings = dict(os.environ)
    prepare_environment(settings)
    if "ray" in sys.modules and settings != os.environ:
        raise RuntimeError("prepare_environment() before Ray is imported: Ray reads its settings at import")
    prepare_environment()
    import ray
    from ray.exceptions import AuthenticationError

    if not joins_a_cluster():  # a Ray of its own
        make_private_token()
        hook = {"worker_process_setup_hook": f"{__name__}.{keep_serve_replicas_on_loopback.__name__}"}
        # "local": without it, ray.init() joins the last cluster `ray start` ran on this host instead
        ray.init(address="local", runtime_env={**runtime_env, **hook}, include_dashboard=False)
        return
    try:
        ray.init(runtime_env=runtime_env)  # RAY_ADDRESS names the cluster
    except AuthenticationError:  # this driver found no token
        raise ConfigError(f"no Ray token found: give this driver the cluster's token ({TOKEN_SOURCES})") from None
    except ConnectionError:  # a refused token: Ray retries it for 20 s, then says only this
        raise ConfigError(
            f"Ray at RAY_ADDRESS={os.environ['RAY_ADDRESS']} did not let this driver in: check that the cluster "
            f"runs there and that this driver has its token ({TOKEN_SOURCES})"
        ) from None


def keep_serve_replicas_on_loopback() -> None:
    """A worker's setup on a Ray of one host: a Serve replica's server for calls between
    deployments listens on loopback (where its node's address is) instead of every interface. A
    Ray without the function it wraps (another version) is left as it is: the tests say so."""
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        return

    def on_loopback(server: Any, address: str) -> int:
        return bind(server, address.replace("[::]:", "127.0.0.1:", 1))

    replica.add_port_to_grpc_server = on_loopback
