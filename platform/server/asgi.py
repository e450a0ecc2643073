import os

from django.core.asgi import get_asgi_application
from gateway.asgi import with_fast_path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
application = with_fast_path(get_asgi_application())  # completions skip Django's middleware
