"""Internal. The broadcast transport's rendezvous store: the sender hosts a TCPStore on the address the
coordinator hands out, every party connects to it, and each group is built on a PrefixStore of it."""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist


def node_address() -> str | None:
    """This process's Ray node address (what other nodes reach it by), or None without Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return None


def store_host(config_host: str) -> str:
    """The address receivers dial: ``auto`` is this node's Ray address."""
    if config_host != "auto":
        return config_host
    return node_address() or socket.gethostbyname(socket.gethostname())


def host_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store, listening on ``host`` only. torch's TCPStore server binds every
    interface by itself, so we bind the socket and hand it over (master_listen_fd); the store
    owns the descriptor from then on and closes it. Port 0: a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound, None, True, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
