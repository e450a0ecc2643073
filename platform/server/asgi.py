import os

from django.core.asgi import get_asgi_application
from gateway.asgi import with_fast_path
from server.body_limits import with_body_limits

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
# Outermost, the body's size is capped before anything reads it; then the completions skip
# Django's middleware.
application = with_body_limits(with_fast_path(get_asgi_application()))
