"""vLLM 0.33's `serve` options and EngineArgs fields: each accepted, ignored with a line, or refused by name.

The lists come from vLLM itself (tests/data/vllm_0_33_args.json, written by
tools/dump_vllm_args.py); this suite never imports vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

import pytest

from llmsched import LLM
from llmsched.cli import build_parser, main
from llmsched.core.errors import ConfigError
from llmsched.engine.args import EngineArgs
from llmsched.engine.vllm_flags import (
    BY_DEST,
    FIELD,
    FLAGS,
    IGNORE,
    REFUSE,
    RENAMED_FIELDS,
    SERVE,
    SERVER,
    split_engine_kwargs,
)
from llmsched.server.args import ServerArgs
from llmsched.server.cli import report_ignored

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "vllm_0_33_args.json").read_text())
OPTIONS = [o for o in REFERENCE["serve_options"] if o["option_strings"]]
ENGINE_FIELDS = REFERENCE["engine_args_fields"]
OUR_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}

# Values our parser checks as it reads them, for options it implements.
SAMPLES = {
    "lora_modules": ["a=/tmp/adapter", "b=/tmp/other"],
    "kv_cache_memory_bytes": ["1GiB"],
    "num_gpu_blocks_override": ["64"],
    "max_num_queued_reqs": ["8"],
    "max_num_queued_tokens": ["800"],
    "max_model_len": ["4k"],
    "generation_config": ["vllm"],
}


def sample(option: dict) -> list[list[str]]:
    """Argument lists to follow one spelling of ``option`` with (several when it has choices)."""
    if option["kind"] in ("flag", "bool"):
        return [[]]
    if option["dest"] in SAMPLES:
        return [SAMPLES[option["dest"]]]
    if option["kind"] == "list" and not option["choices"]:
        # Two values: the option must take as many as vLLM's does.
        return [["x", "y"]]
    flag = BY_DEST.get(option["dest"])
    if option["choices"]:
        values = [str(c) for c in option["choices"] if c is not None]
        if flag is not None:
            # One value that is not among those the table takes silently.
            values = [v for v in values if not flag.is_fine(v)][:1] or values[:1]
        return [[v] for v in values]
    t = option["type"] or "str"
    if t == "int":
        return [["2"]]
    if t == "float":
        return [["0.5"]]
    if t.startswith("human_readable_int"):
        return [["4k"]]
    if t in ("loads", "_parse_type", "parse_dataclass", "union_dict_and_str"):
        return [["{}"]]
    return [["x"]]


def parse_serve(argv: list[str]) -> tuple[str, argparse.Namespace | None, str]:
    """("accepted" | "ignored" | "refused" | "error", the namespace, stderr) for `serve` + ``argv``."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = PARSER.parse_args(["serve", *argv])
    except SystemExit:
        text = err.getvalue()
        return ("refused" if "is not supported" in text else "error"), None, text
    return ("ignored" if args.vllm_ignored else "accepted"), args, err.getvalue()


# One parser for every walk below: parsing leaves nothing behind in it.
PARSER = build_parser()
SERVE_ACTIONS = PARSER.commands.choices["serve"]._option_string_actions


@pytest.mark.parametrize("option", OPTIONS, ids=[o["dest"] for o in OPTIONS])
def test_every_vllm_serve_option_is_accepted_ignored_or_refused_by_name(option: dict) -> None:
    for spelling in option["option_strings"]:
        action = SERVE_ACTIONS.get(spelling)
        # The table's entry, when the table (not EngineArgs or ServerArgs) handles this spelling.
        flag = getattr(action, "flag", None)
        for values in sample(option):
            outcome, args, err = parse_serve([spelling, *values])
            given = " ".join([spelling, *values])
            assert outcome != "error", f"`llmsched serve {given}`: {err.splitlines()[-1:]}"
            if flag is None or outcome == "accepted":
                # Implemented (or a value the table takes as what llmsched does anyway).
                assert outcome == "accepted", given
                assert flag is None or flag.is_fine(values[0] if values else spelling != flag.negative)
                assert (
                    flag is not None
                    or option["dest"] not in BY_DEST
                    or BY_DEST[option["dest"]].scope == SERVER
                )
            elif flag.action == IGNORE:
                assert outcome == "ignored", given
                assert [n for n in args.vllm_ignored if spelling in n and flag.why in n], args.vllm_ignored
            else:
                assert flag.action == REFUSE and outcome == "refused", given
                assert spelling in err and flag.why in err, err


def test_the_table_names_only_vllm_options_and_each_once() -> None:
    # A stale entry (vLLM renamed or dropped the option) would never be tested.
    vllm = {f["name"]: f for f in ENGINE_FIELDS} | {o["dest"]: o for o in OPTIONS}
    for flag in FLAGS:
        assert flag.dest in vllm, flag.dest
        if flag.scope == SERVER:
            # ServerArgs implements it: every spelling is the server's own, not the table's.
            actions = [SERVE_ACTIONS.get(o) for o in flag.option_strings]
            assert all(a is not None and not hasattr(a, "flag") for a in actions), flag
        if flag.scope != FIELD:
            option = vllm[flag.dest]
            assert flag.kind == option["kind"], (flag.dest, flag.kind, option["kind"])
            assert set(flag.option_strings) == set(option["option_strings"]), flag.dest
        # Implemented options must not also sit in the table as ignored or refused.
        assert flag.dest not in OUR_FIELDS, flag.dest
    assert len({f.dest for f in FLAGS}) == len(FLAGS)


def _unfine(flag) -> object:
    """An LLM(...) value for ``flag`` that the table does not take silently."""
    if flag.kind in ("flag", "bool"):
        return not flag.is_fine(True)
    return 2 if any(isinstance(f, int) for f in flag.fine) else "x"


@pytest.mark.parametrize("field", ENGINE_FIELDS, ids=[f["name"] for f in ENGINE_FIELDS])
def test_every_vllm_engine_args_field_is_an_llm_keyword_ignored_or_refused(field: dict) -> None:
    name = field["name"]
    if name in OUR_FIELDS or name in RENAMED_FIELDS:
        kept, notes = split_engine_kwargs({name: 1}, OUR_FIELDS)
        assert list(kept) == [RENAMED_FIELDS.get(name, name)] and notes == []
        return
    flag = BY_DEST.get(name)
    assert flag is not None and flag.scope != SERVE, f"vLLM EngineArgs field {name} is not classified"
    value = _unfine(flag)
    if flag.action == REFUSE:
        with pytest.raises(ConfigError, match=f"^{name}=.*is not supported") as e:
            split_engine_kwargs({name: value}, OUR_FIELDS)
        assert flag.why in str(e.value)
    else:
        kept, notes = split_engine_kwargs({name: value}, OUR_FIELDS)
        assert kept == {} and len(notes) == 1 and notes[0].startswith(f"ignoring {name}=")


# vLLM's fields we implement that have a plain default (not a factory; not the model, a Hub name there).
PLAIN_DEFAULTS = [
    f
    for f in ENGINE_FIELDS
    if (f["name"] in OUR_FIELDS or f["name"] in RENAMED_FIELDS)
    and f["default"] not in ("<factory>", "<required>")
    and f["name"] != "model"
]


@pytest.mark.parametrize("field", PLAIN_DEFAULTS, ids=[f["name"] for f in PLAIN_DEFAULTS])
def test_vllms_defaults_for_the_fields_we_implement_are_valid_here(field: dict) -> None:
    kept, _ = split_engine_kwargs({field["name"]: field["default"]}, OUR_FIELDS)
    EngineArgs(**kept)


def test_the_command_line_from_vllms_docs_starts_and_says_what_it_ignores(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "serve", "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--chat-template", "{{ messages[0]['content'] }}", "--tensor-parallel-size", "1", "--enforce-eager",
        "--disable-log-requests", "--generation-config", "vllm", "--uvicorn-log-level", "WARNING",
        "--disable-prefix-caching", "--dtype", "half", "-dp", "1",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    engine, server = EngineArgs.from_cli_args(args), ServerArgs.from_cli_args(args)
    assert server.chat_template == "{{ messages[0]['content'] }}" and server.log_level == "warning"
    assert engine.generation_config == "vllm" and engine.generation_defaults({"temperature": 0.7}) == {}
    assert engine.dtype == "float16" and not engine.enable_prefix_caching
    report_ignored(args)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["llmsched serve"] * 3
    for line, flag in zip(err, ("--trust-remote-code", "--enforce-eager", "--disable-log-requests")):
        assert f"ignoring {flag}: " in line


def test_a_refused_flag_stops_with_its_alternative_and_an_unknown_one_shows_serves_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tensor-parallel-size", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: llmsched serve")
    assert "--tensor-parallel-size 2 is not supported" in err and "--data-parallel-size" in err
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: llmsched serve") and "unrecognized arguments: --no-such-flag" in err
    with pytest.raises(SystemExit):
        main(["generate", "--no-such-flag"])
    assert capsys.readouterr().err.startswith("usage: llmsched generate")


def test_llm_takes_vllms_engine_arguments_it_has_no_use_for(
    byte_model_dir: Path, fake_factory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="llmsched"):
        llm = LLM(
            str(byte_model_dir),
            executor_factory=fake_factory(),
            enforce_eager=True,
            trust_remote_code=True,
            tensor_parallel_size=1,
            kv_cache_memory_bytes="1GiB",
        )
    assert llm.llm_engine.engine_args.kv_cache_memory == 1 << 30
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if "ignoring enforce_eager=True" in m]
    assert [m for m in lines if "ignoring trust_remote_code=True" in m]
    assert not [m for m in lines if "tensor_parallel_size" in m]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 is not supported.*--data-parallel-size"):
        LLM(str(byte_model_dir), executor_factory=fake_factory(), tensor_parallel_size=2)


def test_generation_config_picks_the_sampling_defaults(tmp_path: Path) -> None:
    model = {"temperature": 0.7, "top_p": 0.8}
    assert EngineArgs().generation_defaults(model) == model
    assert EngineArgs(generation_config="vllm").generation_defaults(model) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5, "eos_token_id": 3}))
    assert EngineArgs(generation_config=str(tmp_path)).generation_defaults(model) == {"top_k": 5}
    over = EngineArgs(override_generation_config='{"temperature": 0.1}')
    assert over.generation_defaults(model) == {"temperature": 0.1, "top_p": 0.8}
    with pytest.raises(ConfigError, match="generation_config='/no/such'"):
        EngineArgs(generation_config="/no/such")


def test_a_chat_template_file_or_text_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages | length }}")
    assert ServerArgs(chat_template=str(path)).chat_template == "{{ messages | length }}"
    assert ServerArgs(chat_template="{{ 1 }}\\n").chat_template == "{{ 1 }}\n"
    with pytest.raises(ConfigError, match=r"chat template file '/no/such\.jinja' cannot be read"):
        ServerArgs(chat_template="/no/such.jinja")
