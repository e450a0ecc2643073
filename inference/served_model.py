"""Which catalog model a request names: the first step of both backends (the pool, Ray Serve's ingress)."""

from __future__ import annotations

from core import api_errors
from core.catalog import BaseModel, Catalog
from core.model_names import is_valid_suffix, parse_model_name


def served_model(catalog: Catalog, model: str) -> tuple[BaseModel, bool]:
    """The catalog's base model ``model`` names, and whether it names a fine-tune of it; 404 otherwise."""
    name = parse_model_name(model)
    base = catalog.get(name.base_model_id)
    if base is None or (name.suffix is not None and not is_valid_suffix(name.suffix)):
        raise api_errors.model_not_found(model)
    return base, name.suffix is not None
