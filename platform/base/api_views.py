"""What the REST views of the OpenAI-shaped resources share (evals, batches, webhooks): the list
pages' query parameters for the schema, the schema of a request that reads only its path, a body
parsed strictly into its request model, and one organization's row by id."""

from __future__ import annotations

from typing import Any, TypeVar

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from pydantic import BaseModel, ValidationError

from core import api_errors

PAGE_PARAMETERS = [OpenApiParameter("after", str), OpenApiParameter("limit", int)]  # base.pagination's
path_only = extend_schema(request=None, responses=OpenApiTypes.OBJECT)  # a path's ids, nothing else read

_Body = TypeVar("_Body", bound=BaseModel)
_Row = TypeVar("_Row")


def parsed(model: type[_Body], data: object) -> _Body:
    """``data`` as ``model``, or the 400 naming its first problem."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise api_errors.invalid_fields(exc) from None


def owned(model: type[_Row], organization: object, what: str, pk: str, **also: Any) -> _Row:
    """``organization``'s ``model`` row ``pk`` (and ``also``); another organization's is a 404 as
    an unknown id is, so ids say nothing of who else exists."""
    row = model.objects.for_org(organization).filter(pk=pk, **also).first()  # type: ignore[attr-defined]
    if row is None:
        raise api_errors.not_found(what, pk)
    return row
