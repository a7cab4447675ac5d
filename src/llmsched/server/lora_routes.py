"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and loading ``--lora-modules`` at start."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.responses import PlainTextResponse

from llmsched.core.errors import ConfigError
from llmsched.server.errors import APIError
from llmsched.server.lora_modules import LoRAModules
from llmsched.server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the name clients will use and a local adapter folder."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body: the adapter's name (``lora_int_id`` is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


async def load_adapter(state: ServerState, name: str, path: str) -> None:
    """Read the adapter in the engine and offer it under ``name``; APIError(400) saying why not."""
    loras = _loras(state)
    try:
        lora = loras.new(name, path)
    except (ConfigError, ValueError) as e:
        raise APIError(400, str(e), "lora_name") from None
    error = await state.engine.lora_op(load=lora)
    if error is not None:
        raise APIError(400, error, "lora_path")
    loras.add(lora)


def lora_router(state: ServerState) -> APIRouter:
    """The adapter endpoints over ``state`` (LoRA must be enabled)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        """Load an adapter at run time; requests then name it in ``model``."""
        await load_adapter(state, body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        """Unload an adapter no unfinished request uses."""
        loras = _loras(state)
        lora = loras.get(body.lora_name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        error = await state.engine.lora_op(unload=lora.lora_int_id)
        if error is not None:
            raise APIError(400, error, "lora_name")
        loras.remove(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router


def _loras(state: ServerState) -> LoRAModules:
    if state.loras is None:
        raise APIError(400, "LoRA is not enabled; start the server with --enable-lora")
    return state.loras
