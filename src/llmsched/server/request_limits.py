"""Per-request bounds: how many logprobs, how many and how long stop strings, and none without a tokenizer."""

from __future__ import annotations

from llmsched.server.errors import APIError
from llmsched.server.protocol import SamplingFields


def check_request_limits(
    req: SamplingFields,
    logprobs: int | None,
    *,
    max_logprobs: int,
    max_stop_strings: int,
    max_stop_len: int,
    has_tokenizer: bool = True,
) -> None:
    """400 naming the field when a request asks for more than the server allows."""
    if req.stop and not has_tokenizer:
        raise APIError(
            400, "stop strings need a tokenizer; this server runs with --skip-tokenizer-init", "stop"
        )
    if logprobs is not None and logprobs > max_logprobs:
        param = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
        raise APIError(
            400,
            f"{param}={logprobs} is more than this server returns "
            f"(at most {max_logprobs}; see --max-logprobs)",
            param,
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > max_stop_strings:
        raise APIError(
            400,
            f"{len(stops)} stop strings given; at most {max_stop_strings} (see --max-stop-strings)",
            "stop",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > max_stop_len:
        raise APIError(
            400,
            f"a stop string of {longest} characters given; "
            f"at most {max_stop_len} (see --max-stop-string-len)",
            "stop",
        )
    if req.stop_token_ids is not None and len(req.stop_token_ids) > max_stop_strings:
        raise APIError(
            400,
            f"{len(req.stop_token_ids)} stop_token_ids given; "
            f"at most {max_stop_strings} (see --max-stop-strings)",
            "stop_token_ids",
        )
