import logging

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"

    def ready(self) -> None:
        # httpx logs every request at INFO: one log line per metrics scrape is noise, not news.
        logging.getLogger("httpx").setLevel(logging.WARNING)

        from accounts.signals import access_withdrawn
        from gateway.access import forget_grants

        access_withdrawn.connect(forget_grants, dispatch_uid="gateway.forget_grants")
