"""The ports the test vLLM servers listen on (``tests/vllm_server.free_port``): a server killed mid-run
is started again on its port, so the port must not be one the kernel hands to outgoing connections."""

import socket

from vllm_server import LISTEN_PORTS, ephemeral_ports, free_port


def test_a_server_port_is_free_and_never_an_ephemeral_one():
    ephemeral = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(p in LISTEN_PORTS and p not in ephemeral for p in ports)
    for port in ports:
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_outgoing_connections_take_ephemeral_ports_only():
    """The premise: a connection's own port comes from ``ephemeral_ports``, so none can take a server's."""
    ephemeral = ephemeral_ports()
    with socket.create_server(("127.0.0.1", 0)) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(20)]
        try:
            assert all(c.getsockname()[1] in ephemeral for c in clients)
        finally:
            for client in clients:
                client.close()
