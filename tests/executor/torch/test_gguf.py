"""GGUF files: tensor names, llama.cpp's q/k row order, errors; and the real model, SmolLM2-135M-Instruct.

The real-model tests fetch the model once (``smollm2_gguf`` in
tests/conftest.py; skipped with the reason when it cannot be fetched) and
compare with transformers loading the same GGUF file in float32: greedy
tokens on chat prompts this project never saw, from the GGUF file and from a
Hugging Face folder, and logprobs. Tokens may differ only at a genuine
near-tie, checked teacher-forced on transformers' logits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from llmsched import LLM, SamplingParams
from llmsched.core.errors import ConfigError
from llmsched.engine.model_files import resolve_model_dir
from llmsched.executor.torch.gguf import hf_name, unpermute_rope_rows

QUESTIONS = [
    "What is the boiling point of water at sea level?",
    "Give me two tips for learning a new language.",
    "Who wrote the play Romeo and Juliet?",
    "Explain what a prime number is in one sentence.",
    "What do bees make?",
    "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?",
    "Suggest a name for a pet turtle.",
    "What is the largest planet in our solar system?",
    "Describe the color blue to someone who cannot see.",
    "Why do leaves change color in autumn?",
    "What is 12 times 7?",
]
NEW_TOKENS = 32
# A token may differ from transformers' only where its two best logits are this close.
NEAR_TIE = 0.05


# ---- without the real model -------------------------------------------------------------


def test_tensor_names_map_to_hugging_faces() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter, as its convert_hf_to_gguf.py writes it (the direction we undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(12, 5), (12,)])
def test_rope_rows_come_back_in_transformers_order(shape: tuple[int, ...]) -> None:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = _llama_cpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rope_rows(permuted, 3), w)


def test_a_file_that_is_neither_folder_nor_gguf_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match=r"not a folder .* or a \.gguf file"):
        resolve_model_dir(f)


# ---- the real model -----------------------------------------------------------------------


def on_a_thread(fn: Callable[[], Any]) -> Any:
    """Run transformers' work on a thread that then exits (see the smollm2_reference fixture)."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    assert box, "the reference computation failed (see above)"
    return box[0]


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt token ids of one user turn, as transformers renders the model's chat template."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def references(smollm2_reference: Callable[[], tuple[Any, Any]]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, transformers' greedy 32 tokens, EOS held back) per question."""
    model, tokenizer = smollm2_reference()

    def run() -> list[tuple[list[int], list[int]]]:
        out = []
        for q in QUESTIONS:
            ids = chat_ids(tokenizer, q)
            with torch.no_grad():
                # The chat template's <|im_end|> is also EOS and padding:
                # without an explicit mask those prompt positions count as padding.
                gen = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                )
            out.append((ids, gen[0, len(ids) :].tolist()))
        return out

    return on_a_thread(run)


def greedy_all_tokens() -> SamplingParams:
    """Greedy, exactly NEW_TOKENS tokens with EOS held back (as min_new_tokens does in transformers)."""
    return SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)


def assert_equal_or_near_tie(
    ours: list[int], ref: list[int], prompt: list[int], smollm2_reference: Callable[[], tuple[Any, Any]]
) -> bool:
    """True if equal; at a first difference, assert it is a near-tie in transformers' logits (False)."""
    if ours == ref:
        return True
    k = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    model, _ = smollm2_reference()

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt + ours[:k]])).logits[0, -1]

    row = on_a_thread(logits)
    top2 = torch.topk(row, 2)
    assert set(top2.indices.tolist()) == {ours[k], ref[k]}, (
        f"token {k}: {ours[k]} vs {ref[k]}, not the top two"
    )
    gap = float(top2.values[0] - top2.values[1])
    assert gap < NEAR_TIE, f"token {k}: {ours[k]} vs {ref[k]} with a logit gap of {gap:.4f}"
    return False


def test_greedy_tokens_from_the_gguf_equal_transformers(
    smollm2_gguf: Path, references: list, smollm2_reference: Callable
) -> None:
    llm = LLM(model=str(smollm2_gguf), dtype="float32")
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in references], greedy_all_tokens())
    finally:
        llm.close()
    equal = [
        assert_equal_or_near_tie(o.outputs[0].token_ids, ref, ids, smollm2_reference)
        for o, (ids, ref) in zip(outs, references)
    ]
    # Near-ties are rare: most continuations match token for token.
    assert sum(equal) >= len(QUESTIONS) - 2, equal


def test_the_hugging_face_folder_gives_the_gguf_files_tokens(
    smollm2_gguf: Path, smollm2_reference: Callable, references: list, tmp_path: Path
) -> None:
    model, tokenizer = smollm2_reference()
    folder = tmp_path / "smollm2"

    def save() -> None:
        # transformers refuses to save a model it loaded from GGUF: write the folder by hand
        # (the head is tied to the embedding, so it is not stored twice).
        from safetensors.torch import save_file

        folder.mkdir()
        weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(weights, str(folder / "model.safetensors"))
        model.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    on_a_thread(lambda: save() or True)
    results = {}
    for name, path in (("folder", folder), ("gguf", smollm2_gguf)):
        llm = LLM(model=str(path), dtype="float32")
        try:
            outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in references[:4]], greedy_all_tokens())
        finally:
            llm.close()
        results[name] = [o.outputs[0].token_ids for o in outs]
    assert results["folder"] == results["gguf"]


def test_logprobs_are_transformers_raw_distribution(
    smollm2_gguf: Path, references: list, smollm2_reference: Callable
) -> None:
    ids = references[0][0]
    llm = LLM(model=str(smollm2_gguf), dtype="float32")
    try:
        (out,) = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True),
        )
    finally:
        llm.close()
    tokens = out.outputs[0].token_ids
    model, _ = smollm2_reference()

    def reference() -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
        return torch.log_softmax(logits.float(), -1)

    ref = on_a_thread(reference)
    for k, entry in enumerate(out.outputs[0].logprobs):
        lp = entry[tokens[k]]
        assert lp.logprob == pytest.approx(float(ref[k, tokens[k]]), abs=2e-3)
        assert lp.rank == 1
        for tid, value in entry.items():
            assert value.logprob == pytest.approx(float(ref[k, tid]), abs=2e-3)


def test_an_answer_from_the_gguf(smollm2_gguf: Path) -> None:
    llm = LLM(model=str(smollm2_gguf))
    try:
        tok = llm.get_tokenizer()
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
        (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    finally:
        llm.close()
    assert "Paris" in out.outputs[0].text


def test_a_gguf_file_of_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"GGUF 'gemma' model; llmsched runs GGUF llama, qwen2, qwen3"):
        resolve_model_dir(path)
