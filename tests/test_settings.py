"""structllm.config: one home per default, and the flags generated from it."""

from __future__ import annotations

import argparse

import attrs
import pytest

from structllm.cli import build_parser, engine_args
from structllm.config import (
    TOPICS,
    EngineConfig,
    FrontendConfig,
    ServerConfig,
    add_arguments,
    from_arguments,
    split_fields,
)
from structllm.core.scheduler import SchedulerConfig
from structllm.params import SamplingParams
from structllm.server.run import configs_from_args


def _flags(cls: type) -> list[attrs.Attribute[object]]:
    return [f for f in attrs.fields(cls) if f.metadata.get("cli", True)]


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    return action.choices[command]


@pytest.mark.parametrize(
    ("command", "classes"),
    [
        ("generate", [EngineConfig]),
        ("serve", [EngineConfig, FrontendConfig, ServerConfig]),
    ],
)
def test_every_setting_has_a_flag_with_its_default(
    command: str, classes: list[type]
) -> None:
    parser = _subparser(command)
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    for cls in classes:
        for field in _flags(cls):
            flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
            action = by_flag[flag]
            if field.default is not attrs.NOTHING:
                assert action.default == field.default, flag
            assert action.help, f"{flag} has no help"


def test_no_flag_is_defined_twice() -> None:
    for command in ("generate", "serve"):
        strings = [s for a in _subparser(command)._actions for s in a.option_strings]
        assert len(strings) == len(set(strings)), command


def test_defaults_parse_back_to_the_default_configs() -> None:
    ns = build_parser().parse_args(["serve", "tiny-random"])
    engine = EngineConfig(model=ns.model, **engine_args(ns))
    server, front = configs_from_args(ns, engine)
    assert engine == EngineConfig(model="tiny-random")
    assert front == FrontendConfig()
    assert server == ServerConfig(model_name="tiny-random")


def test_flags_reach_the_configs() -> None:
    argv = ["serve", "m", "--served-model-name", "alias", "--port", "0"]
    argv += ["--loop", "trio", "--max-restarts", "7", "--no-show-progress"]
    argv += ["--max-num-seqs", "3", "--no-enable-prefix-caching", "--dtype", "float32"]
    ns = build_parser().parse_args(argv)
    engine = EngineConfig(model=ns.model, **engine_args(ns))
    server, front = configs_from_args(ns, engine)
    assert (server.model_name, server.port, server.loop) == ("alias", 0, "trio")
    assert (front.max_restarts, front.show_progress) == (7, False)
    assert engine.max_num_seqs == 3 and not engine.enable_prefix_caching
    assert engine.dtype == "float32"


def test_choices_come_from_literal_types() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--executor", "thread"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "m", "p", "--model-backend", "x"])


def test_sampling_flags_are_samplingparams_fields() -> None:
    p = argparse.ArgumentParser()
    only = ("max_tokens", "temperature", "stop", "seed")
    add_arguments(p, SamplingParams, only=only, defaults={"max_tokens": 64})
    ns = p.parse_args(["--stop", "a", "--stop", "b", "--temperature", "0.5"])
    params = from_arguments(SamplingParams, ns, only=only)
    assert params == SamplingParams(max_tokens=64, temperature=0.5, stop=("a", "b"))
    assert from_arguments(SamplingParams, p.parse_args([]), only=only) == (
        SamplingParams(max_tokens=64)
    )


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(KeyError, match="no_such"):
        add_arguments(argparse.ArgumentParser(), EngineConfig, only=["no_such"])
    with pytest.raises(TypeError, match="unexpected argument 'nope'"):
        split_fields({"nope": 1}, EngineConfig, FrontendConfig, caller="f()")
    engine, front = split_fields(
        {"max_num_seqs": 2, "executor": "inline"},
        EngineConfig,
        FrontendConfig,
        caller="f()",
    )
    assert engine == {"max_num_seqs": 2} and front == {"executor": "inline"}


def test_test_hooks_have_no_flags() -> None:
    strings = {s for a in _subparser("serve")._actions for s in a.option_strings}
    assert "--fault" not in strings and "--fault-starts" not in strings
    assert "--seed" not in strings  # dummy-weight seed: library only


def test_every_flag_of_the_configs_has_a_topic() -> None:
    for cls in (EngineConfig, FrontendConfig, ServerConfig):
        for field in _flags(cls):
            assert field.metadata["topic"] in TOPICS, f"{cls.__name__}.{field.name}"


def test_serve_help_is_grouped_by_topic() -> None:
    parser = _subparser("serve")
    group_of = {
        a.dest: g.title for g in parser._action_groups for a in g._group_actions
    }
    for cls in (EngineConfig, FrontendConfig, ServerConfig):
        for field in _flags(cls):
            dest = (field.metadata["flag"] or field.name).lstrip("-").replace("-", "_")
            assert group_of[dest] == TOPICS[field.metadata["topic"]], field.name
    titles = [g.title for g in parser._action_groups]
    shown = [t for t in TOPICS.values() if t in titles]
    assert shown == [t for t in titles if t in TOPICS.values()]  # in TOPICS order
    assert {"network", "security (API keys, CORS)", "limits and timeouts"} <= set(
        titles
    )
    help_text = parser.format_help()
    assert help_text.index("\n  --api-key") > help_text.index("\nsecurity (API")


def test_no_help_shows_rst_markup() -> None:
    def walk(parser: argparse.ArgumentParser) -> None:
        assert "``" not in parser.format_help(), parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser())


def test_make_tiny_model_flags_take_the_functions_defaults() -> None:
    import inspect

    from structllm.cli import _TINY_FLAGS
    from structllm.models import make_tiny_model

    ns = build_parser().parse_args(["make-tiny-model", "d"])
    params = inspect.signature(make_tiny_model).parameters
    for name in _TINY_FLAGS:
        assert getattr(ns, name) == params[name].default, name
    ns = build_parser().parse_args(["make-tiny-model", "d", "--arch", "qwen3"])
    assert ns.arch == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["make-tiny-model", "d", "--arch", "gpt2"])


def test_derived_defaults_have_one_home() -> None:
    engine = attrs.fields(EngineConfig)
    scheduler = SchedulerConfig(max_model_len=8)
    assert scheduler.max_num_seqs == engine.max_num_seqs.default
    assert scheduler.max_num_batched_tokens == engine.max_num_batched_tokens.default
    assert scheduler.enable_chunked_prefill == engine.enable_chunked_prefill.default
    assert scheduler.enable_prefix_caching == engine.enable_prefix_caching.default
    server = ServerConfig(model_name="m")
    assert server.default_max_tokens == SamplingParams().max_tokens


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["serve", "m", "--max-num-seqs", "0"], "max_num_seqs"),
        (["serve", "m", "--port", "70000"], "port"),
        (["serve", "m", "--heartbeat-timeout", "0"], "heartbeat_timeout"),
        (["generate", "m", "p", "--block-size", "0"], "block_size"),
    ],
)
def test_a_value_that_cannot_work_stops_the_command_naming_it(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from structllm.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and "Traceback" not in err
