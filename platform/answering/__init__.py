"""An organization's completion, from the check of the models it names to its counted answer.

The one path every answer the platform asks for takes: the gateway's (after the API key, the rates
and the request's caps, ``gateway.completions``) and the workers' (evaluation runs and the publish
gate, ``answering.batch``). Each answer goes to its model's backend (the embedded pool or Ray
Serve, ``base.serving_client.serving_url``) with the organization's cache salt and fair-use header,
and its tokens are counted in the organization's usage (``usage.meter``).
"""
