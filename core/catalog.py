"""The model catalog: the base models the platform offers, and how each is served.

Like RayLLM's model configs, one TOML file lists each base model with its weights, its
``lora_config`` and its engine settings. The platform offers these models and nothing else.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.env import ConfigError


@dataclass(frozen=True)
class GgufSource:
    """Where set-up finds weights to convert when no model hub is reachable."""

    package: str  # an installed Python package that ships the GGUF file
    file: str


@dataclass(frozen=True)
class ToolCalling:
    """How a model's chat template renders tools, and who reads the calls it answers with.

    The template in the model's weights folder renders ``tools`` and assistant ``tool_calls`` in one
    form (``hermes``: the signatures in the system turn, each call as ``<tool_call>{"name",
    "arguments"}</tool_call>``); ``parser`` names vLLM's tool-call parser for that form. The trainer
    renders with the same folder's template, so a fine-tune learns the form the parser reads.
    """

    parser: str  # vLLM's --tool-call-parser
    # A template to install in the weights folder (set-up does, when it differs), relative to the catalog
    # file: for a model whose own template renders no tools (SmolLM2's). None: the folder's own renders them.
    chat_template: Path | None = None


@dataclass(frozen=True)
class LoraConfig:
    dynamic_lora_loading_path: str  # adapters live at <path>/<base_model_id>:<suffix>/
    max_num_adapters_per_replica: int  # the LRU set of adapters one replica keeps loaded
    max_lora_rank: int
    # Fair use of a replica's adapters among organizations (``inference.adapter_slots.FairUse``):
    max_mixes_per_organization: int = 8  # distinct mixes one organization may hold on one replica
    organization_share: float = 0.5  # of a replica's adapters, one organization's most while others hold some


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    dtype: str
    max_loras: int  # adapters that can share one batch
    # CPU backend only: memory for the KV cache, which the engine allocates and touches whole when it starts (first
    # touch is slow on these machines: about 3.5 s a GiB, measured from the engine's log).
    kv_cache_space_gib: float
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class Autoscaling:
    """Serverless behaviour: how many replicas run with no traffic, and when more start and stop.

    The embedded pool runs between ``min_replicas`` and ``replicas``: a request that finds no
    replica running starts one and waits for it up to ``cold_start_wait_s`` (then a 503 with
    Retry-After); one more starts when every running replica has ``target_ongoing_requests`` in
    flight; a replica above the minimum stops after ``downscale_delay_s`` without a request."""

    min_replicas: int  # 0: scale to zero; the default, ``replicas``: always on
    target_ongoing_requests: int
    downscale_delay_s: float
    cold_start_wait_s: float
    # What a model scaled to zero keeps (one of IDLE_CHOICES): "sleep", one replica's process, its
    # engine's KV cache given back (the next request wakes it in about a tenth of a second); "stop",
    # nothing (the next request starts a replica: 12-19 s on a CPU). Replicas past the minimum that
    # are not kept asleep stop. docs/serving.md compares them.
    idle: str = "sleep"

    @property
    def keeps_one_asleep(self) -> bool:
        """Scaled to zero with ``idle = "sleep"``: one replica is kept, its engine asleep while idle."""
        return self.min_replicas == 0 and self.idle == "sleep"


IDLE_CHOICES = ("sleep", "stop")


BACKENDS = ("embedded", "ray")  # who serves a model: the embedded pool, or Ray Serve (inference.ray_serve)


@dataclass(frozen=True)
class BaseModel:
    id: str
    backend: str  # one of BACKENDS
    weights: Path
    prepare_from: GgufSource | None
    replicas: int  # the most replicas: vLLM processes the pool starts, or Ray Serve's max_replicas
    lora: LoraConfig
    engine: EngineConfig
    autoscaling: Autoscaling
    tools: ToolCalling | None = None  # None: its template renders no tools, and requests with tools are refused


@dataclass(frozen=True)
class Catalog:
    models: tuple[BaseModel, ...]

    def served_by(self, backend: str) -> Catalog:
        """The models one backend serves."""
        return Catalog(tuple(model for model in self.models if model.backend == backend))

    def get(self, model_id: str) -> BaseModel | None:
        return next((model for model in self.models if model.id == model_id), None)

    def require(self, model_id: str) -> BaseModel:
        """A model the caller knows is in the catalog (a fine-tune's base, checked when it was made)."""
        model = self.get(model_id)
        if model is None:
            raise KeyError(f"model {model_id!r} is not in the catalog")
        return model

    @property
    def ids(self) -> list[str]:
        return [model.id for model in self.models]

    def check_weights(self) -> None:
        """Stop start-up when a model has nothing to load."""
        for model in self.models:
            if not (model.weights / "config.json").is_file():
                hint = " (run the set-up to prepare it)" if model.prepare_from else ""
                raise ConfigError(f"model {model.id!r}: no weights at {model.weights}{hint}")


class _Table:
    """A TOML table that names its place in the file in every error."""

    def __init__(self, data: dict[str, Any], where: str):
        self.data, self.where = data, where

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise ConfigError(f"{self.where}: '{key}' is missing")
            return default
        value = self.data[key]
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{self.where}.{key} must be a {kind.__name__}, not {value!r}")
        return value

    def one_of(self, key: str, choices: tuple[str, ...]) -> str:
        """One of ``choices``; the first when absent."""
        value = self.get(key, str, choices[0])
        if value not in choices:
            raise ConfigError(f"{self.where}.{key} must be one of {', '.join(map(repr, choices))}, not {value!r}")
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        return self.at_least(key, 1, default)

    def at_least(self, key: str, least: int, default: Any = ..., most: int | None = None) -> int:
        value = self.get(key, int, default)
        if value < least or (most is not None and value > most):
            bounds = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise ConfigError(f"{self.where}.{key} must be {bounds}, not {value}")
        return value

    def amount(self, key: str, default: float) -> float:
        """A number above 0 (an integer or not)."""
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ConfigError(f"{self.where}.{key} must be a number above 0, not {value!r}")
        return float(value)

    def fraction(self, key: str, default: float) -> float:
        """A number in (0, 1]; an integer is taken too (1 = all)."""
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise ConfigError(f"{self.where}.{key} must be a number above 0 and at most 1, not {value!r}")
        return float(value)

    def table(self, key: str) -> _Table:
        return _Table(self.get(key, dict, {}), f"{self.where}.{key}")


def _parse_tools(table: _Table, catalog_folder: Path) -> ToolCalling | None:
    if not table.data:
        return None
    template = table.get("chat_template", str, "")
    return ToolCalling(table.get("parser", str), catalog_folder / template if template else None)


def _parse_model(table: _Table, data_dir: Path, default_lora_path: str, catalog_folder: Path) -> BaseModel:
    model_id = table.get("id", str)
    if ":" in model_id or not model_id.strip():
        raise ConfigError(f"{table.where}.id {model_id!r} must be non-empty and free of ':'")
    weights = Path(table.get("weights", str)).expanduser()
    prepare = table.table("prepare_from")
    lora = table.table("lora_config")
    engine = table.table("engine")
    scaling = table.table("autoscaling")
    replicas = table.get("replicas", int, 1)
    backend = table.one_of("backend", BACKENDS)
    return BaseModel(
        id=model_id,
        backend=backend,
        weights=weights if weights.is_absolute() else data_dir / weights,
        prepare_from=GgufSource(prepare.get("package", str), prepare.get("file", str)) if prepare.data else None,
        replicas=replicas,
        lora=LoraConfig(
            dynamic_lora_loading_path=lora.get("dynamic_lora_loading_path", str, "") or default_lora_path,
            max_num_adapters_per_replica=lora.positive("max_num_adapters_per_replica", 8),
            max_lora_rank=lora.positive("max_lora_rank", 16),
            max_mixes_per_organization=lora.positive("max_mixes_per_organization", 8),
            organization_share=lora.fraction("organization_share", 0.5),
        ),
        engine=EngineConfig(
            max_model_len=engine.positive("max_model_len", 2048),
            dtype=engine.get("dtype", str, "bfloat16"),
            max_loras=engine.positive("max_loras", 4),
            kv_cache_space_gib=engine.amount("kv_cache_space_gib", 2),
            extra_args=tuple(engine.get("extra_args", list, [])),
        ),
        autoscaling=Autoscaling(
            min_replicas=scaling.at_least("min_replicas", 0, replicas, most=replicas),
            target_ongoing_requests=scaling.positive("target_ongoing_requests", 16),
            downscale_delay_s=scaling.positive("downscale_delay_s", 600),
            cold_start_wait_s=scaling.at_least("cold_start_wait_s", 0, 60),
            idle=scaling.one_of("idle", IDLE_CHOICES),
        ),
        tools=_parse_tools(table.table("tools"), catalog_folder),
    )


def catalog_entry(model: BaseModel, data_dir: Path, default_lora_path: str) -> dict[str, Any]:
    """``model`` as ``_parse_model`` reads it (the same keys), for writing into the catalog file: weights
    under ``data_dir`` relative to it, and the default adapters path as "" (it follows DYNAMIC_LORA_PATH)."""
    weights = model.weights.relative_to(data_dir) if model.weights.is_relative_to(data_dir) else model.weights
    lora, engine, scaling = model.lora, model.engine, model.autoscaling
    lora_path = lora.dynamic_lora_loading_path
    entry: dict[str, Any] = {"id": model.id, "weights": str(weights), "backend": model.backend}
    entry["replicas"] = model.replicas
    if model.prepare_from is not None:
        entry["prepare_from"] = {"package": model.prepare_from.package, "file": model.prepare_from.file}
    entry["lora_config"] = {
        "dynamic_lora_loading_path": "" if lora_path == default_lora_path else lora_path,
        "max_num_adapters_per_replica": lora.max_num_adapters_per_replica,
        "max_lora_rank": lora.max_lora_rank,
        "max_mixes_per_organization": lora.max_mixes_per_organization,
        "organization_share": lora.organization_share,
    }
    entry["engine"] = {
        "max_model_len": engine.max_model_len,
        "dtype": engine.dtype,
        "max_loras": engine.max_loras,
        "kv_cache_space_gib": _whole_if_whole(engine.kv_cache_space_gib),
        "extra_args": list(engine.extra_args),
    }
    entry["autoscaling"] = {
        "min_replicas": scaling.min_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "downscale_delay_s": _whole_if_whole(scaling.downscale_delay_s),
        "cold_start_wait_s": _whole_if_whole(scaling.cold_start_wait_s),
        "idle": scaling.idle,
    }
    if model.tools is not None:
        entry["tools"] = {"parser": model.tools.parser}
        if model.tools.chat_template is not None:
            entry["tools"]["chat_template"] = str(model.tools.chat_template)
    return entry


def _whole_if_whole(value: float) -> int | float:
    # Some keys are read as integers (downscale_delay_s, cold_start_wait_s) though kept as floats.
    return int(value) if float(value).is_integer() else value


def load_catalog(path: Path, data_dir: Path, default_lora_path: str) -> Catalog:
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model catalog {path} does not exist (set MODEL_CATALOG)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"model catalog {path}: {exc}") from None
    entries = _Table(document, path.name).get("models", list)
    models = tuple(
        _parse_model(_Table(entry, f"{path.name}: models[{index}]"), data_dir, default_lora_path, path.parent)
        for index, entry in enumerate(entries)
    )
    if not models:
        raise ConfigError(f"model catalog {path} lists no models")
    if len({model.id for model in models}) != len(models):
        raise ConfigError(f"model catalog {path} lists a model id twice")
    return Catalog(models)
