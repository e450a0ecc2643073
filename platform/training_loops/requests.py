"""The Tinker SDK's JSON requests, as this server reads them (the SDK's own field names and types).
Fields the server does not act on are ignored when they change nothing a caller relies on, and
refused by name otherwise (another optimizer, custom losses)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_Id = Field(max_length=100)
_Seq = Field(default=None, ge=0, lt=2**63)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(_Request):
    tags: list[str] = Field(default_factory=list, max_length=32)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = Field(default="", max_length=40)
    display_name: str | None = Field(default=None, max_length=200)


class SessionHeartbeat(_Request):
    session_id: str = _Id


class LoraConfig(_Request):
    rank: int = Field(ge=1, le=1024)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    train_unembed: bool = True  # accepted, not trained: the serving engine takes no LoRA on the unembedding
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Request):
    type: Literal["adamw"] = "adamw"


class CreateModel(_Request):
    session_id: str = _Id
    model_seq_id: int = Field(default=0, ge=0, lt=2**31)
    base_model: str = Field(max_length=200)
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelRef(_Request):
    model_id: str = _Id


class AdamParams(_Request):
    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=1e-4, ge=0, le=1)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=1)
    grad_clip_norm: float = Field(default=0.0, ge=0, le=1e6)

    @field_validator("*")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class OptimStep(_Request):
    model_id: str = _Id
    adam_params: AdamParams
    seq_id: int | None = _Seq


class SaveWeights(_Request):
    model_id: str = _Id
    path: str | None = Field(default=None, max_length=200)
    seq_id: int | None = _Seq


class SaveWeightsForSampler(SaveWeights):
    sampling_session_seq_id: int | None = _Seq


class LoadWeights(_Request):
    model_id: str | None = Field(default=None, max_length=100)
    session_id: str | None = Field(default=None, max_length=100)
    model_seq_id: int = Field(default=0, ge=0, lt=2**31)
    path: str = Field(max_length=400)
    optimizer: bool = False
    seq_id: int | None = _Seq
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSession(_Request):
    session_id: str = _Id
    base_model: str | None = Field(default=None, max_length=200)
    model_path: str | None = Field(default=None, max_length=400)


class RetrieveFuture(_Request):
    request_id: str = _Id


class Publish(_Request):
    model_config = ConfigDict(extra="forbid")

    suffix: str | None = Field(default=None, max_length=64)
