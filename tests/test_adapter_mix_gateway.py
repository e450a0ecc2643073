"""The gateway's checks of a mix (``adapters``): its shape, the count cap, and that every model it
names is a fine-tune of ``model``'s base that the caller may use. The pool is test_request_limits'
stand-in that records what it receives; a refused request reaches it not at all."""


# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
from __future__ import annotations

import dataclasses
import json

import pytest

from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER
from tests.helpers import anyio_backend  # noqa: F401
from tests.inference_fixtures import BASE, register_fine_tuned_model
from tests.personas import alice, bob, charlie  # noqa: F401 (fixtures)
from tests.recording_pool import _bearer, _chat, _error, _limits, pool, web  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]

OTHER_BASE = "Example/Other-Base"


@pytest.fixture
def fine_tunes(alice, charlie):
    return {
        "a": register_fine_tuned_model(alice, "mix-a"),
        "b": register_fine_tuned_model(alice, "mix-b"),
        "charlies": register_fine_tuned_model(charlie, "mix-c"),
    }


async def test_it_forwards_a_mix_of_the_callers_fine_tunes_of_the_base_model(web, pool, bob, fine_tunes):
    mix = [{"model": fine_tunes["a"], "scale": 0.5}, {"model": fine_tunes["b"], "scale": -0.5}]
    response = await web.post("/v1/chat/completions", json=_chat(adapters=mix), headers=_bearer(bob))
    assert response.status_code == 200, response.text
    assert json.loads(pool.bodies[0])["adapters"] == mix  # the pool builds it


@pytest.mark.parametrize(
    ("adapters", "where"),
    [
        ("x", "adapters"),
        ([{"model": "m"}, 3], "adapters.1"),
        ([{"scale": 0.5}], "adapters.0.model"),
        ([{"model": "m", "scale": "0.5"}], "adapters.0.scale"),
        ([{"model": "m", "scale": True}], "adapters.0.scale"),
        ([{"model": "m", "scale": 2.5}], "adapters.0.scale"),
        ([{"model": "m", "scale": -3}], "adapters.0.scale"),
        ([{"model": "m", "weight": 1}], "adapters.0.weight"),
    ],
)
async def test_it_answers_400_naming_what_is_wrong_with_the_shape(web, pool, alice, adapters, where):
    response = await web.post("/v1/chat/completions", json=_chat(adapters=adapters), headers=_bearer(alice))
    assert response.status_code == 400 and f"{where}:" in _error(response)["message"]
    assert pool.bodies == []


async def test_it_refuses_nan_and_infinite_scales(web, pool, alice):
    for scale in (b"NaN", b"Infinity"):
        body = b'{"model": "%s", "messages": [], "adapters": [{"model": "m", "scale": %s}]}' % (BASE.encode(), scale)
        response = await web.post("/v1/chat/completions", content=body, headers=_bearer(alice))
        assert response.status_code == 400
    assert pool.bodies == []


async def test_it_caps_the_number_of_adapters(web, pool, alice, settings, fine_tunes):
    _limits(settings, mix_adapters=2)
    mix = [{"model": fine_tunes["a"], "scale": 0.1}] * 3
    response = await web.post("/v1/completions", json={"model": BASE, "prompt": "hi", "adapters": mix}, headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["code"] == "limit_exceeded" and "MAX_MIX_ADAPTERS" in error["message"]


async def test_it_answers_404_for_an_unknown_model_or_another_organizations_naming_it(web, pool, alice, fine_tunes):
    for name in (fine_tunes["charlies"], f"{BASE}:nobody", "no-such-base:x"):
        mix = [{"model": fine_tunes["a"], "scale": 0.5}, {"model": name, "scale": 0}]  # scale 0 is checked too
        response = await web.post("/v1/chat/completions", json=_chat(adapters=mix), headers=_bearer(alice))
        error = _error(response)
        assert response.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "adapters"
        assert name in error["message"]
    assert pool.bodies == []


async def test_it_answers_400_when_model_is_not_the_base_or_a_part_is_of_another_base(web, pool, alice, settings, fine_tunes):
    on_fine_tune = await web.post(
        "/v1/chat/completions", json=_chat(model=fine_tunes["a"], adapters=[{"model": fine_tunes["b"]}]), headers=_bearer(alice)
    )
    assert on_fine_tune.status_code == 400 and _error(on_fine_tune)["code"] == "mix_needs_base_model"
    base_itself = await web.post("/v1/chat/completions", json=_chat(adapters=[{"model": BASE}]), headers=_bearer(alice))
    assert base_itself.status_code == 400 and _error(base_itself)["code"] == "adapter_of_another_base_model"
    catalog = settings.MODEL_CATALOG
    other = dataclasses.replace(catalog.models[0], id=OTHER_BASE)
    settings.MODEL_CATALOG = dataclasses.replace(catalog, models=(*catalog.models, other))
    mix = [{"model": fine_tunes["a"], "scale": 0.5}]
    response = await web.post("/v1/chat/completions", json=_chat(model=OTHER_BASE, adapters=mix), headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["code"] == "adapter_of_another_base_model"
    assert fine_tunes["a"] in error["message"] and OTHER_BASE in error["message"]
    assert pool.bodies == []


async def test_the_playground_checks_a_mix_as_the_api_does(pool, alice, charlie, fine_tunes):
    from gateway.completions import complete_for_organization

    from core.api_errors import ApiError

    body = json.dumps(_chat(adapters=[{"model": fine_tunes["a"], "scale": 0.5}])).encode()
    assert (await complete_for_organization(alice.organization, body, "chat/completions")).status == 200
    with pytest.raises(ApiError) as refused:
        await complete_for_organization(charlie.organization, body, "chat/completions")
    assert refused.value.status == 404 and refused.value.param == "adapters"


async def test_it_tells_the_pool_which_organization_a_request_is_for_whatever_the_caller_sends(
    web, pool, alice, charlie, fine_tunes
):
    forged = {**_bearer(charlie), ORGANIZATION_HEADER: str(alice.organization.pk), BACKGROUND_HEADER: "1"}  # alice's share
    assert (await web.post("/v1/chat/completions", json=_chat(), headers=forged)).status_code == 200
    mix = _chat(adapters=[{"model": fine_tunes["a"]}])
    assert (await web.post("/v1/chat/completions", json=mix, headers=_bearer(alice))).status_code == 200
    named = [headers[ORGANIZATION_HEADER] for headers in pool.headers]
    assert named == [str(charlie.organization.pk), str(alice.organization.pk)]
    assert not any(BACKGROUND_HEADER in headers for headers in pool.headers)  # live requests never yield to a batch
