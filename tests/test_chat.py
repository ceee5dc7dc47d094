"""Chat templates render as transformers renders them; failures name a field."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from structllm.errors import InvalidRequestError
from structllm.text import (
    CHATML_TEMPLATE,
    ByteTokenizer,
    render_chat_template,
    validate_messages,
)

# Shaped like Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
    "\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Shaped like Qwen2.5-Instruct's template (ChatML with a default system prompt).
QWEN2_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Refuses conversations that do not alternate, as Mistral's template does.
ALTERNATING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
    "{% endif %}"
    "[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def test_llama3_template() -> None:
    prompt = render_chat_template(
        LLAMA3_TEMPLATE,
        CONVERSATION,
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    assert prompt == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_qwen2_template() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    prompt = render_chat_template(
        QWEN2_TEMPLATE,
        messages,
        add_generation_prompt=True,
        bos_token="",
        eos_token="<|im_end|>",
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = render_chat_template(
        QWEN2_TEMPLATE,
        messages,
        add_generation_prompt=False,
        bos_token="",
        eos_token="<|im_end|>",
    )
    assert without == prompt.removesuffix("<|im_start|>assistant\n")


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant"]),
                "content": st.text(),
            }
        ),
        max_size=5,
    ),
    st.booleans(),
)
def test_chatml_renders_every_message_verbatim(
    messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages
    )
    if add_generation_prompt:
        expected += "<|im_start|>assistant\n"
    prompt = render_chat_template(
        CHATML_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="",
        eos_token="<|im_end|>",
    )
    assert prompt == expected


def test_block_tags_take_their_line_with_them() -> None:
    # trim_blocks and lstrip_blocks, as transformers sets them
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "{{ m['content'] }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    prompt = render_chat_template(
        template,
        CONVERSATION,
        add_generation_prompt=False,
        bos_token="",
        eos_token="",
    )
    assert prompt == "Hi there \n2+2?\n"


def test_raise_exception_becomes_invalid_request() -> None:
    messages = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        render_chat_template(
            ALTERNATING_TEMPLATE,
            messages,
            add_generation_prompt=False,
            bos_token="",
            eos_token="",
        )
    assert info.value.field == "messages"


def test_syntax_error_names_the_template() -> None:
    with pytest.raises(InvalidRequestError, match="does not compile") as info:
        render_chat_template(
            "{% for m in messages %}",
            [],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    assert info.value.field == "chat_template"


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0]['content'] + 1 }}",  # TypeError inside the template
        "{{ messages.append(1) }}",  # the sandbox is immutable
        "{{ messages[0]['content'].__class__.__mro__ }}",  # unsafe attribute
        "{{ 1 // 0 }}",
    ],
)
def test_runtime_errors_become_invalid_request(template: str) -> None:
    with pytest.raises(InvalidRequestError, match="chat template failed") as info:
        render_chat_template(
            template,
            [{"role": "user", "content": "x"}],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    assert info.value.field == "messages"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "x"}, "must be a list"),
        (None, "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role must be a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "user"}],
            r"messages\[1\]\.content",
        ),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string"),
        ([{"role": 1, "content": "x"}], r"messages\[0\]\.role must be a string"),
    ],
)
def test_malformed_messages(messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        render_chat_template(
            CHATML_TEMPLATE,
            messages,
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    assert info.value.field == "messages"


def test_validate_messages_keeps_extra_keys_and_copies() -> None:
    messages = [{"role": "user", "content": "x", "name": "bob"}]
    checked = validate_messages(messages)
    assert checked == messages
    assert checked[0] is not messages[0]


def test_tojson_does_not_escape_html_or_unicode() -> None:
    template = "{{ tools | tojson }}|{{ tools | tojson(indent=1) }}"
    tools = [{"name": "<b>&'", "desc": "café"}]
    prompt = render_chat_template(
        template,
        [],
        add_generation_prompt=True,
        bos_token="",
        eos_token="",
        tools=tools,
    )
    assert prompt == (
        '[{"name": "<b>&\'", "desc": "café"}]|'
        '[\n {\n  "name": "<b>&\'",\n  "desc": "café"\n }\n]'
    )


def test_extra_variables_loop_controls_and_strftime() -> None:
    template = (
        "{{ date_string }} {{ strftime_now('%Y') | length }} "
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    prompt = render_chat_template(
        template,
        CONVERSATION,
        add_generation_prompt=True,
        bos_token="",
        eos_token="",
        date_string="26 Jul 2024",
    )
    assert prompt == "26 Jul 2024 4 Be brief."


def test_byte_tokenizer_template_ends_assistant_turns_with_eos() -> None:
    tokenizer = ByteTokenizer()
    prompt = tokenizer.apply_chat_template(CONVERSATION[1:])
    assert prompt == (
        "<|user|>\nHi there \n<|assistant|>\nHello!<|eos|>\n<|user|>\n2+2?\n"
        "<|assistant|>\n"
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert [i for i in ids if i in tokenizer.eos_token_ids] == [257]
    assert (
        tokenizer.apply_chat_template(CONVERSATION[1:2], add_generation_prompt=False)
        == "<|user|>\nHi there \n"
    )


def test_continue_final_message_ends_at_its_content() -> None:
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "It is "},
    ]
    text = render_chat_template(
        CHATML_TEMPLATE,
        messages,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text.endswith("<|im_start|>assistant\nIt is ")
    with pytest.raises(InvalidRequestError) as info:  # both is a contradiction
        render_chat_template(
            CHATML_TEMPLATE,
            messages,
            add_generation_prompt=True,
            continue_final_message=True,
        )
    assert info.value.field == "continue_final_message"
    silent = "{% for m in messages %}{{ m.role }}{% endfor %}"  # writes no content
    with pytest.raises(InvalidRequestError) as info:
        render_chat_template(
            silent, messages, add_generation_prompt=False, continue_final_message=True
        )
    assert info.value.field == "continue_final_message"


def test_template_kwargs_reach_the_template_but_replace_nothing() -> None:
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
    msgs = [{"role": "user", "content": "hi"}]
    on = render_chat_template(
        template,
        msgs,
        add_generation_prompt=False,
        template_kwargs={"enable_thinking": True},
    )
    assert on == "<think>hi"
    assert render_chat_template(template, msgs, add_generation_prompt=False) == "hi"
    for key in ("messages", "add_generation_prompt", "bos_token", "tools"):
        with pytest.raises(InvalidRequestError) as info:
            render_chat_template(
                template,
                msgs,
                add_generation_prompt=False,
                template_kwargs={key: 1},
                tools=None,
            )
        assert info.value.field == f"chat_template_kwargs.{key}"
