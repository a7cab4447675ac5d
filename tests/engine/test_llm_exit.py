"""A process that ran LLMs with n-gram speculation exits cleanly, whether or not it closed them.

An executor's step thread still inside a torch op when the interpreter
finalizes is stopped as it takes the GIL back, and the C++ frames it then
unwinds end the process with "terminate called without an active
exception" (SIGABRT). With async scheduling and drafts, the step scheduled
after a request's last one is often still running when ``generate``
returns. Each child below builds nine LLMs in turn (four architectures,
random weights, a byte-level tokenizer), generates greedily with each,
then leaves the last one with a long prefill on its thread as it exits:
kept alive in half of the runs, dropped in the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import llmsched

CHILD = """
import sys
from llmsched import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["the cat sat on the mat, the cat sat on", "abc abc abc ab", "one two one two one"]
folders, drop_last = sys.argv[1:-1], sys.argv[-1] == "drop"
for folder in folders:
    # One thread: OpenMP teams spinning on a busy machine make each step slow.
    llm = LLM(model=folder, dtype="float32", speculative_config=NGRAM, max_model_len=256,
              max_num_batched_tokens=8192, num_threads=1, async_scheduling=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    if folder != folders[-1]:
        del llm
# Async scheduling: this step is left running on the executor's thread.
engine = llm.llm_engine
for i in range(32):
    prompt = [(7 * i + j) % 250 for j in range(240)]
    engine.add_request(f"tail-{i}", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
engine.step()
if drop_last:
    del llm, engine
print("done", flush=True)
"""

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


@pytest.fixture(scope="module")
def nine_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Nine random-weight model folders (the four families in turn) with the byte-level tokenizer."""
    from llmsched.executor.torch.embedded import tokenizer_config, tokenizer_json

    tok = tokenizer_json()
    root = tmp_path_factory.mktemp("nine_models")
    folders = []
    for i in range(9):
        family = list(FAMILIES)[i % len(FAMILIES)]
        config_cls, model_cls = FAMILIES[family]
        config = config_cls(
            vocab_size=len(tok["model"]["vocab"]),
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.5,
        )
        torch.manual_seed(i)
        folder = root / f"{i}-{family}"
        model_cls(config).save_pretrained(folder)
        (folder / "tokenizer.json").write_text(json.dumps(tok))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
        folders.append(folder)
    return folders


@pytest.mark.slow
def test_nine_speculative_llms_never_abort_at_exit(nine_models: list[Path], tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    src = str(Path(llmsched.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    for run in range(10):
        last = "drop" if run % 2 else "keep"
        proc = subprocess.run(
            [sys.executable, str(script), *map(str, nine_models), last],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert "terminate called" not in proc.stderr, f"run {run} ({last}): {proc.stderr[-2000:]}"
        assert proc.returncode == 0, f"run {run} ({last}): exit {proc.returncode}: {proc.stderr[-2000:]}"
        assert proc.stdout.strip() == "done"
