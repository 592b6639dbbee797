"""Listening ports for a job's rendezvous, chosen outside the kernel's ephemeral range.

A launcher that asks the kernel for a free port (bind to port 0), closes it and hands the
number to rank 0 leaves a window of seconds (the ranks start Python, import torch) in which
that port is free. bind(0) draws from the ephemeral range, the same range every other
bind(0) and outgoing connect() on the machine draws from (NCCL's bootstrap listeners, other
jobs' stores, any client). One of them can take the port first; rank 0 then fails to bind
and the other ranks wait on a store that never comes. Ports below the ephemeral range are
never handed out implicitly, so only another program that names the same port explicitly
can collide, and the bind check below catches one that already holds it.
"""
from __future__ import annotations

import errno
import random
import socket
from typing import List, Tuple

# Linux's default ephemeral range, used where /proc does not say (and IANA's on other systems
# starts higher, at 49152, so ports below 32768 are outside it there too).
_DEFAULT_EPHEMERAL = (32768, 60999)
# Ports are taken from [LOWEST, HIGHEST) where that lies below the ephemeral range: above it
# are Kubernetes' NodePorts (30000-32767), which iptables may redirect with no socket bound
# for a bind check to see; below it the commonly configured service ports.
LOWEST, HIGHEST = 20000, 30000
_TRIES = 200


def ephemeral_range() -> Tuple[int, int]:
    """The kernel's range for implicitly assigned ports (inclusive)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
            return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _candidates() -> List[Tuple[int, int]]:
    """Port spans (inclusive) outside the ephemeral range, the preferred first: [LOWEST,
    HIGHEST), then above the range, then the registered ports below LOWEST. 65535 is left
    out: a store may listen on MASTER_PORT + 1."""
    low, high = ephemeral_range()
    spans = [(LOWEST, min(low, HIGHEST) - 1), (high + 1, 65534), (1024, min(low, LOWEST) - 1)]
    return [(a, b) for a, b in spans if b - a >= 64]


def _bindable(port: int) -> bool:
    # Without SO_REUSEADDR: a port still in TIME_WAIT or held by any socket counts as taken.
    # IPv6 too, since torch's store listens on both where it can.
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 on this machine: IPv4 decides
            return False
    return True


def free_listen_ports(count: int) -> List[int]:
    """`count` distinct ports that nothing holds now, outside the ephemeral range, no two
    adjacent (a store may listen on MASTER_PORT + 1). Falls back to ports the kernel picks
    when no span outside the range exists (a range configured to cover nearly everything)."""
    taken: set = set()
    chosen: List[int] = []
    spans = _candidates()
    rng = random.SystemRandom()
    tries = 0
    while len(chosen) < count and spans and tries < _TRIES * count:
        tries += 1
        low, high = spans[0] if tries <= _TRIES // 2 else rng.choice(spans)
        port = rng.randint(low, high)
        if any(abs(port - t) <= 1 for t in taken) or not _bindable(port):
            continue
        chosen.append(port)
        taken.add(port)
    while len(chosen) < count:
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
        if port < 65535 and all(abs(port - t) > 1 for t in taken) and _bindable(port):
            chosen.append(port)
            taken.add(port)
    return chosen
