"""A one-node run's rendezvous on the loopback interface only.

torchrun's c10d rendezvous opens two TCP stores in the launcher (the rendezvous store, and the store it shares
with the workers as MASTER_ADDR:MASTER_PORT), both listening on every interface, also for ``--standalone``
(``localhost:0``: the port is random, the address is not loopback). Anyone who can reach the machine can then read
and write the run's keys, and a store value is unpickled by torch in places. A run of one node has nobody else to
meet: here both stores listen on 127.0.0.1 only (a socket bound there, handed to TCPStore as its listening fd), and
the workers are told MASTER_ADDR=127.0.0.1. Runs of several nodes keep torch's stores (they must be reachable from
the other nodes: docs/security.md).
"""

from __future__ import annotations

import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"
DEFAULT_C10D_PORT = 29400  # torch's c10d rendezvous default


def loopback_store(port: int, timeout_s: float = 60):
    """A TCPStore server that accepts connections on 127.0.0.1 only."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(1024)
    bound_port = sock.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK,
        bound_port,
        is_master=True,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),
    )


def loopback_c10d_handler(params):
    """torch's dynamic rendezvous handler with a c10d backend, as torchrun builds it for ``params``, but with both of
    its stores on the loopback interface (``params`` must describe one node: max_nodes 1)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    _host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_C10D_PORT)
    timeout_s = params.get_as_int("read_timeout", 60)
    store = loopback_store(port, timeout_s)
    params.local_addr = LOOPBACK  # what the workers get as MASTER_ADDR
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    # the store torch shares with the workers (torch's own builds it on every interface)
    handler._create_tcp_store_server = lambda _addr, server_port: loopback_store(server_port, timeout_s)
    return handler
