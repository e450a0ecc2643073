"""Dashboard forms. They only collect input; the services decide (and explain) what is valid."""

from __future__ import annotations

from typing import Any, cast

from django import forms
from django.conf import settings
from django.forms.boundfield import BoundWidget

from base.upload_limits import adapter_too_large_message, file_too_large_message
from core.api_errors import ApiError
from core import strict_json
from core.datasets import PREFERENCE, PROMPTS
from core.lora_merge import METHODS
from core.openai_protocol import MAX_ADAPTER_SCALE
from finetuning.compose import CompositionRequest
from finetuning.job_creation import (
    DPO_BETA_AUTO,
    MAX_BETA,
    MAX_CHECKPOINTS_PER_EPOCH,
    MAX_EVALS_PER_EPOCH,
    MIN_BETA,
    TARGET_MODULES,
    JobRequest,
)
from finetuning.models import DPO, REINFORCEMENT, SUPERVISED, File
from webhooks.event_types import EventType


SUFFIX_HELP = "Letters, digits, - and _. Empty: one is made up."


def show_api_error(form: forms.Form, error: ApiError) -> None:
    """Put a service's error next to the field it names (``hyperparameters.lora_r`` -> ``lora_r``)."""
    field = (error.param or "").rpartition(".")[2]
    form.add_error(field if field in form.fields else None, error.message)


def choice_field(form: forms.Form, name: str) -> forms.ChoiceField:
    """A form's choice field by name, typed as one, to set its choices (form.fields holds Fields)."""
    return cast(forms.ChoiceField, form.fields[name])


class UploadForm(forms.Form):
    file = forms.FileField(help_text="JSONL: one {\"messages\": [...]} or {\"prompt\", \"completion\"} object per line.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The page checks a chosen file's size before sending it (app.js): a file over the cap
        # would otherwise travel in full only to be refused.
        self.fields["file"].widget.attrs |= {
            "data-max-bytes": settings.CONFIG.max_upload_bytes, "data-too-large": file_too_large_message(),
        }


class AdapterUploadForm(forms.Form):
    """An adapter trained elsewhere, to serve as ``<model>:<suffix>``. Prefixed (``adapter-``), so
    its fields keep ids of their own should it share a page with another form."""

    prefix = "adapter"
    file = forms.FileField(
        label="Adapter archive",
        help_text="A PEFT LoRA folder packed as .tar.gz or .zip: adapter_config.json and adapter_model.safetensors.",
    )
    model = forms.ChoiceField(label="Base model")
    suffix = forms.CharField(required=False, max_length=64, help_text=SUFFIX_HELP)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "model").choices = [(m, m) for m in settings.MODEL_CATALOG.ids]
        self.fields["file"].widget.attrs |= {
            "accept": ".tar.gz,.tgz,.zip", "data-max-bytes": settings.CONFIG.max_adapter_upload_bytes,
            "data-too-large": adapter_too_large_message(),
        }


class ParentsField(forms.MultipleChoiceField):
    """The models ticked as parents. Any name is accepted: the service says which models the
    organization has (a model deleted since the page was shown, or another organization's, is
    refused by name), as the API does."""

    def valid_value(self, value: object) -> bool:
        return True


class ComposeForm(forms.Form):
    """A new model from a weighted combination of the organization's fine-tuned models: a row per
    model (tick it, give it a scale), no script needed. Prefixed (``compose-``), like the upload form."""

    prefix = "compose"
    parents = ParentsField(required=False, widget=forms.CheckboxSelectMultiple)
    suffix = forms.CharField(required=False, max_length=64, help_text=SUFFIX_HELP)
    method = forms.ChoiceField(
        choices=[(method, method) for method in METHODS], initial="linear",
        help_text="linear: exact, its rank is the sum of the parents' ranks. svd, ties, dare_linear: approximated "
        "at the rank below, with the error reported.",
    )
    rank = forms.IntegerField(
        required=False, min_value=1, help_text="svd, ties, dare_linear: the result's rank. Empty: as much as is served."
    )
    density = forms.FloatField(
        required=False, min_value=0.01, max_value=1.0,
        help_text="ties, dare_linear: the share of each delta kept. Empty: 0.5.",
    )
    seed = forms.IntegerField(
        required=False, min_value=0, max_value=2**31 - 1, help_text="dare_linear: its random drop. Empty: 0."
    )

    def __init__(self, *args: Any, models: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "parents").choices = [(name, name) for name in models]
        most = settings.CONFIG.request_limits.mix_adapters.value
        self.fields["parents"].help_text = f"Tick 1 to {most} fine-tuned models of one base model, each with its scale."
        # A scale per model, named by the model: a model added or deleted between showing the page
        # and sending it does not shift anyone's scale onto another model.
        for name in models:
            self.fields[self.scale_field(name)] = forms.FloatField(
                required=False, min_value=-MAX_ADAPTER_SCALE, max_value=MAX_ADAPTER_SCALE, initial=1.0,
                label=f"Scale of {name}",
            )

    @staticmethod
    def scale_field(model: str) -> str:
        return f"scale_{model}"

    def rows(self) -> list[tuple[BoundWidget, str, forms.BoundField]]:
        """(the tick box, the model's name, its scale) for each of the organization's models."""
        return [(box, box.data["value"], self[self.scale_field(box.data["value"])]) for box in self["parents"]]

    def to_composition(self) -> CompositionRequest:
        data = self.cleaned_data
        scales: dict[str, float] = {}
        for name in data["parents"]:
            scale = data.get(self.scale_field(name))  # a model not listed here: the service refuses it by name
            scales[name] = 1.0 if scale is None else scale
        options = {name: data[name] for name in ("density", "seed") if data[name] is not None}
        return CompositionRequest(
            parents=scales, suffix=data["suffix"] or None, method=data["method"], rank=data["rank"], **options
        )


MAX_GRADER_CHARS = 64_000  # a multi grader's sub-graders' templates, and room to spare


class JobForm(forms.Form):
    model = forms.ChoiceField(label="Base model")
    method = forms.ChoiceField(
        required=False, initial=SUPERVISED, label="Method",
        choices=[(SUPERVISED, "Supervised: learn the answers of chat examples"),
                 (DPO, "DPO: prefer the preferred answer of preference pairs"),
                 (REINFORCEMENT, "Reinforcement: answer prompts as a grader rewards")],
        help_text="A dataset holds one kind of line: chat examples, preference pairs, or prompts",
    )
    training_file = forms.ChoiceField(label="Training dataset")
    validation_file = forms.ChoiceField(label="Validation dataset", required=False)
    suffix = forms.CharField(required=False, max_length=64, help_text=SUFFIX_HELP)
    n_epochs = forms.IntegerField(required=False, min_value=1, max_value=50, label="Epochs", help_text="Empty: auto")
    batch_size = forms.IntegerField(required=False, min_value=1, max_value=256, help_text="Empty: auto")
    learning_rate_multiplier = forms.FloatField(required=False, min_value=0.001, max_value=100, help_text="Empty: auto (1.0)")
    lora_r = forms.IntegerField(initial=8, min_value=1, max_value=256, label="LoRA rank")
    lora_alpha = forms.IntegerField(initial=16, min_value=1, max_value=4096, label="LoRA alpha")
    lora_dropout = forms.FloatField(initial=0.05, min_value=0, max_value=0.9, label="LoRA dropout")
    target_modules = forms.MultipleChoiceField(
        choices=[(m, m) for m in TARGET_MODULES], initial=list(TARGET_MODULES), widget=forms.CheckboxSelectMultiple
    )
    n_evals = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_EVALS_PER_EPOCH, label="Validation evaluations per epoch",
        help_text="Empty: one, at the epoch's end (with a validation dataset)",
    )
    n_checkpoints = forms.IntegerField(
        required=False, min_value=1, max_value=MAX_CHECKPOINTS_PER_EPOCH, label="Checkpoints per epoch", help_text="Empty: one"
    )
    early_stopping_patience = forms.IntegerField(
        required=False, min_value=1, max_value=1000, label="Early stopping: patience",
        help_text="Evaluations in a row without improvement that stop training; the best checkpoint is published. "
        "Empty: off. Needs a validation dataset",
    )
    early_stopping_min_delta = forms.FloatField(
        required=False, min_value=0, max_value=100, label="Early stopping: minimum improvement",
        help_text="Of the validation loss. Empty: any",
    )
    beta = forms.FloatField(
        required=False, min_value=MIN_BETA, max_value=MAX_BETA, label="DPO beta",
        help_text=f"How far from the base model DPO may move: smaller lets it go further. Empty: auto ({DPO_BETA_AUTO})",
    )

    grader = forms.CharField(
        required=False, max_length=MAX_GRADER_CHARS, widget=forms.Textarea(attrs={"rows": 5}), label="Reinforcement: grader",
        help_text='One of OpenAI\'s graders, as JSON: its score is the reward. E.g. {"type": "text_similarity", "name": "close", '
        '"evaluation_metric": "fuzzy_match", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}',
    )

    def __init__(self, *args: Any, files: list[File], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "model").choices = [(m, m) for m in settings.MODEL_CATALOG.ids]
        choices = [(f.id, f"{f.filename} ({f.example_count} {_lines_of(f)}, {f.token_count} tokens)") for f in files]
        choice_field(self, "training_file").choices = choices
        choice_field(self, "validation_file").choices = [("", "None")] + choices
        # The page estimates training tokens from these before launch.
        self.tokens_by_file = {f.id: f.token_count for f in files}

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("beta") is not None and data.get("method") != DPO:
            self.add_error("beta", "beta is DPO's: choose the DPO method, or leave beta empty")
        if data.get("method") == REINFORCEMENT:
            data["grader"] = self._grader(data.get("grader") or "")
        elif data.get("grader"):
            self.add_error("grader", "a grader rewards a reinforcement job: choose the reinforcement method, or leave it empty")
        return data

    def _grader(self, text: str) -> dict | None:
        """The grader's JSON as an object (``finetuning.job_creation`` checks its fields), or a field error."""
        if not text.strip():
            self.add_error("grader", "the reinforcement method needs a grader: its score is each answer's reward")
            return None
        try:
            grader = strict_json.loads(text)
        except strict_json.JsonRefused as refused:
            self.add_error("grader", f"not JSON that can be read: {refused}")
            return None
        if not isinstance(grader, dict):
            self.add_error("grader", "give the grader as a JSON object, with its type")
            return None
        return grader

    def to_job_request(self) -> JobRequest:
        data = self.cleaned_data
        if data["method"] == REINFORCEMENT:
            return self._reinforcement_request()
        optional = ("n_epochs", "batch_size", "learning_rate_multiplier", "n_evals", "n_checkpoints")
        hyperparameters = {name: data[name] for name in optional if data[name] is not None}
        hyperparameters |= {name: data[name] for name in ("lora_r", "lora_alpha", "lora_dropout", "target_modules")}
        if data["beta"] is not None:
            hyperparameters["beta"] = data["beta"]
        if data["early_stopping_patience"] is not None:
            patience, min_delta = data["early_stopping_patience"], data["early_stopping_min_delta"] or 0.0
            # The form has no evaluation graders: it watches the validation loss.
            hyperparameters["early_stopping"] = {"patience": patience, "min_delta": min_delta, "metric": "valid_loss"}
        return JobRequest(
            model=data["model"], training_file=data["training_file"], validation_file=data["validation_file"] or None,
            suffix=data["suffix"] or None, hyperparameters=hyperparameters, method=data["method"] or SUPERVISED,
        )


    def _reinforcement_request(self) -> JobRequest:
        """The form's fields a reinforcement job takes (its LoRA is the training loop's: rank alone)."""
        data = self.cleaned_data
        optional = ("n_epochs", "batch_size", "learning_rate_multiplier")
        hyperparameters = {name: data[name] for name in optional if data[name] is not None} | {"lora_r": data["lora_r"]}
        if data["early_stopping_patience"] is not None:
            hyperparameters["early_stopping"] = {
                "patience": data["early_stopping_patience"], "min_delta": data["early_stopping_min_delta"] or 0.0,
            }
        return JobRequest(
            model=data["model"], training_file=data["training_file"], validation_file=data["validation_file"] or None,
            suffix=data["suffix"] or None, hyperparameters=hyperparameters, method=REINFORCEMENT, grader=data["grader"],
        )


def _lines_of(file: File) -> str:
    return {PREFERENCE: "preference pairs", PROMPTS: "prompts"}.get(file.format, "examples")


class CompareForm(forms.Form):
    """The eval a model is compared on, from the models page: one of the organization's."""

    eval = forms.ChoiceField(label="Eval", error_messages={
        "required": "Choose one of your evals to compare on.",
        "invalid_choice": "Choose one of your evals to compare on: that one is not among them (deleted meanwhile?).",
    })

    def __init__(self, *args: Any, evals: list[tuple[str, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choice_field(self, "eval").choices = evals


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, initial="dashboard")


class WebhookForm(forms.Form):
    """A new webhook endpoint; ``webhooks.targets`` decides which URLs are allowed, and says why not."""

    url = forms.CharField(label="URL", max_length=2048, help_text="Where each event is POSTed, signed (https://).")
    description = forms.CharField(max_length=256, required=False)
    event_types = forms.MultipleChoiceField(
        label="Events", choices=EventType.choices, required=False, widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every event, those added later too.",
    )
