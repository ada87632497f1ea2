"""Imported by the fork server only, as its last preload (:func:`.forkserver.ensure_running`): the server leaves
with ``os._exit`` when the main process exits, instead of an interpreter shutdown nobody waits for but a reader
of the main process's output (see :mod:`.forkserver`). Importing it anywhere else would make that process exit
the same way: nothing else imports it."""

import atexit
import os

from lightning_shm.runtime.forkserver import leave_at_once

atexit.register(leave_at_once, os.getpid())
