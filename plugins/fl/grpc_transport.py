"""gRPC over mutually authenticated TLS: the server side of the :class:`.coordinator.Coordinator`, and a client.

Two unary methods carry frames (:mod:`.framing`) as raw bytes, through grpc's generic handlers (no protoc):
``Next`` long-polls for the client's request at its next stage, ``Reply`` answers it. The server requires a
client certificate signed by the run's CA and takes the client id from its subject (``client-<id>``); a
header naming another client is refused.
"""

from __future__ import annotations

import errno
import socket
from concurrent import futures
from typing import Any

import grpc

from crosstrain.plugins.fl import framing
from crosstrain.plugins.fl.certs import Identity, client_id
from crosstrain.plugins.fl.coordinator import POLL_S, Coordinator
from crosstrain.plugins.fl.framing import TransportError

SERVICE = "crosstrain.fl.Federation"


class Unreachable(TransportError):
    """No TLS session: the server is not (yet) listening, or the handshake failed (e.g. an untrusted certificate)."""

MAX_MESSAGE = 512 * 1024 * 1024
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
# gRPC sets SO_REUSEPORT by default, so a second server on a busy port would start and take half the clients
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]


def _peer_client(context: grpc.ServicerContext) -> int:
    names = context.auth_context().get("x509_common_name") or []
    cid = client_id(names[0].decode()) if len(names) == 1 else None
    if cid is None:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"certificate subject {names!r} is not a client-<id>")
    return cid  # type: ignore[return-value]


class _Service:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def _frame(self, request: bytes, context: grpc.ServicerContext) -> tuple[int, dict[str, Any], bytes]:
        client = _peer_client(context)
        try:
            header, payload = framing.decode(request)
        except TransportError as exc:
            self.coordinator.rejected += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if header.get("client", client) != client:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"header names client {header.get('client')!r} but the certificate is client-{client}")
        return client, header, payload

    def next(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        client, header, _ = self._frame(request, context)
        out, payload = self.coordinator.next(client, header)
        return framing.encode(out, payload)

    def reply(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        client, header, payload = self._frame(request, context)
        try:
            self.coordinator.reply(client, header, payload)
        except Exception as exc:  # a transport or protocol rejection: tell the client, keep serving
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        return framing.encode({"ok": True})


def serve(coordinator: Coordinator, identity: Identity, address: str, max_clients: int) -> tuple[grpc.Server, int]:
    """Start the TLS server on ``address`` (``HOST:0`` picks a free port); returns it and its port."""
    service = _Service(coordinator)
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Next": grpc.unary_unary_rpc_method_handler(service.next),
        "Reply": grpc.unary_unary_rpc_method_handler(service.reply),
    })
    # every waiting long-poll holds a worker thread
    check_free(address)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * max_clients + 8), options=_SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    creds = grpc.ssl_server_credentials([(identity.key, identity.cert)], root_certificates=identity.ca,
                                        require_client_auth=True)
    try:
        port = server.add_secure_port(address, creds)
    except RuntimeError:  # newer grpc raises where older ones return 0
        port = 0
    if port == 0:
        raise TransportError(f"cannot listen on {address}; pick a free port in fl.address")
    server.start()
    return server, port


def check_free(address: str) -> None:
    """TransportError in one line if nothing may listen on ``address`` (busy port, unknown host): checked with a
    plain socket first, because gRPC's own bind failure comes after a line of its core's log."""
    host, port = address.rsplit(":", 1)
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise TransportError(f"fl.address={address!r}: cannot resolve host {host!r} ({exc.strerror}); set "
                             "fl.address to HOST:PORT of this machine") from None
    family, kind, proto, _, where = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # SO_REUSEADDR as gRPC sets it (a port left in TIME_WAIT by a stopped server is free), no SO_REUSEPORT:
        # the bind fails while another server listens there
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(where)
        except OSError as exc:
            fix = ("stop the other server or pick a free port in fl.address (port 0: any free port)"
                   if exc.errno == errno.EADDRINUSE else "fl.address must name this machine (e.g. 0.0.0.0:PORT)")
            raise TransportError(f"cannot listen on {address}: {exc.strerror}; {fix}") from None


class GrpcChannel:
    """A client's connection to the server: :meth:`next` and :meth:`reply` exchange frames over TLS."""

    def __init__(self, target: str, identity: Identity, timeout_s: float = 30.0) -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=identity.ca, private_key=identity.key,
                                             certificate_chain=identity.cert)
        self._channel = grpc.secure_channel(target, creds, options=_OPTIONS)
        self._next = self._channel.unary_unary(f"/{SERVICE}/Next")
        self._reply = self._channel.unary_unary(f"/{SERVICE}/Reply")
        self.timeout_s = timeout_s

    def next(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        frame = self._call(self._next, framing.encode(header), POLL_S + self.timeout_s)
        return framing.decode(frame)

    def reply(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self._call(self._reply, framing.encode(header, payload), self.timeout_s)

    def _call(self, method: Any, frame: bytes, timeout: float) -> bytes:
        try:
            return method(frame, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            error = Unreachable if code == grpc.StatusCode.UNAVAILABLE else TransportError
            raise error(f"server refused or unreachable ({code}): {exc.details()}") from None

    def close(self) -> None:
        self._channel.close()
