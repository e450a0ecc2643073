"""Deploy the Ray Serve backend: ``python -m inference.ray_serve``.

Serves the catalog's models with ``backend = "ray"`` at RAY_SERVE_URL (Serve's HTTP proxy, on the
head node only). With RAY_ADDRESS set it joins that Ray cluster (started with ``ray start`` on each
host, every host with this checkout at the same path and the platform's environment); without it,
it starts a one-host cluster of its own, on loopback only. Either way Ray requires its token
(``cluster``). Stopping it (SIGTERM, Ctrl-C) takes the application down, and the local cluster
with it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from urllib.parse import urlsplit

from core.config import REPO_ROOT, load_config
from core.env import ConfigError
from inference.ray_serve import cluster


def main() -> int:
    # No options: its settings are the platform's environment (docs/operations.md); --help says so.
    argparse.ArgumentParser(
        prog="python -m inference.ray_serve", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config()
        catalog = config.catalog().served_by("ray")
        catalog.check_weights()
        cluster.prepare_environment()  # before Ray is imported: it reads its settings once, at import
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    if not catalog.models:
        print(f'configuration error: no model in {config.model_catalog} has backend = "ray"', file=sys.stderr)
        return 2
    address = urlsplit(config.ray_serve_url)
    try:
        import ray
        from ray import serve
    except ImportError:
        print("inference.ray_serve needs Ray Serve: pip install '.[ray]'", file=sys.stderr)
        return 2
    from inference.ray_serve.app import APP_NAME, build_app

    try:
        # The replicas import this checkout's modules: on every host it stands at the same path.
        cluster.connect(runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    stopped = threading.Event()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signal_number, lambda *_: stopped.set())
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": address.hostname, "port": address.port or 80})
        serve.run(build_app(catalog.models), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"inference.ray_serve: serving {', '.join(catalog.ids)} at {config.ray_serve_url}", flush=True)
        stopped.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
