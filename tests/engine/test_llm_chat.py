"""LLM.chat: the model's chat template, one conversation or many, template options, BOS once, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmsched import LLM, SamplingParams
from llmsched.core.errors import ConfigError
from llmsched.engine.chat_template import ChatTemplateError, render_chat
from llmsched.executor.torch.embedded import ENDOFTEXT_ID

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# ChatML as the byte model's template writes it (tests/conftest.py's byte_model_dir).
CHAT_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"
FEW = SamplingParams(max_tokens=3)


def make_llm(model_dir: Path, fake_factory, **kwargs: object) -> LLM:
    """An LLM over a byte-level model folder and a FakeExecutor (next token: the next byte)."""
    return LLM(str(model_dir), executor_factory=fake_factory(), **kwargs)


def copy_model(src: Path, dest: Path, tokenizer_json: dict | None = None, **tokenizer_config: object) -> Path:
    """A copy of ``src``: tokenizer_config.json keys set (None: removed), tokenizer.json maybe replaced."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    for key, value in tokenizer_config.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if tokenizer_json is not None:
        (dest / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return dest


@pytest.fixture
def llm(byte_model_dir: Path, fake_factory) -> LLM:
    """An LLM over the byte model, whose tokenizer carries a ChatML template."""
    return make_llm(byte_model_dir, fake_factory)


def test_one_conversation_is_rendered_with_the_models_template(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    (out,) = llm.chat(CHAT, FEW, use_tqdm=False)
    expected = render_chat(tok.chat_template, CHAT, bos_token=tok.bos_token, eos_token=tok.eos_token)
    assert expected == CHAT_TEXT + ASSISTANT
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    # Chat markers are single special tokens, not their bytes.
    assert out.prompt_token_ids[0] == tok.token_to_id("<|im_start|>")
    # The FakeExecutor answers the byte after the prompt's last token ("\n" -> "A").
    assert out.outputs[0].text == "ABC" and out.finished and out.error is None


def test_a_list_of_conversations_gives_one_output_each_in_order(llm: LLM) -> None:
    convs = [[{"role": "user", "content": f"q{k}"}] for k in range(4)]
    params = [SamplingParams(max_tokens=n) for n in (4, 1, 3, 2)]
    outs = llm.chat(convs, params, use_tqdm=False)
    assert [o.prompt for o in outs] == [f"<|im_start|>user\nq{k}<|im_end|>\n{ASSISTANT}" for k in range(4)]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 1, 3, 2]
    # A single conversation and a list holding it render the same prompt.
    (single,) = llm.chat(convs[2], FEW, use_tqdm=False)
    assert single.prompt_token_ids == outs[2].prompt_token_ids
    assert llm.chat([], FEW, use_tqdm=False) == []


def test_chat_equals_generate_on_the_rendered_token_ids(llm: LLM) -> None:
    (chat,) = llm.chat(CHAT, SamplingParams(max_tokens=5), use_tqdm=False)
    ids = llm.get_tokenizer().encode(CHAT_TEXT + ASSISTANT, add_special_tokens=False)
    (gen,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5), use_tqdm=False)
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_bos_is_not_added_twice(byte_model_dir: Path, tmp_path: Path, fake_factory) -> None:
    # A tokenizer that prepends BOS when encoding, and a template that writes BOS itself (Llama-style).
    tj = json.loads((byte_model_dir / "tokenizer.json").read_text())
    bos = "<|endoftext|>"
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [ENDOFTEXT_ID], "tokens": [bos]}},
    }
    template = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    d = copy_model(byte_model_dir, tmp_path / "m", tj, bos_token=bos, chat_template=template)
    llm = make_llm(d, fake_factory)
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], FEW, use_tqdm=False)
    assert out.prompt == f"{bos}user: Hi\n"
    assert out.prompt_token_ids == [ENDOFTEXT_ID, *b"user: Hi\n"]
    # The same text as a plain prompt gets the tokenizer's BOS as well: that is what chat avoids.
    (gen,) = llm.generate(out.prompt, FEW, use_tqdm=False)
    assert gen.prompt_token_ids[:2] == [ENDOFTEXT_ID, ENDOFTEXT_ID]


def test_chat_template_overrides_the_models(
    llm: LLM, byte_model_dir: Path, tmp_path: Path, fake_factory
) -> None:
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    (out,) = llm.chat(CHAT, FEW, use_tqdm=False, chat_template=template)
    assert out.prompt == "[system]Be brief.[user]Hi"
    assert out.prompt_token_ids == list(b"[system]Be brief.[user]Hi")
    # A model without a template of its own can still chat with one given.
    bare = make_llm(copy_model(byte_model_dir, tmp_path / "bare", chat_template=None), fake_factory)
    (out,) = bare.chat(CHAT, FEW, use_tqdm=False, chat_template=template)
    assert out.prompt == "[system]Be brief.[user]Hi"
    with pytest.raises(ConfigError, match=r"no chat template.*chat_template="):
        bare.chat(CHAT, FEW, use_tqdm=False)


def test_templates_may_use_loop_controls_as_in_hugging_face(llm: LLM) -> None:
    first_only = "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}"
    (out,) = llm.chat(CHAT, FEW, use_tqdm=False, chat_template=first_only)
    assert out.prompt == "Be brief."


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(llm: LLM) -> None:
    (out,) = llm.chat(CHAT, FEW, use_tqdm=False, add_generation_prompt=False)
    assert out.prompt == CHAT_TEXT


def test_continue_final_message_ends_the_prompt_inside_the_assistant_message(llm: LLM) -> None:
    conv = [*CHAT, {"role": "assistant", "content": "Hello, I"}]
    (out,) = llm.chat(conv, FEW, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == CHAT_TEXT + ASSISTANT + "Hello, I"
    assert out.prompt_token_ids[-8:] == list(b"Hello, I")
    assert out.outputs[0].text == "JKL"  # the bytes after "I": generation goes on from the message


def test_continue_final_message_keeps_trailing_space_only_if_the_template_does(llm: LLM) -> None:
    conv = [*CHAT, {"role": "assistant", "content": "Sure: "}]
    options = {"add_generation_prompt": False, "continue_final_message": True, "use_tqdm": False}
    (kept,) = llm.chat(conv, FEW, **options)
    assert kept.prompt.endswith(ASSISTANT + "Sure: ")
    trimmed = "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
    (cut,) = llm.chat(conv, FEW, chat_template=trimmed, **options)
    assert cut.prompt == "<system>Be brief.</system><user>Hi</user><assistant>Sure:"


def test_continue_final_message_errors(llm: LLM) -> None:
    conv = [*CHAT, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, FEW, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant's, not 'user'"):
        llm.chat(CHAT, FEW, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="needs text in the final message"):
        llm.chat(
            [*CHAT, {"role": "assistant", "content": ""}],
            FEW,
            use_tqdm=False,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    hides_it = "{% for m in messages %}{{ m.role }};{% endfor %}"
    with pytest.raises(ValueError, match="does not write the final message"):
        llm.chat(
            conv,
            FEW,
            use_tqdm=False,
            chat_template=hides_it,
            add_generation_prompt=False,
            continue_final_message=True,
        )
    assert not llm.llm_engine.has_unfinished_requests()


def test_tools_and_chat_template_kwargs_reach_the_template(llm: LLM) -> None:
    template = (
        "{{ tools | tojson }}|{{ greeting }}|{{ add_generation_prompt }}|"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "now", "description": "<é>"}}]
    (out,) = llm.chat(
        CHAT,
        FEW,
        use_tqdm=False,
        chat_template=template,
        tools=tools,
        chat_template_kwargs={"greeting": "hey"},
    )
    # Keys in order and text unescaped, as Hugging Face's tojson writes them (jinja2's sorts and escapes).
    assert (
        out.prompt
        == '[{"type": "function", "function": {"name": "now", "description": "<é>"}}]|hey|True|Be brief.Hi'
    )
    # As in transformers, a template always sees `tools`: None when none are given.
    (out,) = llm.chat(CHAT, FEW, use_tqdm=False, chat_template="{{ tools is none }}")
    assert out.prompt == "True"


def test_chat_template_kwargs_may_not_replace_the_renderers_own(llm: LLM) -> None:
    with pytest.raises(ChatTemplateError, match=r"may not set.*messages") as e:
        llm.chat(CHAT, FEW, use_tqdm=False, chat_template_kwargs={"messages": []})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(ValueError, match="tools given twice"):
        llm.chat(CHAT, FEW, use_tqdm=False, tools=[], chat_template_kwargs={"tools": []})


def test_text_content_parts_are_joined_or_passed_as_the_template_wants(llm: LLM) -> None:
    conv = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    (out,) = llm.chat(conv, FEW, use_tqdm=False)
    assert out.prompt == f"<|im_start|>user\na\nb<|im_end|>\n{ASSISTANT}"
    # A template that loops over the parts gets them ("auto" detects it), strings included.
    loops = "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}"
    both = [*conv, {"role": "user", "content": "c"}]
    (out,) = llm.chat(both, FEW, use_tqdm=False, chat_template=loops)
    assert out.prompt == "<a><b><c>"
    (out,) = llm.chat(both, FEW, use_tqdm=False, chat_template=loops, chat_template_content_format="string")
    assert out.prompt == "<><><><>"  # iterating a string gives characters, which have no .text
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conv, FEW, use_tqdm=False, chat_template_content_format="html")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"content": "no role"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], r"messages\[1\] has no 'content'"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]: only text"),
        ([{"role": "user", "content": 3}], "content must be a string or a list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ("hello", "messages must be a conversation"),
        ([[{"role": "user", "content": "ok"}], [{"role": "user"}]], r"messages\[1\]\[0\] has no 'content'"),
        ([[{"role": "user", "content": "ok"}], []], r"messages\[1\] is empty"),
    ],
)
def test_malformed_messages_raise_naming_the_message(llm: LLM, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, FEW, use_tqdm=False)  # type: ignore[arg-type]
    # Nothing was queued: a batch with a bad conversation runs none of them.
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.executor.calls == []  # type: ignore[attr-defined]


def test_a_template_that_raises_names_the_conversation(llm: LLM) -> None:
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('user goes first') }}{% endif %}"
    ok = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: user goes first"):
        llm.chat([ok, CHAT], FEW, use_tqdm=False, chat_template=strict)
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        llm.chat(ok, FEW, use_tqdm=False, chat_template="{{ messages[0].content + 1 }}")


def test_a_lora_request_is_refused_when_lora_is_off_or_malformed(llm: LLM) -> None:
    from llmsched import LoRARequest

    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.chat(CHAT, FEW, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.chat(CHAT, FEW, use_tqdm=False, lora_request=LoRARequest("a", 1, "/nowhere"))


def test_an_over_long_conversation_fails_alone_keeping_its_prompt(byte_model_dir: Path, fake_factory) -> None:
    llm = LLM(str(byte_model_dir), executor_factory=fake_factory(max_model_len=64))
    long = [{"role": "user", "content": "y" * 80}]
    outs = llm.chat([long, CHAT], FEW, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "max_model_len" in (outs[0].error or "")
    assert outs[0].prompt == f"<|im_start|>user\n{'y' * 80}<|im_end|>\n{ASSISTANT}"
    assert outs[1].error is None and outs[1].outputs[0].text == "ABC"


def test_the_embedded_model_chats_as_it_generates(use_embedded: Path) -> None:
    llm = LLM()
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        (chat,) = llm.chat(CHAT, params, use_tqdm=False)
        assert chat.prompt == CHAT_TEXT + ASSISTANT
        ids = llm.get_tokenizer().encode(CHAT_TEXT + ASSISTANT, add_special_tokens=False)
        assert chat.prompt_token_ids == ids
        (gen,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        assert chat.outputs[0].token_ids == gen.outputs[0].token_ids
        assert len(chat.outputs[0].token_ids) >= 1
    finally:
        llm.close()
