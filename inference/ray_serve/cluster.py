"""How ``python -m inference.ray_serve`` reaches Ray, and who else can.

Ray runs whatever code a caller hands its GCS, raylets or workers, so whoever reaches them can run
code as the platform. Started with no node address (``ray.init()``, ``ray start``), Ray listens on
every interface; given a loopback node address, every Ray process listens on loopback only. With
token authentication (``RAY_AUTH_MODE=token``), Ray refuses a caller that does not present the
cluster's token. So:

- one host (no RAY_ADDRESS): a Ray of its own on 127.0.0.1 only, without the dashboard, with token
  authentication (Ray writes a token to ``~/.ray/auth_token`` when it finds none);
- a cluster (RAY_ADDRESS, nodes started with ``ray start``): the nodes listen on a private interface
  (``--node-ip-address``), and this driver presents the cluster's token. Ray itself turns token
  authentication on only for a cluster it starts, never for one it joins, so here RAY_AUTH_MODE is
  ``token`` unless set; the token comes from RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names,
  or ``~/.ray/auth_token``.

The processes Ray starts inherit this environment, so they authenticate the same way.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from core.env import ConfigError

LOOPBACK = "127.0.0.1"
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"
TOKEN_SOURCES = "RAY_AUTH_TOKEN, a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token"


def require_token_authentication(environ: MutableMapping[str, str] = os.environ) -> None:
    """Token authentication for this process and the Ray processes it starts: the default, and
    the only mode accepted (a Ray without it runs anyone's code)."""
    mode = environ.setdefault(AUTH_MODE_VARIABLE, "token")
    if mode.strip().lower() != "token":
        raise ConfigError(
            f"{AUTH_MODE_VARIABLE}={mode!r}: inference.ray_serve runs Ray with token authentication only "
            f"(whoever reaches Ray can run code on it): unset {AUTH_MODE_VARIABLE} or set it to token"
        )


def joins_a_cluster(environ: MutableMapping[str, str] = os.environ) -> bool:
    return bool(environ.get("RAY_ADDRESS"))


def connect(runtime_env: dict[str, Any]) -> None:
    """Join the cluster at RAY_ADDRESS, or start a one-host Ray on loopback; ConfigError when the
    cluster refuses this driver's token (or it has none)."""
    require_token_authentication()
    import ray
    from ray.exceptions import AuthenticationError

    try:
        if joins_a_cluster():
            ray.init(runtime_env=runtime_env)  # RAY_ADDRESS names the cluster
        else:
            # The node address is what Ray's processes bind: loopback keeps them all off the network.
            ray.init(runtime_env=runtime_env, _node_ip_address=LOOPBACK, include_dashboard=False)
    except AuthenticationError as exc:
        raise ConfigError(
            f"Ray refused this driver's token ({str(exc).splitlines()[0]}): give it the cluster's token "
            f"({TOKEN_SOURCES})"
        ) from None
