"""Check a SuperNode's connection settings against its SuperLink before starting it: one line, in seconds.

``flower-supernode --insecure`` against a SuperLink that serves TLS (or ``--root-certificates``
against a plaintext one) retries for ever and logs nothing that names the cause. This probe
connects once, tries a TLS handshake and says which side is wrong::

    python -m fedfdp.flower.preflight --superlink 127.0.0.1:8000 --insecure
    python -m fedfdp.flower.preflight --superlink 127.0.0.1:8000 --root-certificates ca.crt

Exit status 0 with ``ok: ...`` when the settings match the SuperLink, else 2 with one ``error:``
line: nothing listening, a TLS/insecure mismatch, or a certificate the CA does not verify.
(``flower-supernode --max-wait-time 30`` also bounds the SuperNode's own retries to 30 s.)
"""

from __future__ import annotations

import argparse
import socket
import ssl
import sys
from pathlib import Path

__all__ = ["check_superlink", "main"]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--superlink must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server at ``host:port`` completes a TLS handshake (certificate not checked)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return True
        except (ssl.SSLError, ConnectionResetError, socket.timeout, OSError):
            return False


def check_superlink(address: str, *, insecure: bool, root_certificates: str | None, timeout: float = 5.0) -> str:
    """One line on whether a SuperNode with these settings can talk to the SuperLink at ``address``.

    Raises:
        ValueError: with the one-line cause when it cannot.
    """
    host, port = _split(address)
    if insecure == (root_certificates is not None):
        raise ValueError("give exactly one of --insecure and --root-certificates, as to flower-supernode")
    try:
        tls = _speaks_tls(host, port, timeout)
    except OSError as err:
        raise ValueError(f"nothing answers at {address} ({err.strerror or err}): is the SuperLink running, "
                         f"and is {port} its --port (default 8000)?") from None
    if insecure and tls:
        raise ValueError(f"the SuperLink at {address} serves TLS, but the SuperNode would connect with --insecure: "
                         "drop --insecure and give --root-certificates CA.crt (the CA of the SuperLink's certificate)")
    if not insecure and not tls:
        raise ValueError(f"the SuperLink at {address} serves plaintext (started with --insecure), but the SuperNode "
                         "would connect with TLS (--root-certificates): use --insecure, or restart the SuperLink "
                         "with --ssl-ca-certfile/--ssl-certfile/--ssl-keyfile")
    if root_certificates is not None:
        path = Path(root_certificates).expanduser()
        if not path.is_file():
            raise ValueError(f"--root-certificates {root_certificates}: no such file (relative paths are taken from "
                             f"{Path.cwd()})")
        context = ssl.create_default_context(cafile=str(path))
        context.check_hostname = False  # Flower checks the name; here only the chain of trust
        context.set_alpn_protocols(["h2"])
        try:
            with socket.create_connection((host, port), timeout=timeout) as raw, \
                    context.wrap_socket(raw, server_hostname=host):
                pass
        except ssl.SSLCertVerificationError as err:
            raise ValueError(f"the SuperLink's certificate at {address} is not signed by {root_certificates} "
                             f"({err.verify_message})") from None
    return f"the SuperLink at {address} serves {'TLS' if tls else 'plaintext'}, as the SuperNode's settings expect"


def main(argv: list[str] | None = None) -> int:
    """Command line: ``ok: ...`` and 0, or ``error: ...`` and 2.

    The one line is the command's output (as ``fedfdp.fit``'s ``error:`` line), not a log record:
    it is printed, so that no logging configuration can hide or reformat it.
    """
    parser = argparse.ArgumentParser(prog="python -m fedfdp.flower.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--superlink", required=True, help="HOST:PORT, as given to flower-supernode")
    parser.add_argument("--insecure", action="store_true", help="the SuperNode connects without TLS")
    parser.add_argument("--root-certificates", default=None, help="the CA certificate the SuperNode trusts")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per connection attempt")
    args = parser.parse_args(argv)
    try:
        line = check_superlink(args.superlink, insecure=args.insecure, root_certificates=args.root_certificates,
                               timeout=args.timeout)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"ok: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
