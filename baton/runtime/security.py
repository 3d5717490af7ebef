"""Transport security of Baton's ports: TLS from certificate files, mutual TLS between
Baton's processes, and the public API's bearer token.

    internal ports (workers, the gateway's admin port)   TLS; with a CA, client
                                                         certificates required (mTLS)
    the gateway's public port                            TLS, no client certificate;
                                                         `authorization: Bearer <key>`
                                                         on every call but health and
                                                         reflection (ApiKeyInterceptor)
    calls between Baton's processes                      verify the server against the
                                                         CA, present our own certificate

The files are read once, at startup (a missing or unreadable one is a settings
error): a Kubernetes TLS secret mounts them as tls.crt, tls.key and ca.crt.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

# Calls that stay open without a token: load balancers and probes check health, and
# reflection describes only what the protos already say.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
AUTHORIZATION = "authorization"


def read_secret_file(path: str, what: str) -> bytes:
    """The bytes of a mounted secret; ValueError (one line, naming the setting) if unreadable or empty."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what}: cannot read {path}: {error.strerror or error}") from None
    if not data.strip():
        raise ValueError(f"{what}: {path} is empty")
    return data


def _read_pem(path: str, what: str) -> bytes:
    data = read_secret_file(path, what)
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {path} is not PEM (-----BEGIN ...)")
    return data


@dataclass(frozen=True, repr=False)
class TlsConfig:
    """PEM bytes: this process's certificate chain and key (served, and presented as a
    client certificate), and the CA bundle peers are verified against. With a CA,
    internal ports require client certificates; without one, peers are verified
    against the system's roots and no client certificate is asked for."""

    cert_chain: bytes | None = None
    private_key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None  # overrides the name checked in a server's certificate

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None, server_name: str | None = None,
             *, serving: bool = True) -> TlsConfig | None:
        """Read the files; None when none is given (plaintext). ValueError for a missing
        file or an incomplete set: a server needs its certificate and key; a client
        (`serving=False`) may give only a CA, or a certificate and key for mTLS."""
        if (cert is None) != (key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if serving and ca is not None and cert is None:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (this process's own certificate)")
        if cert is None and ca is None:
            if server_name is not None:
                raise ValueError("--tls-server-name needs TLS (--tls-ca or --tls-cert)")
            return None
        return cls(
            cert_chain=None if cert is None else _read_pem(cert, "--tls-cert"),
            private_key=None if key is None else _read_pem(key, "--tls-key"),
            ca=None if ca is None else _read_pem(ca, "--tls-ca"),
            server_name=server_name or None,
        )

    def __repr__(self) -> str:  # never the key
        return f"TlsConfig(mutual={self.is_mutual}, server_name={self.server_name!r})"

    @property
    def is_mutual(self) -> bool:
        """Internal ports require (and verify) client certificates."""
        return self.ca is not None

    def server_credentials(self, *, internal: bool) -> grpc.ServerCredentials:
        """An internal port requires a client certificate the CA signed (when there is a CA);
        the public port asks for none."""
        require = internal and self.is_mutual
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.ca if require else None,
            require_client_auth=require,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `api_key` (none without one)."""
    return () if not api_key else ((AUTHORIZATION, f"Bearer {api_key}"),)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses with UNAUTHENTICATED every call that lacks `authorization: Bearer <key>`,
    except health and reflection. The comparison takes the same time wherever the
    token differs."""

    def __init__(self, api_key: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        if not api_key:
            raise ValueError("the API key is empty")
        self._expected = f"Bearer {api_key}".encode()
        self._open_prefixes = tuple(open_prefixes)

    def is_authorized(self, metadata) -> bool:
        presented = dict(metadata or ()).get(AUTHORIZATION, "")
        if isinstance(presented, str):
            presented = presented.encode()
        return hmac.compare_digest(presented, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._open_prefixes):
            return handler
        if self.is_authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusing(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization: Bearer <key>)")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call before reading it."""
    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **codec)
    return grpc.unary_unary_rpc_method_handler(_refuse, **codec)
