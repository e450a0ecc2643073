"""Start the inference pool: ``python -m inference``. Listens on INFERENCE_POOL_URL's port."""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit

import uvicorn

from core.catalog import load_catalog
from core.config import load_config
from core.env import ConfigError
from inference.pool import Pool
from inference.server import create_app


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_config()
        catalog = load_catalog(config.model_catalog, config.data_dir, config.dynamic_lora_path)
        catalog.check_weights()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    address = urlsplit(config.inference_pool_url)
    pool = Pool(catalog, config.first_replica_port)
    uvicorn.run(create_app(pool), host=address.hostname, port=address.port or 80, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
