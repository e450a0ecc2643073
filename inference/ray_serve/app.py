"""The Ray Serve application for the catalog's Ray-backed models, from the catalog alone.

The catalog is the one source of truth for both backends: a replica runs the vLLM command line the
embedded pool would run (``inference.replica.vllm_command``: ``lora_config`` and ``engine``), and
the catalog's ``autoscaling`` becomes Serve's ``autoscaling_config``:

- ``min_replicas`` (0: scale to zero) and ``replicas`` (the most) bound it; scaled to zero with
  ``idle = "sleep"``, one replica stays, its engine asleep while idle (``replica.VllmReplica``);
- Serve starts another replica when the replicas average ``target_ongoing_requests`` in flight;
- a replica past the minimum stops after ``downscale_delay_s`` with less to do.
"""

from __future__ import annotations

from typing import Any

from core.catalog import BaseModel
from inference.ray_serve.ingress import Ingress, deployment_name
from inference.ray_serve.replica import VllmReplica

APP_NAME = "fineserve"
UPSCALE_DELAY_S = 5.0  # Serve's default is 30 s: a busy CPU replica should get help sooner
INGRESS_MAX_ONGOING = 1000  # it only relays: the replicas' limits are the ones that matter


def replica_options(model: BaseModel) -> dict[str, Any]:
    scaling = model.autoscaling
    # Serve scales to zero by stopping the replica; asleep, it keeps its process and wakes in a second.
    kept = 1 if scaling.keeps_one_asleep else scaling.min_replicas
    return {
        "name": deployment_name(model.id),
        "ray_actor_options": {"num_cpus": 1},  # one engine per CPU a node offers
        # Room for a burst above the target: vLLM batches whatever it is given.
        "max_ongoing_requests": 4 * scaling.target_ongoing_requests,
        "autoscaling_config": {
            "min_replicas": kept,
            "initial_replicas": kept,
            "max_replicas": model.replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": UPSCALE_DELAY_S,
            "downscale_delay_s": scaling.downscale_delay_s,
        },
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }


def build_app(models: tuple[BaseModel, ...]) -> Any:
    """The Serve application: the ingress, and a deployment of replicas per model."""
    from ray import serve

    replicas = {model.id: serve.deployment(**replica_options(model))(VllmReplica).bind(model) for model in models}
    ingress = serve.deployment(
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING
    )(Ingress)  # num_cpus 0: a node's CPUs are for the engines, and a 1-CPU node could not place both
    return ingress.bind(replicas, models, APP_NAME)
