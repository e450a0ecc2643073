"""POST a webhook to a tenant's URL, and nowhere else (SSRF): the one way the platform sends a
request to an address a tenant chose.

- It resolves the host itself and checks every address it resolves to (``core.public_addresses``),
  then connects to a checked address: no second lookup between check and connect, so a name that
  answers a public address to the check and a private one to the connection (DNS rebinding) gains
  nothing. TLS is still verified against the host's name (SNI and the certificate).
- It never follows a redirect: a 3xx is an answer like any other non-2xx (a failed attempt).
- Every step has a short timeout, and the whole attempt a deadline past which its socket is shut
  (a receiver that trickles its answer a byte at a time cannot hold a worker); it reads at most
  ``READ_LIMIT_BYTES`` of the answer, and keeps none of it.

Django-free: the worker calls it with the operator's setting.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from ipaddress import ip_address
from urllib.parse import urlsplit

from core.public_addresses import IPAddress, refusal

CONNECT_TIMEOUT_S = 5.0  # each connect, and each read or write on the socket
DEADLINE_S = 10.0  # the whole attempt, from the lookup to the last byte read
READ_LIMIT_BYTES = 4096  # of the answer: its status is what counts
USER_AGENT = "fineserve-webhooks/1"


@dataclass(frozen=True)
class Outcome:
    status_code: int | None  # None: no answer (see error)
    error: str  # "" when the receiver answered; else what went wrong, fit for the tenant to read
    duration_ms: int

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


class Refused(Exception):
    """Not sent: the URL or the address it resolves to is not one the platform may reach."""


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order (one place, so tests can stand in)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos))


def checked_addresses(host: str, port: int, allow_private: bool) -> list[IPAddress]:
    """The addresses to try, all of them allowed; ``Refused`` when any is not (a name that resolves to
    a public and a private address is refused whole: which one a connection uses is not ours to choose
    safely)."""
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise Refused(f"the host name could not be resolved ({exc.__class__.__name__})") from None
    for address in addresses:
        if why := refusal(address, allow_private):
            raise Refused(f"the host resolves to {why}, which webhooks may not reach")
    if not addresses:
        raise Refused("the host name resolves to no address")
    return addresses


def _connected(addresses: list[IPAddress], port: int) -> socket.socket:
    last: OSError | None = None
    for address in addresses:
        try:
            return socket.create_connection((str(address), port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            last = exc
    assert last is not None
    raise last


def post(url: str, body: bytes, headers: dict[str, str], allow_private: bool) -> Outcome:
    """Send one attempt. Never raises for the receiver's sake: every failure is an ``Outcome``."""
    started = time.monotonic()

    def outcome(status_code: int | None, error: str = "") -> Outcome:
        return Outcome(status_code, error, int((time.monotonic() - started) * 1000))

    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme != "https" and not (allow_private and parts.scheme == "http"):
        return outcome(None, "Not sent: only https:// URLs may receive webhooks.")  # the operator's setting changed
    try:
        sock = _connected(checked_addresses(host, port, allow_private), port)
    except Refused as exc:
        return outcome(None, f"Not sent: {exc}.")
    except OSError as exc:
        return outcome(None, _said(exc, "could not connect"))
    # The deadline: shutting the socket down ends whatever read or write is waiting on it. A list,
    # as TLS replaces the socket (the plain one is detached from its descriptor then).
    current = [sock]
    timer = threading.Timer(DEADLINE_S, lambda: _shut(current[-1]))
    timer.start()
    try:
        if parts.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            current.append(sock)
        connection = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
        connection.sock = sock  # already connected to the checked address: http.client does not look up again
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        request_headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, **headers}
        connection.request("POST", path, body=body, headers=request_headers)
        response = connection.getresponse()
        response.read(READ_LIMIT_BYTES)
        return outcome(response.status)
    except (OSError, http.client.HTTPException) as exc:
        if time.monotonic() - started >= DEADLINE_S:
            return outcome(None, f"No answer within {DEADLINE_S:g} seconds.")
        return outcome(None, _said(exc, "the request failed"))
    finally:
        timer.cancel()
        sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


def _said(exc: BaseException, what: str) -> str:
    """A failure in words, with no address in them (the tenant reads the delivery log)."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"Timed out: {what} within {CONNECT_TIMEOUT_S:g} seconds."
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed: {exc.reason or exc.__class__.__name__}."
    if isinstance(exc, ConnectionRefusedError):
        return "Connection refused."
    if isinstance(exc, ConnectionResetError):
        return "The receiver closed the connection."
    if isinstance(exc, http.client.HTTPException):
        return f"The answer was not valid HTTP ({exc.__class__.__name__})."
    return f"{what[0].upper()}{what[1:]} ({exc.__class__.__name__})."
