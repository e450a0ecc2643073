"""One address for each page: the form without a trailing slash (``/datasets``, ``/jobs/ftjob-...``).

Django's own convention (``APPEND_SLASH``) is one canonical form and a redirect from the other; our
canonical form has no slash, so a path typed with one is a permanent redirect (301, query string
kept) to the page it names once its trailing slashes go. Only for GET and HEAD: any other method is
a 404 that names the right address. A browser follows a 301 or 302 with a GET and drops the body,
and a 308 would make it send the body again (an upload, up to ``MAX_UPLOAD_MB``); our own forms post
to the canonical addresses, so a POST to a slashed one is a mistake, best reported at once.

``/v1/`` is left alone: its catch-all route answers first (a JSON 404, ``base.error_responses``). The
OpenAI client never adds a slash, and an API client is better told than redirected.
"""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse, HttpResponsePermanentRedirect
from django.shortcuts import render
from django.urls import Resolver404, resolve
from django.utils.http import escape_leading_slashes
from django.views.decorators.csrf import csrf_exempt

REDIRECTED_METHODS = ("GET", "HEAD")


@csrf_exempt  # it changes nothing: a POST here gets its 404, not a page about a missing CSRF token
def without_trailing_slash(request: HttpRequest) -> HttpResponse:
    """The route for every path that ends in a slash and matched nothing else."""
    if not _names_a_page(request.path_info.rstrip("/")):
        raise Http404("No page has this address, with or without its trailing slash.")
    # escape_leading_slashes: "//host/" must not become "//host", which a browser reads as another site.
    canonical = escape_leading_slashes(request.path.rstrip("/"))
    if request.method not in REDIRECTED_METHODS:
        return render(request, "404.html", {"path": request.path, "canonical": canonical}, status=404)
    query = request.META.get("QUERY_STRING", "")
    return HttpResponsePermanentRedirect(f"{canonical}?{query}" if query else canonical)


def _names_a_page(path: str) -> bool:
    if not path:
        return False
    try:
        resolve(path)
    except Resolver404:
        return False
    return True
