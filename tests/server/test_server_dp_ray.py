"""`llmsched serve --data-parallel-backend ray`: two ranks as Ray actors of a local Ray cluster."""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

import llmsched
from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from support.dp_serving import ENGINE, HANG_S, PROMPTS, complete, metric_samples


@pytest.mark.slow
def test_ranks_placed_by_ray_serve_and_equal_one_engines(
    embedded_server: Callable[..., AbstractContextManager], embedded_cache: Path
) -> None:
    import ray  # the dev extra installs it (llmsched[sweep])

    # A cluster of its own, standing in for several machines; its workers import this checkout.
    temp = tempfile.mkdtemp(prefix="ray")
    env = {"PYTHONPATH": str(Path(llmsched.__file__).parents[1]), "LLMSCHED_CACHE_DIR": str(embedded_cache)}
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, runtime_env={"env_vars": env})
    try:
        args = ServerArgs(log_level="warning", data_parallel_size=2, data_parallel_backend="ray")
        with embedded_server(EngineArgs(**ENGINE), args) as s:
            log = "\n".join(s.state.startup_log)
            assert log.count("Ray actor, process") == 2, log
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                dp = list(pool.map(lambda p: complete(s.base_url, p)["choices"][0]["text"], PROMPTS))
            generated = metric_samples(s.base_url, "vllm:generation_tokens_total")
        # The server leaves a cluster it did not start running, with its bundles freed (Ray frees them
        # in the background).
        deadline = time.monotonic() + HANG_S
        while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.is_initialized() and ray.available_resources().get("CPU") == 2.0
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values()), generated
    with embedded_server(EngineArgs(**ENGINE), ServerArgs(log_level="warning")) as one:
        single = [complete(one.base_url, p)["choices"][0]["text"] for p in PROMPTS]
    assert dp == single
