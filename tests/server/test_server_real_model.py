"""The real model (SmolLM2-135M-Instruct, a GGUF file) behind the OpenAI-compatible server.

Skipped, saying why, when the model cannot be fetched (see ``smollm2_gguf``).
"""

from __future__ import annotations

from pathlib import Path

import openai

from llmsched.engine.args import EngineArgs
from llmsched.server.args import ServerArgs
from llmsched.server.launch import ServerThread


def test_chat_through_the_openai_client_answers(smollm2_gguf: Path) -> None:
    engine_args = EngineArgs(model=str(smollm2_gguf), max_model_len=1024, max_num_seqs=8)
    with ServerThread(engine_args, ServerArgs(served_model_name=["smollm2"], log_level="warning")) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0.0,
        )
        choice = reply.choices[0]
        assert "Paris" in choice.message.content
        # The chat template's <|im_end|> (the model's EOS) ends the answer.
        assert choice.finish_reason == "stop"
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=24,
                temperature=0.0,
                stream=True,
            )
            if chunk.choices
        )
        assert streamed == choice.message.content
