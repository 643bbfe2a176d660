"""Entry point of a ``pdserve`` command re-executed under the vLLM environment's python (env.py).

Maps ``pdserve`` and its subpackages to the folders named in ``$PDSERVE_PACKAGE_DIRS`` (the
checkout that started the command), then runs ``pdserve.cli.main`` on the same arguments.
Standard library only until the mapping is in place.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path


class _PackageDirs(importlib.abc.MetaPathFinder):
    def __init__(self, dirs: dict[str, str]):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        init = Path(folder) / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[folder])


def main() -> int:
    raw = os.environ.get("PDSERVE_PACKAGE_DIRS")
    if not raw:
        print("pdserve: bootstrap.py is started by `pdserve ... --engine vllm`, not by hand", file=sys.stderr)
        return 2
    sys.meta_path.insert(0, _PackageDirs(json.loads(raw)))
    from pdserve.cli import main as cli_main

    sys.argv = ["pdserve", *sys.argv[1:]]
    return int(cli_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
