"""The torch executor with a KV connector's worker side around each step."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from llmsched.core.output import ModelRunnerOutput, SchedulerOutput
from llmsched.executor.protocol import submit_step
from llmsched.executor.torch.kv_transfer.connector import MooncakeConnector

# An engine with nothing to compute but transfers under way waits this long
# for one to end before stepping again (instead of spinning).
IDLE_WAIT_S = 0.005


class ConnectorExecutor:
    """Starts each step's loads, runs the step, and attaches the transfers that ended to its output."""

    def __init__(self, inner: Any, connector: MooncakeConnector) -> None:
        self.inner = inner
        self.connector = connector

    def __getattr__(self, name: str) -> Any:
        # num_gpu_blocks, max_model_len, block_size, kv_cache, ...
        return getattr(self.inner, name)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait."""
        out = self.submit(scheduler_output)
        return out if isinstance(out, ModelRunnerOutput) else out.result()

    def submit(self, so: SchedulerOutput) -> Future[ModelRunnerOutput] | ModelRunnerOutput:
        """Start the step's loads, hand the step over, and collect events when it ends."""
        conn = self.connector
        conn.start_loads(so.kv_connector_metadata)  # type: ignore[arg-type]
        if not so.scheduled and conn.busy():
            conn.wait_for_events(IDLE_WAIT_S)
        result = submit_step(self.inner, so)
        if isinstance(result, ModelRunnerOutput):
            return self._attach(result)
        fut: Future[ModelRunnerOutput] = Future()

        def done(f: Future[ModelRunnerOutput]) -> None:
            try:
                fut.set_result(self._attach(f.result()))
            except BaseException as e:
                fut.set_exception(e)

        result.add_done_callback(done)
        return fut

    def _attach(self, result: ModelRunnerOutput) -> ModelRunnerOutput:
        events = self.connector.take_output()
        if events is None:
            return result
        # A fresh object: the executor may hand out a shared empty output.
        return ModelRunnerOutput(
            result.sampled_token_ids, result.draft_token_ids, result.logprobs, result.extra, events
        )

    def close(self) -> None:
        """Close the connector, then the executor."""
        self.connector.close()
        self.inner.close()
