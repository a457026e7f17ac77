"""Tool conversations render on every chat template: as the template lays them out, or in the text form."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specstand.models.chat import TOOLS_PREAMBLE, render_chat, template_knows_tools, tools_as_text

# SmolLM2-135M-Instruct's template: it knows no tools and concatenates `content`, so None fails it
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "user", "content": "events in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "find", "arguments": '{"city": "Bergen"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3 events"},
    {"role": "tool", "tool_call_id": "c2", "content": "none"},
]


@pytest.fixture()
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_template_without_tools_gets_the_text_form(tokenizer):
    tokenizer.chat_template = SMOLLM2
    assert not template_knows_tools(SMOLLM2)
    with pytest.raises(Exception, match="no attribute 'content'"):  # what a 400 used to report
        tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    text = render_chat(tokenizer, CONVERSATION, TOOLS)
    calls = ('<tool_call>{"name": "find", "arguments": {"city": "Oslo"}}</tool_call>\n'
             '<tool_call>{"name": "find", "arguments": {"city": "Bergen"}}</tool_call>')
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>3 events</tool_response>\n<tool_response>none</tool_response>" in text
    assert text.startswith(f"<|im_start|>system\n{TOOLS_PREAMBLE}\n{json.dumps(TOOLS[0])}<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_the_tools_join_a_system_message_and_plain_chats_are_untouched(tokenizer):
    tokenizer.chat_template = SMOLLM2
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tools_as_text(messages, TOOLS)[0]["content"].startswith("Be brief.\n\n" + TOOLS_PREAMBLE)
    plain = render_chat(tokenizer, messages)
    assert plain == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert TOOLS_PREAMBLE not in plain


def test_a_template_that_knows_tools_gets_them_and_falls_back_only_when_it_fails(tokenizer):
    tokenizer.chat_template = ("{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
                               "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                               "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }};{% endfor %}|{% endfor %}")
    text = render_chat(tokenizer, CONVERSATION, TOOLS)
    assert text.startswith("TOOL find;") and "CALL find;CALL find;" in text and "tool:3 events|" in text
    tokenizer.chat_template = ("{% if tools %}{{ raise_exception('tools are not for me') }}{% endif %}"
                               "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    text = render_chat(tokenizer, CONVERSATION, TOOLS)
    assert text.startswith("system:" + TOOLS_PREAMBLE) and "user:<tool_response>3 events</tool_response>" in text


def test_a_template_that_knows_tools_gets_call_arguments_as_objects(tokenizer):
    # as vLLM passes them: Qwen's template writes arguments with tojson, and a JSON string there is escaped
    tokenizer.chat_template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                               "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}{{ tools | length }}")
    assert render_chat(tokenizer, CONVERSATION, TOOLS) == '{"city": "Oslo"};{"city": "Bergen"};1'
    not_json = [{**CONVERSATION[1], "tool_calls": [{"id": "c3", "type": "function",
                                                    "function": {"name": "find", "arguments": "{city"}}]}]
    assert render_chat(tokenizer, not_json, TOOLS) == '"{city";1'  # not JSON: kept as the text it is

