"""Why a server that accepts connections still cannot be spoken to: the wrong transport.

A ``redis://`` URL aimed at a TLS port, a ``rediss://`` URL aimed at a plain port, and a
TLS server that requires a client certificate none was configured for all look the
same from redis-py: the connection opens, then breaks ("Connection reset by peer",
"Error 8 while writing to socket", a handshake that times out). Served as an outage,
every call of the serving loop would fail the same way for as long as the deployment
runs. So when the start-up probe fails like that, :func:`transport_problem` asks the
server directly, on one fresh socket per question, and names the mistake when it sees
positive evidence of one: a plain Redis reply, a completed TLS handshake, a TLS alert.
Without such evidence it says nothing, and a server that is merely slow or down stays
an outage the backend waits out.
"""

from __future__ import annotations

import socket
import ssl

from kvconn_redis._config import RedisConfig

__all__ = ["transport_problem"]

#: Alerts a TLS server sends when it wants a client certificate it did not get (TLS 1.3
#: sends the first after the handshake, TLS 1.2 the others during it).
_CERTIFICATE_ALERTS = ("CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE", "BAD_CERTIFICATE")


def transport_problem(config: RedisConfig) -> str | None:
    """What is wrong with how the backend talks to ``config``'s (first) server, or None.

    Each question waits at most ``connect_timeout_s``; only called at start-up, after
    the probe failed on a connection that had opened.
    """
    if config.unix_path is not None or not config.nodes:
        return None
    host, port = config.nodes[0]
    where = config.where
    timeout = config.connect_timeout_s
    if not config.tls:
        if _completes_tls_handshake(host, port, timeout):
            return (
                f"redis at {where}: the server speaks TLS on port {port}, and the URL asks "
                "for plain TCP; use a rediss:// URL (with tls_ca_file if its certificate "
                "is not signed by a system CA)"
            )
        return None
    if _answers_plain_resp(host, port, timeout):
        return (
            f"redis at {where}: the server speaks plain TCP on port {port}, not TLS; use "
            "a redis:// URL, or the port given to the server's --tls-port"
        )
    alert = _alert_after_handshake(config, host, port, timeout)
    if alert is None:
        return None
    if config.tls_cert_file is None and any(a in alert for a in _CERTIFICATE_ALERTS):
        return (
            f"redis at {where}: the server requires a TLS client certificate and none is "
            f"configured (it answered the handshake with {alert}); set tls_cert_file and "
            "tls_key_file, or turn tls-auth-clients off on the server"
        )
    return (
        f"redis at {where}: the server refused the TLS connection ({alert}); check "
        "tls_cert_file, tls_key_file and tls_ca_file against the server's TLS settings"
    )


def _connect(host: str, port: int, timeout: float) -> socket.socket | None:
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # refused or unreachable: an outage, not a transport mistake


def _completes_tls_handshake(host: str, port: int, timeout: float) -> bool:
    """Whether a TLS handshake succeeds (any certificate: only the protocol matters)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    sock = _connect(host, port, timeout)
    if sock is None:
        return False
    try:
        with context.wrap_socket(sock, server_hostname=host):
            return True
    except (OSError, ValueError):  # ssl.SSLError, a timeout, a reset
        return False
    finally:
        sock.close()


def _answers_plain_resp(host: str, port: int, timeout: float) -> bool:
    """Whether ``PING`` in plain RESP gets a RESP reply (``+PONG``, ``-NOAUTH …``)."""
    sock = _connect(host, port, timeout)
    if sock is None:
        return False
    try:
        sock.sendall(b"PING\r\n")
        reply = sock.recv(64)
    except OSError:
        return False
    finally:
        sock.close()
    return reply[:1] in (b"+", b"-") and reply.endswith(b"\r\n")


def _alert_after_handshake(config: RedisConfig, host: str, port: int, timeout: float) -> str | None:
    """The TLS alert the server sends during or right after the handshake, if any.

    Made with the backend's own TLS settings. A server that wants a client certificate
    it did not get says so at once (TLS 1.3: right after the handshake, before any
    command), so reading first, without sending anything, catches the alert instead of
    the broken pipe a write would meet. No alert within ``timeout``: no verdict.
    """
    context = ssl.create_default_context(cafile=config.tls_ca_file)
    if config.tls_cert_file is not None:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    if not config.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    sock = _connect(host, port, timeout)
    if sock is None:
        return None
    try:
        with context.wrap_socket(sock, server_hostname=host) as tls:
            tls.recv(1)
    except ssl.SSLCertVerificationError:
        return None  # the server's certificate: reported by the error translation
    except ssl.SSLEOFError:
        return None  # closed without an alert: a server going away, say; no verdict
    except ssl.SSLError as exc:
        return exc.reason or str(exc)
    except OSError:  # a timeout (no alert), a reset
        return None
    finally:
        sock.close()
    return None
