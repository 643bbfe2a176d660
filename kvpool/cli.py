"""The KV pool's processes: ``pdserve kvpool gmanager`` and ``pdserve kvpool node``."""

from __future__ import annotations

from pdserve.cli import Dispatcher

ROLES = {"gmanager": "pdserve.kvpool.gmanager", "node": "pdserve.kvpool.node"}

add_arguments, run = Dispatcher("pdserve kvpool", ROLES, "role").functions()
