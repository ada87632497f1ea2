"""Messages between a worker and the main process (segment requests, results, errors).

Plain pickle over the pipe, not ``Connection.send``: multiprocessing's ForkingPickler ships tensors
as file descriptors, which vanish when the sending worker exits right after sending its result.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any


def send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())
