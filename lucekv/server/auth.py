"""Who is calling (DESIGN §10 Trust): bearer tokens mapped to principals, their session namespaces, their limits.

Token file (`--auth-tokens`): one `PRINCIPAL TOKEN` per line, `#` comments. A principal is 1-32 characters of
[A-Za-z0-9._-]; several tokens may map to one principal (rotation). Every RPC but grpc.health.v1 needs metadata
`authorization: Bearer TOKEN`; the token is compared in constant time against every known token.

A principal's session "chat-1" is the engine's session "alice:chat-1": tenants share no session ids, so one can
neither see nor touch another's. Without a token file there is one anonymous principal and ids are used as given.
"""

from __future__ import annotations

import hmac
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from lucekv.errors import ConfigError, ResourceLimitError
from lucekv.snapshot.store import check_session_id

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
_PRINCIPAL = re.compile(r"[A-Za-z0-9._-]{1,32}")
_SEPARATOR = ":"  # never in a principal, so "alice:x" can only be alice's


class Authenticator:
    def __init__(self, tokens: dict[str, str]):
        """tokens: token -> principal. Empty: authentication is off."""
        self._tokens = [(t.encode(), p) for t, p in tokens.items()]

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        if path is None:
            return cls({})
        tokens: dict[str, str] = {}
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--auth-tokens {path}: {e}") from e
        for n, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2 or not _PRINCIPAL.fullmatch(words[0]) or len(words[1]) < 16:
                raise ConfigError(f"--auth-tokens {path}, line {n}: expected 'PRINCIPAL TOKEN' (a principal of "
                                  "1-32 characters A-Z a-z 0-9 . _ -, a token of 16 or more characters)")
            if words[1] in tokens:
                raise ConfigError(f"--auth-tokens {path}, line {n}: a token given twice")
            tokens[words[1]] = words[0]
        if not tokens:
            raise ConfigError(f"--auth-tokens {path}: no tokens in the file")
        return cls(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def principal(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """The caller's principal ("" when authentication is off); None for a missing or unknown token."""
        if not self.enabled:
            return ""
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(header, str) or not header.startswith("Bearer "):
            return None
        offered = header[len("Bearer "):].encode()
        found = None
        for token, principal in self._tokens:  # every token is compared: the time does not tell which matched
            if hmac.compare_digest(offered, token):
                found = principal
        return found


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Calls without a known token end with UNAUTHENTICATED before any handler runs; health checks pass."""

    def __init__(self, auth: Authenticator, on_refused: Callable[[str], None]):
        self._auth = auth
        self._on_refused = on_refused

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (handler is None or details.method.startswith(HEALTH_METHOD_PREFIX)
                or self._auth.principal(details.invocation_metadata) is not None):
            return handler
        self._on_refused(details.method)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")

    kind = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
    return kind(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def scoped(principal: str, session_id: str) -> str:
    """The engine's id of the principal's session (checked: a bad id is INVALID_ARGUMENT)."""
    check_session_id(session_id)
    return check_session_id(f"{principal}{_SEPARATOR}{session_id}") if principal else session_id


def unscoped(principal: str, engine_id: str) -> str | None:
    """The principal's name for an engine session id; None if the session is not the principal's."""
    if not principal:
        return engine_id
    prefix = principal + _SEPARATOR
    return engine_id[len(prefix):] if engine_id.startswith(prefix) else None


class StreamLimit:
    """At most `limit` streaming calls open per principal at once (0: no limit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, principal: str) -> Iterator[None]:
        with self._lock:
            n = self._open.get(principal, 0)
            if self.limit and n >= self.limit:
                raise ResourceLimitError(f"{n} calls of this principal are open, the limit (--max-streams); "
                                         "retry when one ends")
            self._open[principal] = n + 1
        try:
            yield
        finally:
            with self._lock:
                self._open[principal] -= 1
