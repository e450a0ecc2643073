import pytest

pytestmark = pytest.mark.django_db


def test_the_openapi_schema_describes_the_fine_tuning_api(client):
    response = client.get("/api/schema", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in ("/v1/files", "/v1/files/{id}/content", "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{id}/cancel",
                 "/v1/fine_tuning/jobs/{id}/events", "/v1/fine_tuning/jobs/{id}/checkpoints"):
        assert path in paths, sorted(paths)
    assert "hyperparameters" in str(response.json()["components"]["schemas"])


def test_the_api_docs_page_renders_without_any_cdn(client):
    page = client.get("/api/docs").content.decode()
    assert "redoc" in page.lower() and "cdn.jsdelivr" not in page and "/static/drf_spectacular_sidecar/" in page


def test_the_schema_describes_the_inference_endpoints_with_the_fields_the_gateway_accepts(client):
    from core.openai_protocol import REQUEST_FIELDS

    schema = client.get("/api/schema", HTTP_ACCEPT="application/json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == REQUEST_FIELDS["chat/completions"] | {"model"} and body["additionalProperties"] is False
    assert {"400", "401", "404", "429", "503"} <= set(chat["responses"])
    share = body["properties"]["adapters"]["items"]
    assert share["required"] == ["model"] and share["properties"]["scale"]["maximum"] == 2.0
    assert "delete" in schema["paths"]["/v1/models/{model}"] and "get" in schema["paths"]["/v1/models"]
