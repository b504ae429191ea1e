"""The server's routes as a vLLM or OpenAI client meets them, in process: HEAD beside every GET, a model's
card by id, unknown routes and wrong methods in OpenAI's error shape, and --root-path served with and
without its prefix."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def engine(checkpoint_dirs):
    from mmserve import LLM

    return LLM(str(checkpoint_dirs["qwen2_vl"])).engine


def _app(engine, **config):
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.media import MediaRules
    from mmserve.entrypoints.openai.server import build_app
    from mmserve.entrypoints.openai.serving import ServerConfig

    return build_app(AsyncEngine(engine), ServerConfig("m", MediaRules(engine.config.media), **config))


def _concrete(path: str) -> str:
    return path.replace("{model_id}", "m").replace("{name}", "app.js")


def test_head_answers_every_get_route_like_get_without_a_body(engine):
    from fastapi.testclient import TestClient

    from mmserve.entrypoints.openai.web_ui import web_ui_router

    app = _app(engine, demo_model=True)
    gets = [path for path, methods in app.openapi()["paths"].items() if "get" in methods]
    gets += [r.path for r in web_ui_router(True, False).routes if isinstance(r, APIRoute) and "GET" in r.methods]
    assert {"/health", "/metrics", "/v1/models", "/v1/models/{model_id}", "/version", "/"} <= set(gets)
    with TestClient(app) as client:
        for path in gets:
            got, head = client.get(_concrete(path)), client.head(_concrete(path))
            assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
            assert head.content == b"", path
            assert head.headers.get("content-type") == got.headers.get("content-type"), path
            if path not in ("/metrics", "/demo/sample"):  # their bodies change between two calls
                assert head.headers.get("content-length") == str(len(got.content)), path


def test_model_card_by_id_and_404_naming_an_unknown_id(engine):
    from fastapi.testclient import TestClient

    with TestClient(_app(engine)) as client:
        card = client.get("/v1/models/m").json()
        assert card["id"] == "m" and card["object"] == "model" and card["owned_by"] and card["created"] > 0
        assert card == {**client.get("/v1/models").json()["data"][0], "created": card["created"]}
        missing = client.get("/v1/models/org/no-such-model")
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert "org/no-such-model" in error["message"] and error["code"] == "model_not_found"
        assert error["param"] == "model"


def test_unknown_route_and_wrong_method_answer_openai_errors_naming_them(engine):
    from fastapi.testclient import TestClient

    with TestClient(_app(engine)) as client:
        missing = client.post("/v1/no/such/route", json={})
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert "/v1/no/such/route" in error["message"] and error["type"] == "not_found_error"
        assert error["code"] == "route_not_found"
        wrong = client.delete("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        error = wrong.json()["error"]
        assert "DELETE" in error["message"] and "/v1/chat/completions" in error["message"]
        assert error["code"] == "method_not_allowed"


def test_root_path_serves_the_app_under_the_prefix_and_without_it(engine):
    from fastapi.testclient import TestClient

    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(_app(engine, root_path="/llm")) as client:
        for prefix in ("/llm", ""):  # a proxy that passes the path on, and one that strips the prefix
            assert client.get(f"{prefix}/v1/models").json()["data"][0]["id"] == "m"
            assert client.get(f"{prefix}/v1/models/m").status_code == 200
            assert client.get(f"{prefix}/health").status_code == 200
            assert client.post(f"{prefix}/v1/chat/completions", json=body).status_code == 200
        page = client.get("/llm/").text  # the chat page: its files and calls relative, so under the prefix too
        assert 'src="web-ui/app.js"' in page and client.get("/llm/web-ui/app.js").status_code == 200
        assert client.get("/llm", follow_redirects=False).headers["location"].endswith("/llm/")
        assert client.get("/llm/v1/nothing").status_code == 404
        assert client.get("/other/v1/models").status_code == 404


def test_cors_as_vllm_allows_any_origin_by_default_and_only_the_allowed_ones_when_told(engine):
    """vLLM's CORS flags: by default a browser on any origin may call the API (preflight and the call);
    with --allowed-origins only those origins get the header, with --allow-credentials credentials too."""
    from fastapi.testclient import TestClient

    from mmserve.entrypoints.openai.serving import CorsPolicy

    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(_app(engine)) as client:
        answer = client.options("/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        assert client.get("/v1/models", headers={"Origin": "http://page.example"}).headers[
            "access-control-allow-origin"] == "*"
    policy = CorsPolicy(allowed_origins=("http://ok.example",), allow_credentials=True)
    with TestClient(_app(engine, cors=policy)) as client:
        refused = client.options("/v1/chat/completions", headers=preflight)
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        allowed = client.get("/v1/models", headers={"Origin": "http://ok.example"})
        assert allowed.headers["access-control-allow-origin"] == "http://ok.example"
        assert allowed.headers["access-control-allow-credentials"] == "true"
