"""/v1 refuses a body over its limit without reading it: by Content-Length before a byte
of it, and, without one (chunked), as soon as what came in passes the limit. A client that
never finishes its body gets its 413 all the same."""

import socket

import pytest

from app.server.openai_api import MAX_BODY_BYTES
from tests.server.test_bad_input import assert_still_healthy, server  # noqa: F401 (fixture)

CHUNK = 256 << 10


def post(live, headers: list[str], parts) -> bytes:
    """Send a request's head and body parts (stopping if the server hangs up), then read
    what comes back."""
    host, port = "127.0.0.1", live.port
    with socket.create_connection((host, port), timeout=20) as s:
        head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}",
                "Content-Type: application/json", *headers, "", ""]  # fmt: skip
        s.sendall("\r\n".join(head).encode())
        try:
            for part in parts:
                s.sendall(part)
        except OSError:
            pass  # it answered and closed: what it said is in the buffer
        reply = b""
        while b"\r\n\r\n" not in reply:
            data = s.recv(65536)
            if not data:
                break
            reply += data
        return reply


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server):  # noqa: F811
    reply = post(server, ["Content-Length: 400000000"], [b"{" + b" " * CHUNK])
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert_still_healthy(server)


def test_a_chunked_body_is_cut_off_at_the_limit(server):  # noqa: F811
    def chunks():
        for _ in range(MAX_BODY_BYTES // CHUNK + 4):  # past the limit, and never ended
            yield f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"

    reply = post(server, ["Transfer-Encoding: chunked"], chunks())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert_still_healthy(server)


@pytest.mark.parametrize("length", ["-1", "12abc"])
def test_a_malformed_length_is_not_a_crash(server, length):  # noqa: F811
    reply = post(server, [f"Content-Length: {length}"], [b"{}"])
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
