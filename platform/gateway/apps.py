import logging

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"

    def ready(self) -> None:
        # httpx logs every request at INFO: one log line per metrics scrape is noise, not news.
        logging.getLogger("httpx").setLevel(logging.WARNING)
