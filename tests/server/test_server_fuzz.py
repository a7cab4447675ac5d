"""Fuzzing the real server: schemathesis from our OpenAPI document, and hypothesis with raw JSON.

Neither may get a 5xx or take the server down. Runs are derandomized (the
same examples every time) and bounded in count; the 32-token context keeps
each accepted request short.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread

SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(embedded_server: Callable[..., AbstractContextManager]) -> Iterator[ServerThread]:
    """The embedded model with a 32-token context."""
    with embedded_server(
        EngineArgs(max_model_len=32, num_gpu_blocks_override=256), ServerArgs(log_level="critical")
    ) as s:
        yield s


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(server: ServerThread, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/debug/steps"} <= paths
    if mode is GenerationMode.NEGATIVE:
        # Nothing can be wrong with a request that takes no input.
        operations = [op for op in operations if op.body or op.query]
    statuses: list[int] = []
    for op in operations:

        @SETTINGS
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            resp = case.call(base_url=server.base_url, timeout=60)
            statuses.append(resp.status_code)
            assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:500])
            if resp.status_code >= 400:
                assert "message" in json.loads(resp.content)["error"]

        run()
    assert len(statuses) >= len(operations) * 5
    if mode is GenerationMode.POSITIVE:
        assert statuses.count(200) >= len(operations)
    else:
        assert any(400 <= s < 500 for s in statuses)
    assert httpx.get(server.base_url + "/health").status_code == 200


FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "ignore_eos", "priority", "cache_salt",
    "n", "stream", "stream_options", "min_tokens", "presence_penalty", "repetition_penalty", "model",
    "skip_special_tokens", "chat_template_kwargs", "best_of", "echo",
]  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**66), max_value=2**66)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": json_values}
    ),
    max_size=3,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda d: st.fixed_dictionaries({"prompt": st.text(max_size=20) | json_values, "messages": messages}).map(
        lambda base: {**base, **d}
    )
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_arbitrary_json_bodies_never_get_a_server_error(server: ServerThread, path: str) -> None:
    seen: set[int] = set()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:

        @SETTINGS
        @given(body=bodies)
        def run(body: dict) -> None:
            # NaN and Infinity go out as JSON extensions, as sloppy clients send them.
            resp = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            seen.add(resp.status_code)
            assert resp.status_code in (200, 400, 404), (body, resp.text[:500])
            if resp.status_code != 200:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

        run()
        assert 400 in seen
        assert http.get("/health").status_code == 200
