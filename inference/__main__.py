"""Start the inference pool: ``python -m inference``. Listens on INFERENCE_POOL_URL's port."""

from __future__ import annotations

import argparse
import logging
import sys
from urllib.parse import urlsplit

import httpx
import uvicorn

from core.adapter_store import store_of
from core.catalog import Catalog
from core.config import Config, load_config
from core.env import ConfigError
from inference.adapter_source import AdapterSource
from inference.adapters import AdapterManager
from inference.metrics import Metrics
from inference.pool import Pool
from inference.server import admin_client, create_app, replica_client

ADAPTER_CACHE = "adapter-cache"  # under DATA_DIR: adapters synced from S3


def build_adapter_manager(
    config: Config, catalog: Catalog, client: httpx.AsyncClient, metrics: Metrics
) -> AdapterManager:
    sources = {
        model.id: AdapterSource(store_of(model, config.s3), config.data_dir / ADAPTER_CACHE, metrics, model.id)
        for model in catalog.models
    }
    return AdapterManager(sources, client, metrics)


def main() -> int:
    # No options: its settings are the platform's environment (docs/operations.md); --help says so.
    argparse.ArgumentParser(
        prog="python -m inference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check is noise
    try:
        config = load_config()
        # The models with backend = "ray" are inference.ray_serve's.
        catalog = config.catalog().served_by("embedded")
        catalog.check_weights()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    address = urlsplit(config.inference_pool_url)
    if address.hostname is None:  # uvicorn would take "no host" as every interface
        print(f"configuration error: INFERENCE_POOL_URL={config.inference_pool_url!r} names no host", file=sys.stderr)
        return 2
    metrics = Metrics()
    pool = Pool(catalog, config.first_replica_port, config.internal_token)
    adapters = build_adapter_manager(config, catalog, admin_client(config.internal_token), metrics)
    app = create_app(pool, adapters, replica_client(config.internal_token), metrics, config.internal_token)
    uvicorn.run(app, host=address.hostname, port=address.port or 80, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
