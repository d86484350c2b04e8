"""The test servers' ports: a server restarted on its port must find it free."""

import socket

from tests.redis_server import ephemeral_range, free_port


def test_a_restartable_port_lies_below_the_ephemeral_range():
    low = ephemeral_range()[0]
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports), (ports, low)


def test_a_client_connection_can_hold_an_ephemeral_port_a_server_wants():
    """Why: while a server is down, an outgoing connection may take its old port as the
    local end, and the restart cannot bind it even with SO_REUSEADDR."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            taken = client.getsockname()[1]
            assert taken >= ephemeral_range()[0]
            with socket.socket() as restart:
                restart.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    restart.bind(("127.0.0.1", taken))
                    bound = True
                except OSError:
                    bound = False
                assert not bound
