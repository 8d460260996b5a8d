"""A live ``mlx-mtp serve`` app on 127.0.0.1 (uvicorn in a thread) for tests."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn

from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig, create_app


class LiveServer:
    """The real ASGI stack on a free port; ``client()`` is the official client."""

    def __init__(self, model, tokenizer, name: str, config: ServeConfig, wrap=None):
        """``wrap``: ASGI middleware put around the app, as ``wrap(app)``."""
        self.app = create_app(model, tokenizer, name, config)
        self.name = name
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        app = wrap(self.app) if wrap is not None else self.app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @property
    def engine(self):
        return self.app.state.service.engine

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "none")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, **kwargs)

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, json.loads(r.read())

    def post(self, path: str, data: bytes, headers=None):
        """``(status, body)`` of a raw POST, error statuses included."""
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """``/health`` once nothing is decoding, reading or waiting."""
        deadline = time.time() + timeout
        while True:
            _, health = self.get("/health")
            busy = health["decoding"] + health["reading"] + health["waiting"]
            if not busy or time.time() > deadline:
                return health
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def module_fixtures(name: str, **config):
    """A test module's ``server`` fixture (its own ``loaded`` fixture, the
    model it tests, served as ``name`` with fixed draft counts and ``config``'s
    other ``ServeConfig`` fields, closed after the module) and ``client``
    fixture (the OpenAI client once the server is idle):
    ``server, client = module_fixtures(NAME)``."""

    @pytest.fixture(scope="module")
    def server(loaded):
        live = LiveServer(*loaded, name, ServeConfig(**config, drafts=DraftSettings(adaptive=False)))
        yield live
        live.close()

    @pytest.fixture
    def client(server):
        server.wait_idle()
        return server.client()

    return server, client
