"""Request parsing for the fine-tuning API: strict types, one message per problem, no unknown keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.evaluation import GRADERS
from core.graders.spec import GRADER_TYPES as OPENAI_GRADERS
from core.lora_merge import METHODS as COMPOSITION_METHODS
from core.openai_protocol import MAX_ADAPTER_SCALE, MAX_METADATA_KEYS
from finetuning.compose import CompositionRequest
from finetuning.job_creation import (
    AUTO,
    MAX_BETA,
    MAX_CHECKPOINTS_PER_EPOCH,
    MAX_EVALS_PER_EPOCH,
    METHODS,
    MIN_BETA,
    REASONING_EFFORTS,
    REINFORCEMENT,
    SUPERVISED,
    JobRequest,
)



class StrictIntegerField(serializers.IntegerField):
    """JSON numbers only: "3", 3.5 and true are type errors, not quietly converted."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            self.fail("invalid")
        return super().to_internal_value(data)


@extend_schema_field({"oneOf": [{"type": "string", "enum": [AUTO]}, {"type": "number"}]})
class AutoOr(serializers.Field):
    """OpenAI's hyperparameter shape: the string "auto" or a number in range."""

    def __init__(self, number: serializers.IntegerField | serializers.FloatField, **kwargs: Any) -> None:
        self.number = number
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if data == AUTO:
            return AUTO
        try:
            return self.number.run_validation(data)
        except serializers.ValidationError as exc:
            raise serializers.ValidationError(f'must be "auto" or {_describe(self.number)}') from exc

    def to_representation(self, value: Any) -> Any:
        return value


def _describe(field: serializers.IntegerField | serializers.FloatField) -> str:
    kind = "a whole number" if isinstance(field, serializers.IntegerField) else "a number"
    low, high = field.min_value, field.max_value
    return f"{kind} from {low} to {high}"


if TYPE_CHECKING:  # the serializers the mixin below goes into, for the type checker
    _Serializer = serializers.Serializer
else:
    _Serializer = object


class RejectUnknownKeys(_Serializer):
    """A misspelt parameter is an error, not silently ignored (as OpenAI's API answers)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                message = f"unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(self.fields)}"
                raise serializers.ValidationError({"non_field_errors": [message]})
        return super().to_internal_value(data)


class EarlyStoppingSerializer(RejectUnknownKeys, serializers.Serializer):
    patience = StrictIntegerField(
        min_value=1, max_value=1000, help_text="Evaluations in a row without an improvement that stop training"
    )
    min_delta = StrictFloatField(
        default=0.0, min_value=0.0, max_value=100.0, help_text="An improvement beats the best value by more than this"
    )
    metric = serializers.ChoiceField(
        ("valid_loss", "eval_score"), default="valid_loss",
        help_text="valid_loss: the validation loss at each evaluation; eval_score: each checkpoint's score by the "
        "job's evaluation graders (its answers, as served). The best one's adapter is published.",
    )


class HyperparametersSerializer(RejectUnknownKeys, serializers.Serializer):
    n_epochs = AutoOr(StrictIntegerField(min_value=1, max_value=50), required=False)
    batch_size = AutoOr(StrictIntegerField(min_value=1, max_value=256), required=False)
    learning_rate_multiplier = AutoOr(StrictFloatField(min_value=0.001, max_value=100), required=False)
    lora_r = StrictIntegerField(min_value=1, max_value=256, required=False)
    lora_alpha = StrictIntegerField(min_value=1, max_value=4096, required=False)
    lora_dropout = StrictFloatField(min_value=0.0, max_value=0.9, required=False)
    target_modules = serializers.ListField(child=serializers.CharField(), min_length=1, required=False)
    n_evals = AutoOr(StrictIntegerField(min_value=1, max_value=MAX_EVALS_PER_EPOCH), required=False)
    n_checkpoints = AutoOr(StrictIntegerField(min_value=1, max_value=MAX_CHECKPOINTS_PER_EPOCH), required=False)
    early_stopping = EarlyStoppingSerializer(required=False, allow_null=True)


class DpoHyperparametersSerializer(HyperparametersSerializer):
    """DPO's: the supervised ones (OpenAI's and the platform's), and beta."""

    beta = AutoOr(
        StrictFloatField(min_value=MIN_BETA, max_value=MAX_BETA), required=False,
        help_text="How far the policy may move from the reference: higher keeps it closer (auto: 0.1)",
    )


class ReinforcementHyperparametersSerializer(RejectUnknownKeys, serializers.Serializer):
    """OpenAI's reinforcement hyperparameters, and the platform's adapter rank and early stopping."""

    n_epochs = AutoOr(StrictIntegerField(min_value=1, max_value=50), required=False)
    batch_size = AutoOr(StrictIntegerField(min_value=1, max_value=64), required=False, help_text="Prompts per step")
    learning_rate_multiplier = AutoOr(StrictFloatField(min_value=0.001, max_value=100), required=False)
    eval_interval = AutoOr(StrictIntegerField(min_value=1, max_value=1000), required=False, help_text="Steps between evaluations")
    eval_samples = AutoOr(
        StrictIntegerField(min_value=1, max_value=16), required=False, help_text="Samples per validation prompt at an evaluation"
    )
    compute_multiplier = AutoOr(
        StrictFloatField(min_value=0.25, max_value=8.0), required=False,
        help_text="Samples per training prompt, as a multiple of 4 (auto: 1, four samples a prompt)",
    )
    reasoning_effort = serializers.ChoiceField(REASONING_EFFORTS, required=False)
    max_completion_tokens = StrictIntegerField(min_value=1, max_value=4096, required=False, help_text="An answer's length, at most (default 256)")
    lora_r = StrictIntegerField(min_value=1, max_value=256, required=False)
    early_stopping = EarlyStoppingSerializer(required=False, allow_null=True)


@extend_schema_field({"type": "object", "description": "One of OpenAI's graders: string_check, text_similarity, score_model, label_model, multi"})
class OpenAIGraderField(serializers.Field):
    """A grader object, passed on as it is: ``finetuning.job_creation`` checks it (``core.graders.spec``)."""

    def to_internal_value(self, data: object) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("must be a grader object, with its type")
        return data

    def to_representation(self, value: dict[str, Any]) -> dict[str, Any]:
        return value


class ReinforcementMethodSerializer(RejectUnknownKeys, serializers.Serializer):
    grader = OpenAIGraderField(help_text="Scores each sampled answer: its score is the reward")
    hyperparameters = ReinforcementHyperparametersSerializer(required=False)


class SupervisedMethodSerializer(RejectUnknownKeys, serializers.Serializer):
    hyperparameters = HyperparametersSerializer(required=False)


class DpoMethodSerializer(RejectUnknownKeys, serializers.Serializer):
    hyperparameters = DpoHyperparametersSerializer(required=False)


class MethodSerializer(RejectUnknownKeys, serializers.Serializer):
    """OpenAI's ``method``: {"type": "supervised"|"dpo", "<type>": {"hyperparameters": {...}}}."""

    type = serializers.ChoiceField(METHODS, default=SUPERVISED)
    supervised = SupervisedMethodSerializer(required=False)
    dpo = DpoMethodSerializer(required=False)
    reinforcement = ReinforcementMethodSerializer(required=False)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        for other in set(METHODS) - {data["type"]}:
            if other in data:
                raise serializers.ValidationError(
                    {other: f"holds the {other} method's settings, but type is '{data['type']}': put them in '{data['type']}'"}
                )
        if data["type"] == REINFORCEMENT and "reinforcement" not in data:
            raise serializers.ValidationError({"reinforcement": 'give {"grader": {...}}: the grader scores each sampled answer'})
        return data


class GraderSerializer(RejectUnknownKeys, serializers.Serializer):
    type = serializers.ChoiceField(GRADERS)
    pattern = serializers.CharField(required=False, max_length=1000, help_text="regex: what the answer must match")
    schema = serializers.DictField(required=False, help_text="json_schema: the JSON Schema the answer must satisfy")

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        needed = {"regex": "pattern", "json_schema": "schema"}.get(data["type"])
        if needed is not None and needed not in data:
            raise serializers.ValidationError({needed: f"a {data['type']} grader needs a {needed}"})
        return data  # what the pattern or schema says is checked by finetuning.job_creation (core.evaluation.grader_problem)


@extend_schema_field({"type": "object", "description": "A grader: the platform's (type, pattern, schema) or one of OpenAI's"})
class GraderField(serializers.Field):
    """A gate's grader: the platform's own (``GraderSerializer``), or one of OpenAI's, passed on as it
    is to ``finetuning.job_creation``, which checks it (``core.graders.spec``) naming its place."""

    def to_internal_value(self, data: object) -> dict[str, Any]:
        if isinstance(data, dict) and data.get("type") in OPENAI_GRADERS:
            return data
        serializer = GraderSerializer(data=data)
        serializer.is_valid(raise_exception=True)
        return dict(serializer.validated_data)

    def to_representation(self, value: dict[str, Any]) -> dict[str, Any]:
        return value


class EvaluationSerializer(RejectUnknownKeys, serializers.Serializer):
    file = serializers.CharField(required=False, allow_null=True, help_text="Held-out examples (default: validation_file)")
    graders = serializers.ListField(child=GraderField(), allow_empty=False, max_length=8)
    threshold = StrictFloatField(
        default=0.0, min_value=-1.0, max_value=1.0,
        help_text="The new adapter must score at least the reference's score plus this (0: no worse than it)",
    )


class JobCreateSerializer(RejectUnknownKeys, serializers.Serializer):
    model = serializers.CharField()
    training_file = serializers.CharField()
    validation_file = serializers.CharField(required=False, allow_null=True)
    suffix = serializers.CharField(required=False, allow_null=True, trim_whitespace=False)
    seed = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=2**31 - 1)
    hyperparameters = HyperparametersSerializer(required=False)
    metadata = serializers.DictField(child=serializers.CharField(max_length=512), required=False, allow_null=True)
    # Newer OpenAI clients send hyperparameters inside "method": {"type": "supervised", "supervised": {...}};
    # {"type": "dpo", "dpo": {...}} trains on preference pairs.
    method = MethodSerializer(required=False)
    # A gate on publishing (``workers.evaluation``): scored against the base model or the parent.
    evaluation = EvaluationSerializer(required=False, allow_null=True)

    def validate_metadata(self, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise serializers.ValidationError(f"at most {MAX_METADATA_KEYS} keys")
        return value

    def to_job_request(self) -> JobRequest:
        data = dict(self.validated_data)
        method = data.pop("method", {"type": SUPERVISED})
        settings = method.get(method["type"], {})
        hyperparameters = {**settings.get("hyperparameters", {}), **data.pop("hyperparameters", {})}
        return JobRequest(**data, method=method["type"], hyperparameters=hyperparameters, grader=settings.get("grader"))


class AdapterUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="A .tar.gz or .zip of a PEFT LoRA folder: adapter_config.json and adapter_model.safetensors at its root")
    model = serializers.CharField(help_text="The base model the adapter was trained on (a catalog model id)")
    suffix = serializers.CharField(required=False, allow_null=True, trim_whitespace=False, help_text="Served as <model>:<suffix>")


class ParentSerializer(RejectUnknownKeys, serializers.Serializer):
    model = serializers.CharField(help_text="A fine-tuned model of the organization: <base_model_id>:<suffix>")
    scale = StrictFloatField(min_value=-MAX_ADAPTER_SCALE, max_value=MAX_ADAPTER_SCALE, help_text="Its weight in the sum")


class CompositionSerializer(RejectUnknownKeys, serializers.Serializer):
    parents = ParentSerializer(many=True, allow_empty=False)
    suffix = serializers.CharField(required=False, allow_null=True, trim_whitespace=False, help_text="Served as <base model>:<suffix>")
    method = serializers.ChoiceField(
        COMPOSITION_METHODS, default="linear",
        help_text="linear: exact (rank = the sum of the parents' ranks); svd, ties, dare_linear: approximated at 'rank'",
    )
    rank = StrictIntegerField(required=False, allow_null=True, min_value=1, help_text="The approximation's rank (default: as much as is served)")
    density = StrictFloatField(default=0.5, min_value=0.01, max_value=1.0, help_text="ties, dare_linear: the share of each delta kept")
    seed = StrictIntegerField(default=0, min_value=0, max_value=2**31 - 1, help_text="dare_linear: its random drop")

    def to_composition(self) -> CompositionRequest:
        data = dict(self.validated_data)
        scales: dict[str, float] = {}
        for parent in data.pop("parents"):  # a repeated parent's scales add up: the sum is linear
            scales[parent["model"]] = scales.get(parent["model"], 0.0) + parent["scale"]
        return CompositionRequest(parents=scales, **data)


class RollbackSerializer(RejectUnknownKeys, serializers.Serializer):
    revision = StrictIntegerField(min_value=1, help_text="The revision the model's name answers with from now on (N of @rN)")


class FileUploadSerializer(serializers.Serializer):
    file = serializers.FileField(allow_empty_file=True)  # an empty file gets the dataset's own message
    purpose = serializers.CharField()
