"""vLLM's OpenAI server with this platform's CPU LoRA kernels (``inference.lora_kernels``).

vLLM runs the model in processes it starts itself; with the ``spawn`` start method they import this
module again (as ``__mp_main__``), so the patch is installed at import time, in every one of them.
"""

import os
import sys

from inference import lora_kernels

if lora_kernels.install():
    print(f"inference.vllm_server: dense CPU LoRA kernels installed (pid {os.getpid()})", file=sys.stderr)

if __name__ == "__main__":
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
