"""The Ray Serve backend: a catalog model with ``backend = "ray"`` is served by a Ray Serve
application instead of the embedded pool, on one host or a Ray cluster of many.

Ray Serve places the replicas, routes each adapter's requests to the replicas that hold it
(``@serve.multiplexed``), restarts a replica that fails its health check, and scales each model
between the catalog's ``min_replicas`` (0 allowed) and ``replicas``. The gateway in front stays the
same: it authenticates, scopes by organization, counts usage, and sends the request to the
application's ingress with the internal token.

- ``replica``: one Serve replica: vLLM's OpenAI server (with our CPU LoRA kernels), the same
  process the embedded pool starts, and the adapters it holds, read from the dynamic LoRA path
- ``ingress``: the HTTP entry point: checks the token, pins a fine-tune to its published revision,
  and hands the request to the model's replicas, multiplexed by that name
- ``app``: the application built from the catalog (one source of truth for both backends)
- ``python -m inference.ray_serve``: deploy it on a Ray cluster (RAY_ADDRESS) or a local one
"""
