"""The evals API's objects, in OpenAI's shape (``openai.types``: ``Eval*Response``, ``evals.Run*``,
``evals.runs.OutputItem*``), plus the platform's fields: an eval's ``file``, a run's ``progress``,
``score`` and ``adapters``, an item's ``status`` of ``error``."""

from __future__ import annotations

from django.urls import reverse

from base.records import unix
from core.eval_prompts import DEFAULT_INPUT
from evals import sources
from evals.models import Eval, EvalRun, OutputItem

# What ``{{sample.*}}`` names: the model's answer (an eval's schema shows it with include_sample_schema).
SAMPLE_SCHEMA = {
    "type": "object",
    "properties": {
        "model": {"type": "string"}, "choices": {"type": "array"}, "output_text": {"type": "string"},
        "output_json": {"type": "object"}, "output_tools": {"type": "array"},
    },
    "required": ["model", "choices", "output_text"],
}


def data_source_schema(evaluation: Eval) -> dict:
    """OpenAI's ``data_source_config.schema``: the item schema under ``item``, and ``sample``'s if asked."""
    properties = {"item": sources.item_schema(evaluation)} | ({"sample": SAMPLE_SCHEMA} if evaluation.include_sample_schema else {})
    return {"type": "object", "properties": properties, "required": list(properties)}


def eval_object(evaluation: Eval) -> dict:
    return {
        "object": "eval",
        "id": evaluation.id,
        "name": evaluation.name,
        "created_at": unix(evaluation.created_at),
        "data_source_config": {"type": "custom", "schema": data_source_schema(evaluation)},
        "testing_criteria": evaluation.testing_criteria,
        "metadata": evaluation.metadata,
        "file": evaluation.file_id or None,
        "item_count": evaluation.item_count,
    }


def report_url(run: EvalRun, site: str) -> str:
    """The dashboard's page of the run's eval (its runs and answers side by side), on ``site``
    (``https://host``, as the caller reached it)."""
    return site + reverse("dashboard:eval", args=[run.eval_id])


def run_object(run: EvalRun, site: str) -> dict:
    sampling = {key: value for key, value in run.sampling.items() if value is not None}
    usage = run.usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "object": "eval.run",
        "id": run.id,
        "eval_id": run.eval_id,
        "name": run.name,
        "model": run.model,
        "adapters": run.adapters,
        "status": run.status,
        "created_at": unix(run.created_at),
        "data_source": _data_source(run, sampling),
        "error": {"code": run.error_code, "message": run.error_message} if run.error_code else None,
        "metadata": run.metadata,
        "report_url": report_url(run, site),
        "result_counts": {
            "total": run.total_items, "passed": run.passed_items, "failed": run.failed_items, "errored": run.errored_items,
        },
        "per_testing_criteria_results": [
            {"testing_criteria": name, "passed": counts["passed"], "failed": counts["failed"]}
            for name, counts in run.per_criteria.items()
        ],
        "per_model_usage": [
            {
                "model_name": run.model, "invocation_count": usage.get("invocation_count", 0), "prompt_tokens": prompt,
                "completion_tokens": completion, "total_tokens": prompt + completion,
                "cached_tokens": usage.get("cached_tokens", 0),
            }
        ] if usage else [],
        "progress": {"done": run.done_items, "total": run.total_items},
        "score": run.score,
        "started_at": unix(run.started_at),
        "finished_at": unix(run.finished_at),
    }


def _data_source(run: EvalRun, sampling: dict) -> dict:
    """The run's data source as it was asked for (a file_content source by its item count, not its items)."""
    kept = run.data_source or {"type": "completions", "source": {"type": "file_id", "id": run.file_id}}
    source = kept["source"]
    if source["type"] == "file_content":
        source = {"type": "file_content", "item_count": len(source["content"])}
    if kept["type"] == "jsonl":
        return {"type": "jsonl", "source": source}
    return {
        "type": kept["type"], "model": run.model, "source": source,
        "input_messages": kept.get("input_messages") or DEFAULT_INPUT, "sampling_params": sampling,
        **({"adapters": run.adapters} if run.adapters else {}),
    }


def output_item_object(item: OutputItem, run: EvalRun) -> dict:
    sampling = run.sampling
    prompt, completion = item.usage.get("prompt_tokens", 0), item.usage.get("completion_tokens", 0)
    return {
        "object": "eval.run.output_item",
        "id": item.id,
        "run_id": run.id,
        "eval_id": run.eval_id,
        "created_at": unix(item.created_at),
        "status": item.status,
        "datasource_item_id": item.index,
        "datasource_item": item.item or {"input": item.prompt, "expected": item.expected},
        "results": [{"score": 1.0 if result["passed"] else 0.0, **result} for result in item.results],
        "sample": {
            "input": item.prompt,
            "output": [] if item.answer is None else [{"role": "assistant", "content": item.answer}],
            "model": item.answered_by or run.model,
            "finish_reason": item.finish_reason,
            "error": {"code": item.error_code, "message": item.error_message} if item.error_code else None,
            "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "cached_tokens": item.usage.get("cached_tokens", 0),
            },
            "max_completion_tokens": sampling.get("max_completion_tokens"),
            "temperature": sampling.get("temperature"),
            "top_p": sampling.get("top_p"),
            "seed": sampling.get("seed"),
        },
    }
