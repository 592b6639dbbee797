"""After the world is up, an intruder connects to rank 0's store with a wrong secret."""
import socket
import struct
import sys
import time

import numpy as np

from smdistributed.common import engine
from smdistributed.common.discovery import discover


def main():
    core = engine.init()
    if core.rank == 1:
        w = discover()
        with socket.create_connection((w.store_addr, w.store_port), timeout=10) as s:
            bad = b"not-the-secret"
            s.sendall(struct.pack("<Q", len(bad)) + bad)
            s.settimeout(10)
            reply = b""
            while True:  # the store says it refuses, then closes the connection
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
            closed = b"smddp-store-refused" in reply and b"store-ok" not in reply
        print("INTRUDER_CLOSED=%s" % closed, flush=True)
    core.barrier(name="after-intruder")
    if core.rank == 0:
        deadline = time.monotonic() + 10
        while core.store_refused_connections() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        print("REFUSED=%d" % core.store_refused_connections(), flush=True)
    x = np.ones(2, np.float32)
    core.allreduce(x)
    engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
