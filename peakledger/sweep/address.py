"""A cluster's address: read strictly, then probed, before ray or dask is given it.

Forms (anything else is refused at once, naming them; a port is 1-65535, an IPv6 host goes in brackets):

- ray: `auto` (the cluster this machine knows of, found as ray finds it: the RAY_ADDRESS environment variable, then
  the address `ray start` wrote to ray's current-cluster file, <RAY_TMPDIR, else TMPDIR, else /tmp>/ray/
  ray_current_cluster; ray's last resort, any raylet process running here, is left out: it would take a throwaway
  cluster another program started), `host:port` (a cluster's GCS) or `ray://host:port` (Ray Client, which needs
  `ray[client]`).
- dask: `tcp://host:port` or `host:port` (a scheduler).

The probe: a TCP connection, then the first words of the protocol, all within PROBE_TIMEOUT_S (a module constant;
tests lower it), the name's resolution included (the probe runs in a helper thread, waited for in short waits so
that Ctrl-C and SIGTERM are handled at once). It catches a peer that accepts the connection but never answers
(an HTTP server waiting for a request, a firewall's tarpit), which ray and dask would wait on for minutes:

- a dask scheduler sends its handshake as soon as it accepts, so no bytes within the timeout is no scheduler; its
  first 16 bytes are the message's length and frame count (small numbers), which an HTTP or SSH server's are not;
- a ray GCS (and a Ray Client server) is a gRPC server, an HTTP/2 server: it answers a client's connection
  preface with a SETTINGS frame (RFC 9113, section 3.4).

Every failure is one line naming the address and what to do (ConfigError("address"): the CLI's exit 2).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..models.config import ConfigError
from .signals import wait

PROBE_TIMEOUT_S = 5.0  # the probe of an address at most: connection, name resolution and first answer
RAY_FORMS = "auto, host:port or ray://host:port (port 1-65535; an IPv6 host in brackets: [::1]:6379)"
DASK_FORMS = "tcp://host:port or host:port (port 1-65535; an IPv6 host in brackets: [::1]:8786)"
_MAX_TEXT = 300  # characters: a host name is at most 253
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
# RFC 9113, section 3.4: the client's connection preface, then its SETTINGS frame (here empty: length 0, type 4,
# no flags, stream 0); the server's preface is a SETTINGS frame (type 4) on stream 0
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4


@dataclass(frozen=True)
class Address:
    """A cluster address read strictly: `scheme` is "tcp" (dask), "ray" (Ray Client) or "" (a ray GCS)."""

    engine: str
    scheme: str
    host: str
    port: int

    @property
    def target(self) -> str:
        """What ray.init or dask's Client is given."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.engine == "dask":
            return f"tcp://{host}:{self.port}"
        return f"{self.scheme}://{host}:{self.port}" if self.scheme else f"{host}:{self.port}"


def parse_address(engine: str, text: object, source: str = "") -> Address | None:
    """`text` as an Address of `engine` ("ray" or "dask"); None for ray's `auto`. `source` says where it came
    from in the error (e.g. "RAY_ADDRESS"). ConfigError("address") naming the allowed forms otherwise."""
    forms = RAY_FORMS if engine == "ray" else DASK_FORMS
    where = f" (from {source})" if source else ""

    def refuse(why: str) -> ConfigError:
        shown = repr(text) if len(str(text)) <= 80 else repr(str(text)[:80] + "...")
        return ConfigError("address", f"cannot read {shown}{where} as a {engine} address: {why}; allowed: {forms}")

    if not isinstance(text, str) or not text.strip():
        raise refuse("it is empty")
    if len(text) > _MAX_TEXT:
        raise refuse(f"longer than {_MAX_TEXT} characters")
    if text != text.strip() or any(c.isspace() for c in text):
        raise refuse("it has spaces")
    if engine == "ray" and text == "auto" and not source:
        return None
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    allowed = {"ray": ("", "ray"), "dask": ("", "tcp")}[engine]
    if scheme not in allowed:
        raise refuse(f"unknown scheme {scheme + '://'!r}" if scheme else "no scheme")
    if "/" in rest:
        raise refuse("a '/' after the scheme's '://' (a path? a mistyped scheme?)" if sep else
                     "a '/' where no scheme's '://' is (a path? a mistyped scheme?)")
    if "?" in rest or "#" in rest or "@" in rest:
        raise refuse("a query, a fragment or a user is not part of an address")
    host, port = _host_port(rest, refuse)
    return Address(engine=engine, scheme="ray" if scheme == "ray" else ("tcp" if engine == "dask" else ""),
                   host=host, port=port)


def _host_port(text: str, refuse: Callable[[str], ConfigError]) -> tuple[str, int]:
    if text.startswith("["):
        inner, close, tail = text[1:].partition("]")
        if not close or not tail.startswith(":"):
            raise refuse("an IPv6 host in brackets is followed by :port")
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise refuse(f"{inner!r} is not an IPv6 address") from None
        host, port = inner, tail[1:]
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise refuse("no port (host:port)")
        if ":" in host:
            raise refuse("an IPv6 host goes in brackets ([::1]:port)")
        if not host:
            raise refuse("no host")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise refuse(f"{host!r} is not an IPv4 address") from None
        elif not _HOSTNAME.match(host):
            raise refuse(f"{host!r} is not a host name")
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise refuse(f"the port {port!r} is not a number from 1 to 65535")
    return host, int(port)


def ray_current_cluster_file(environ: Mapping[str, str]) -> str:
    """Where `ray start` writes the address of the cluster it started (ray/_common/utils.py (2.60.0):
    get_default_system_temp_dir, get_ray_address_file)."""
    tmp = environ.get("RAY_TMPDIR") or environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, "ray", "ray_current_cluster")


def resolve_ray_auto(environ: Mapping[str, str], read: Callable[[str], str | None]) -> tuple[Address, str]:
    """ray's `auto` as ray resolves it (ray/_private/services.py (2.60.0): get_ray_address_from_environment):
    RAY_ADDRESS if set and not empty (nor `auto`), else the current-cluster file's address; (address, where it
    came from). `read(path)` is the file's text or None. ConfigError("address") when there is no cluster."""
    env = environ.get("RAY_ADDRESS", "")
    if env and env != "auto":
        return parse_address("ray", env, source="RAY_ADDRESS"), "RAY_ADDRESS"
    path = ray_current_cluster_file(environ)
    text = read(path)
    if text is None or not text.strip():
        raise ConfigError("address", f"--address auto: no ray cluster is running here (RAY_ADDRESS is not set and "
                                     f"there is no {path}, which `ray start --head` writes); start one, give a "
                                     "cluster's host:port, or leave --address out for a local cluster")
    return parse_address("ray", text.strip(), source=path), path


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("utf-8", "replace")
    except OSError:
        return None


def probe(address: Address, timeout_s: float) -> str | None:
    """None if `address` answers as its engine's server does within `timeout_s`, else what it did, in words.
    Blocking; `check_address` runs it in a helper thread."""
    end = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    except socket.gaierror as e:
        return f"the host name {address.host!r} does not resolve ({e.strerror})"
    except ConnectionRefusedError:
        return "nothing listens there (connection refused)"
    except (TimeoutError, socket.timeout):
        return f"no answer to a TCP connection within {timeout_s:g} s"
    except OSError as e:
        return f"cannot connect ({e.strerror or type(e).__name__})"
    with sock:
        try:
            if address.engine == "dask":
                # distributed/comm/core.py (2026.8.0): Server.on_connection writes its handshake, then reads the peer's
                data = _receive(sock, 16, end)
                if not data:
                    return (f"it accepted the connection but sent nothing within {timeout_s:g} s, and a dask scheduler "
                            "sends its handshake at once: not a dask scheduler (an HTTP server? a firewall?)")
                # distributed/comm/tcp.py (2026.8.0): a message starts with its length ("Q"), then its frame count
                total, frames = struct.unpack("<QQ", data.ljust(16, b"\0"))
                if len(data) < 16 or not (0 < frames <= 64 and 0 < total < 1 << 26):
                    return "it answered, but not as a dask scheduler does (another kind of server?)"
                return None
            # ray/_private/gcs_utils.py (2.60.0): create_gcs_channel, the GCS is a gRPC server (HTTP/2)
            sock.settimeout(max(0.001, end - time.monotonic()))
            sock.sendall(HTTP2_PREFACE)
            data = _receive(sock, 9, end)
            if not data:
                return (f"it accepted the connection but did not answer an HTTP/2 greeting within {timeout_s:g} s, as "
                        "a ray cluster's GCS (a gRPC server) does: not a ray cluster")
            if len(data) < 9 or data[3] != _HTTP2_SETTINGS or int.from_bytes(data[5:9], "big") & 0x7FFFFFFF:
                return "it answered, but not as a ray cluster's GCS (a gRPC server) does (another kind of server?)"
            return None
        except OSError as e:
            return f"the connection failed ({e.strerror or type(e).__name__})"


def _receive(sock: socket.socket, n: int, end: float) -> bytes:
    """Up to `n` bytes, until `end` (time.monotonic) or the end of the stream."""
    data = b""
    while len(data) < n:
        left = end - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            part = sock.recv(n - len(data))
        except (TimeoutError, socket.timeout):
            break
        if not part:
            break
        data += part
    return data


def probe_bounded(address: Address, timeout_s: float) -> str | None:
    """probe() in a helper thread, given up after timeout_s (+ 1 s) whatever it is doing (a name's resolution is
    not bounded by a socket's timeout); the waiting handles signals at once."""
    box: dict[str, str | None] = {}
    helper = threading.Thread(target=lambda: box.update(reason=probe(address, timeout_s)),
                              name="peakledger-address-probe", daemon=True)
    helper.start()
    end = time.monotonic() + timeout_s + 1.0
    wait(lambda t: (helper.join(max(0.0, min(t, end - time.monotonic()))) or not helper.is_alive())
         or time.monotonic() >= end, hold=False)
    if "reason" not in box:
        return f"no answer within {timeout_s:g} s (the host name's resolution did not end)"
    return box["reason"]


def check_address(engine: str, text: str, timeout_s: float | None = None,
                  environ: Mapping[str, str] | None = None,
                  read: Callable[[str], str | None] = _read_small) -> str:
    """The address to give ray or dask, once `text` has been read strictly (ray's `auto` resolved) and has
    answered the probe within `timeout_s` (PROBE_TIMEOUT_S); ConfigError("address") otherwise."""
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    environ = os.environ if environ is None else environ
    address = parse_address(engine, text)
    shown = text
    if address is None:  # ray's auto
        address, source = resolve_ray_auto(environ, read)
        shown = f"{address.target} (--address auto, from {source})"
    if address.scheme == "ray" and importlib.util.find_spec("grpc") is None:
        raise ConfigError("address", f"{text}: a ray:// address goes through Ray Client, which needs the grpcio "
                                     "package: pip install 'ray[client]', or give the cluster's GCS host:port")
    reason = probe_bounded(address, timeout_s)
    if reason is not None:
        if engine == "dask":
            raise ConfigError("address", f"no dask scheduler at {shown}: {reason}; give a running scheduler's "
                                         "tcp://host:port, or leave --address out for a local cluster")
        raise ConfigError("address", f"no ray cluster at {shown}: {reason}; give a running cluster's host:port "
                                     "(`ray status` on its head node shows it), or leave --address out for a local "
                                     "cluster")
    return address.target


__all__ = ["PROBE_TIMEOUT_S", "RAY_FORMS", "DASK_FORMS", "HTTP2_PREFACE", "Address", "parse_address",
           "resolve_ray_auto", "ray_current_cluster_file", "probe", "probe_bounded", "check_address"]
