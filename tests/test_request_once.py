"""A request is one value, built once: the server completes it (limit,
constraint, seed) into a new value where it makes the engine's record, and
never changes a request after it is built."""

import asyncio
import dataclasses

import mlx_mtp
import tiny
from live_server import LiveServer

from mlx_mtp.serve import ServeConfig, parse
from mlx_mtp.serve.service import engine_request
from mlx_mtp.serve.tools import ToolPlan


def test_the_engines_record_is_a_new_value(tmp_path):
    full, _ = tiny.build_folder(tmp_path / "mimo", "mimo")
    model, tokenizer = mlx_mtp.load(full)
    server = LiveServer(model, tokenizer, "m", ServeConfig())
    try:
        service = server.app.state.service
        body = {"prompt": "hi", "max_tokens": 10**6, "temperature": 0.7,
                "response_format": {"type": "json_object"}}  # fmt: skip
        params = parse.params(service, body)
        before = dataclasses.replace(params)
        held = asyncio.run(service.hold(ToolPlan(), params))
        record = engine_request(service, [5, 6, 7], held, "prompt", lambda e: None)
        assert params == before  # neither step changed what it was given
        assert record.params.max_tokens < 10**6  # cut where the context ends
        assert record.params.logits_processors and not params.logits_processors
        assert record.params.sampling.seed is not None and params.sampling.seed is None
    finally:
        server.close()
