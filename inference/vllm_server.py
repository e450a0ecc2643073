"""vLLM's OpenAI server with this platform's CPU LoRA kernels (``inference.lora_kernels``).

vLLM runs the model in processes it starts itself; with the ``spawn`` start method they import this
module again (as ``__mp_main__``), so the patch is installed at import time, in every one of them.
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent() -> None:
    """SIGTERM this server when the pool that started it dies, however it dies: no orphan keeps the port."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent == 1:  # the pool died before the line above: nobody would ever stop this server
        sys.exit(1)


if __name__ == "__main__":
    stop_with_parent()  # first: importing vLLM takes seconds

from inference import lora_kernels

if lora_kernels.install():
    print(f"inference.vllm_server: dense CPU LoRA kernels installed (pid {os.getpid()})", file=sys.stderr)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
