"""Fetch media from http(s) URLs for the server, safely.

Role: `fetch_url(url, max_bytes, policy)` returns the body of a URL or raises `InvalidInputError`.
Safety rules, checked on the first request and on every redirect hop (redirects are followed by
hand, never by the HTTP client):
- only http and https;
- with `allowed_domains` set, only those hosts (and their subdomains); they are trusted, so they
  may resolve to private addresses;
- otherwise every address the host resolves to must be public: private, loopback, link-local,
  multicast, reserved and unspecified addresses are refused, unless `allow_private` is set;
- the connection goes to the very address that was checked (the URL's host is replaced by the IP,
  with the Host header and TLS SNI kept), so DNS cannot answer differently a second time;
- a total deadline and a byte cap (Content-Length first, then the bytes actually read).

What it does not know: images, videos, models; it returns bytes.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

import httpx

from mmserve.errors import InvalidInputError

DEFAULT_PORTS = {"http": 80, "https": 443}
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class FetchPolicy:
    timeout_s: float = 10.0  # total, for the whole fetch including redirects
    max_redirects: int = 5
    allowed_domains: tuple[str, ...] = ()  # empty: any public host
    allow_private: bool = False  # allow private/loopback/link-local targets (tests, trusted networks)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.max_redirects < 0:
            raise ValueError("timeout_s must be positive and max_redirects non-negative")
        object.__setattr__(self, "allowed_domains", tuple(d.strip().lower().strip(".")
                                                          for d in self.allowed_domains if d.strip()))


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _domain_allowed(host: str, domains: tuple[str, ...]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


def _resolve_checked(url: httpx.URL, policy: FetchPolicy, what: str) -> str:
    """The address to connect to for `url`, after every safety check; raises InvalidInputError."""
    if url.scheme not in DEFAULT_PORTS:
        raise InvalidInputError(f"{what}: URL scheme {url.scheme!r} is not allowed (http or https only)")
    host = url.host.lower().rstrip(".")
    if not host:
        raise InvalidInputError(f"{what}: URL {str(url)!r} has no host")
    trusted = _domain_allowed(host, policy.allowed_domains)
    if policy.allowed_domains and not trusted:
        raise InvalidInputError(f"{what}: host {host!r} is not in the allowed media domains")
    port = url.port or DEFAULT_PORTS[url.scheme]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInputError(f"{what}: cannot resolve host {host!r}: {exc}") from exc
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise InvalidInputError(f"{what}: host {host!r} has no address")
    if not (trusted or policy.allow_private):
        blocked = [a for a in addresses if not _is_public(a)]
        if blocked:
            raise InvalidInputError(f"{what}: URL host {host!r} resolves to a private, loopback or link-local "
                                    f"address ({blocked[0]}); refused")
    return addresses[0]


def _pinned_request(client: httpx.Client, url: httpx.URL, address: str) -> httpx.Request:
    """A GET to `address` that still says `url`'s host in the Host header and the TLS handshake."""
    target = url.copy_with(host=address.split("%", 1)[0])
    host_header = url.netloc.decode("ascii").rsplit("@", 1)[-1]
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    return client.build_request("GET", target, headers={"Host": host_header}, extensions=extensions)


def _read_capped(response: httpx.Response, max_bytes: int, deadline: float, what: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise InvalidInputError(f"{what} is {declared} bytes, over the limit of {max_bytes} bytes")
    body = bytearray()
    for chunk in response.iter_bytes(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise InvalidInputError(f"{what} is over the limit of {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise InvalidInputError(f"{what}: fetching took longer than the time limit")
    return bytes(body)


def fetch_url(url: str, max_bytes: int, policy: FetchPolicy, what: str = "media") -> bytes:
    """GET `url` under `policy` and return at most `max_bytes` of body; every failure is an
    InvalidInputError whose message a client can act on."""
    deadline = time.monotonic() + policy.timeout_s
    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise InvalidInputError(f"{what}: invalid URL: {exc}") from exc
    try:
        with httpx.Client(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as client:
            for _ in range(policy.max_redirects + 1):
                address = _resolve_checked(current, policy, what)
                response = client.send(_pinned_request(client, current, address), stream=True)
                try:
                    if response.is_redirect and "location" in response.headers:
                        current = current.join(response.headers["location"])
                        continue
                    if response.status_code >= 400:
                        raise InvalidInputError(f"{what}: fetching {url!r} returned HTTP {response.status_code}")
                    return _read_capped(response, max_bytes, deadline, what)
                finally:
                    response.close()
    except httpx.TimeoutException as exc:
        raise InvalidInputError(f"{what}: fetching {url!r} timed out after {policy.timeout_s}s") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise InvalidInputError(f"{what}: could not fetch {url!r}: {exc}") from exc
    raise InvalidInputError(f"{what}: more than {policy.max_redirects} redirects fetching {url!r}")
