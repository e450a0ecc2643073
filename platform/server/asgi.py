import os
from typing import cast

from django.core.asgi import get_asgi_application
from gateway.asgi import with_fast_path
from starlette.types import ASGIApp
from server.body_limits import with_body_limits

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
# Outermost, the body's size is capped before anything reads it; then the completions skip
# Django's middleware. (Django's handler is an ASGI app: its stubs type the scope as a dict, where
# an ASGI app takes any mutable mapping.)
application = with_body_limits(with_fast_path(cast(ASGIApp, get_asgi_application())))
