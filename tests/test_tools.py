"""Tool calling: parsing calls out of text (any split of it), the conversation a chat
template gets, and the server through the official ``openai`` client."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import client, make_server

from specserve.tools import (CallParser, ChatReply, ChatTools, RequiredCallStream, calls_from_required,
                             required_schema)

WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
                                           "required": ["zone"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]

HERMES_TEXTS = [
    'Sure!\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
    '[{"name": "g", "arguments": {}}, {"name": "h", "arguments": "{\\"x\\": 2}"}]\n</tool_call>\n',
    "just text < tool <tool_ and <tool_call more\n\n",
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',      # stopped at </tool_call>: still a call
    '<tool_call>{"name": "f", "argu',                        # cut by max_tokens: content
    "hi <tool_call>not json</tool_call> bye",                # not a call: content, every character
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nand then text',
]


def _split_feed(parser: CallParser, text: str, cuts: list[int]):
    content, calls, at = "", [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        piece = parser.feed(text[at:cut])
        content, calls, at = content + piece.content, calls + piece.calls, cut
    last = parser.finish()
    return content + last.content, [(c.name, c.arguments) for c in calls + last.calls]


@pytest.mark.parametrize("text", HERMES_TEXTS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_hermes_parser_gives_the_same_whatever_the_split(text, data):
    """Streamed in any pieces (a speculative step emits several tokens at once), the
    parser gives what it gives for the whole text."""
    whole = _split_feed(CallParser("hermes"), text, [])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert _split_feed(CallParser("hermes"), text, cuts) == whole


def test_hermes_parser_reads_calls_and_keeps_everything_else():
    parse = lambda text: _split_feed(CallParser("hermes"), text, [])  # noqa: E731
    assert parse(HERMES_TEXTS[0]) == ("Sure!", [("f", '{"a": 1}'), ("g", "{}"), ("h", '{"x": 2}')])
    assert parse(HERMES_TEXTS[1]) == (HERMES_TEXTS[1], [])
    assert parse(HERMES_TEXTS[2]) == ("", [("f", '{"a": 1}')])
    assert parse(HERMES_TEXTS[3]) == (HERMES_TEXTS[3], [])
    assert parse(HERMES_TEXTS[4]) == (HERMES_TEXTS[4], [])
    assert parse(HERMES_TEXTS[5]) == ("and then text", [("f", "{}")])


def test_llama3_json_parser():
    parse = lambda text: _split_feed(CallParser("llama3_json"), text, [3, 9])  # noqa: E731
    assert parse('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}') == \
        ("", [("f", '{"x": "y"}'), ("g", "{}")])
    assert parse("Hello, {world}") == ("Hello, {world}", [])
    assert parse('  {"name": 1}') == ('  {"name": 1}', [])  # not a call: kept as written


def test_required_calls_stream_as_each_completes():
    text = '[{"name": "f", "arguments": {"a": "}{"}}, {"name": "g", "arguments": {}}]'
    stream, seen = RequiredCallStream(), []
    for i, ch in enumerate(text):
        seen += [(i, c.name) for c in stream.feed(ch)]
    assert seen == [(text.index("}}") + 1, "f"), (len(text) - 2, "g")]
    assert [c.name for c in calls_from_required(text)] == ["f", "g"]
    assert calls_from_required(text[:-1]) is None
    assert stream.rest() == ""
    cut = RequiredCallStream()
    assert [c.name for c in cut.feed(text[:-20])] == ["f"] and cut.rest() == text[text.index('{"name": "g"'):-20]
    message, finish = ChatReply("required").message(text[:-20], "length")
    assert message["content"] == cut.rest() and finish == "length" and len(message["tool_calls"]) == 1


def test_required_schema_admits_exactly_the_tools_calls():
    schema = required_schema([WEATHER, TIME], parallel=False)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "arguments": {"zone": "UTC"}}] * 2,
                [{"name": "get_weather", "arguments": {"zone": "UTC"}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_chat_reply_named_streams_the_arguments():
    reply = ChatReply("named", named="get_time")
    first = reply.feed('{"zone": ')
    second = reply.feed('"UTC"}', final=True)
    assert first[1][0]["function"] == {"name": "get_time", "arguments": '{"zone": '}
    assert first[1][0]["id"] and second == ("", [{"index": 0, "function": {"arguments": '"UTC"}'}}])
    message, finish = ChatReply("named", named="get_time").message('{"zone": "UTC"}', "stop")
    assert message["content"] is None and finish == "stop"
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    auto, finish = ChatReply("auto").message('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
    assert auto["content"] is None and finish == "tool_calls"


# ---------------------------------------------------------------------- the conversation a template gets
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
ROUND_TRIP = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
# A Qwen 2.5-style template: it writes tools, calls and results itself.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")


def _tokenizer(tiny_tokenizer, template):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    return tok


def test_a_template_without_tools_gets_them_written_as_hermes_text(tiny_tokenizer):
    from conftest import CHAT_TEMPLATE

    tools = ChatTools(_tokenizer(tiny_tokenizer, CHAT_TEMPLATE))
    assert tools.format == "hermes" and not tools.renders_tools and not tools.renders_calls
    messages, passed = tools.conversation(ROUND_TRIP, [WEATHER])
    assert passed is None and messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


def test_a_template_with_tools_gets_them_as_it_expects(tiny_tokenizer):
    tok = _tokenizer(tiny_tokenizer, QWEN_LIKE)
    tools = ChatTools(tok)
    assert tools.renders_tools and tools.renders_calls and tools.renders_results
    messages, passed = tools.conversation(ROUND_TRIP, [WEATHER])
    assert messages == ROUND_TRIP and passed == [{"type": "function", "function": WEATHER}]
    text = tok.apply_chat_template(messages, tools=passed, tokenize=False)
    assert '"get_weather"' in text and '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}' in text
    assert "<tool_response>12:00</tool_response>" in text
    llama = _tokenizer(tiny_tokenizer, "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
                                       "<|python_tag|>")
    assert ChatTools(llama).format == "llama3_json"
    with pytest.raises(ValueError, match="llama3_json"):
        ChatTools(_tokenizer(tiny_tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}"), "llama3_json")


# ---------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    # The tools' description in the prompt takes some 600 of the tiny tokenizer's tokens:
    # the tiny chat model, with room for 2048 positions.
    import shutil

    path = tmp_path_factory.mktemp("tiny-chat-2k")
    shutil.copytree(chat_model_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    srv, _ = make_server(path, speculative_method="ngram", num_speculative_tokens=3,
                         max_model_len=1024, num_kv_blocks=1024)
    with srv:
        yield srv


def _streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """Content, tool calls (assembled from their deltas as clients do) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_tool_calls_through_the_openai_client(server, tool_choice, parallel):
    """The calls follow the tools' schemas, streamed and not, greedy and sampled; the
    streamed deltas assemble into the same calls."""
    c = client(server)
    for temperature in (0, 0.8):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                  tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=120,
                  temperature=temperature, seed=3)
        whole = c.chat.completions.create(**kw)
        choice = whole.choices[0]
        assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop"), choice
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        if not parallel or tool_choice != "required":
            assert len(calls) == 1
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
            assert call.type == "function" and call.id.startswith("call_")
        if tool_choice != "required":
            assert calls[0].function.name == "get_weather"
        content, streamed, finish = _streamed_calls(c.chat.completions.create(**kw, stream=True))
        assert content == "" and finish == choice.finish_reason
        assert [(s["name"], s["arguments"]) for s in streamed] == \
            [(call.function.name, call.function.arguments) for call in calls]
        assert all(s["id"] for s in streamed)


def test_auto_tool_calls_are_parsed_from_the_output(server):
    """tool_choice auto: whatever the model writes in the Hermes form is a call (here a
    regex makes the tiny model write one), streamed and not; plain text stays content."""
    c = client(server)
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=80,
              temperature=0, extra_body={"structured_outputs": {"regex": regex}})
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
    content, streamed, finish = _streamed_calls(c.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(s["name"], s["arguments"]) for s in streamed] == [("get_weather", call.function.arguments)]
    plain = dict(kw, extra_body={"structured_outputs": {"regex": "[a-z]{5}"}})
    text = c.chat.completions.create(**plain).choices[0]
    assert text.message.tool_calls is None and len(text.message.content) == 5 and text.finish_reason == "stop"


def test_tools_reach_the_prompt_and_a_round_trip_goes_through_the_template(server):
    """The tools are in the prompt the model reads; a resent assistant tool call and the
    tool's answer are written into the next prompt (here as Hermes text: the tiny model's
    template writes neither)."""
    c = client(server)
    base = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], max_tokens=1)
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                                      tool_choice="required", max_tokens=120, temperature=0)
    assert first.usage.prompt_tokens > base.usage.prompt_tokens + 50
    messages = [{"role": "user", "content": "weather?"}, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "sunny, 21 C"}]
    second = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert rendered["count"] == second.usage.prompt_tokens
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    call = first.choices[0].message.tool_calls[0].function
    assert f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and "<tools>" in text


@pytest.mark.parametrize("body, param, fragment", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "name of its own"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {**TIME, "strict": True}}]}, "tools", "strict"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "give one"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, None, "give one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, None, "JSON schema"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "needs tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, None, "JSON object"),
])
def test_bad_tool_requests_are_400s(server, body, param, fragment):
    payload = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body}
    response = httpx.post(server.url + "/v1/chat/completions", json=payload)
    error = response.json()["error"]
    assert response.status_code == 400 and fragment in error["message"], response.text
    assert param is None or error["param"] == param, response.text


def test_openai_client_round_trip_types(server):
    """The official client's own types go back as they came (a ChatCompletionMessage with tool_calls)."""
    c = client(server)
    first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t"}], tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      max_tokens=40, temperature=0)
    message = first.choices[0].message
    follow = c.chat.completions.create(model="tiny", max_tokens=3, messages=[
        {"role": "user", "content": "t"}, message,
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "noon"}])
    assert follow.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t"}], tool_choice="auto")


@pytest.mark.slow
def test_default_model_calls_tools_with_required_and_named(default_model_path):
    """The embedded model, its tools written into its prompt (its template has none), with
    the built-in draft: tool_choice required and named give calls whose arguments follow
    the schemas, greedy and sampled. A sampled required reply may go on calling until its
    max_tokens (the grammar allows any number of calls, and a seeded sample follows the
    machine's rounding: seed 0 did on an AVX-512 CPU, not on an AVX2 one); its complete
    calls must still follow the schemas."""
    from specserve import LLM
    from specserve.prompts import chat_prompt_ids
    from specserve.sampling_params import SamplingParams
    from specserve.tools import named_schema

    llm = LLM(None, speculative_method="draft_model")
    chat = ChatTools(llm.tokenizer)
    questions = ["What's the weather in Rome for the next 3 days?", "What time is it in UTC?",
                 "Weather in Paris tomorrow, please."]
    for temperature in (0.0, 0.8):
        for mode, schema, named in (("required", required_schema([WEATHER, TIME]), None),
                                    ("named", named_schema(WEATHER), "get_weather")):
            prompts, params = [], []
            for i, question in enumerate(questions):
                messages, tools = chat.conversation([{"role": "user", "content": question}], [WEATHER, TIME])
                prompts.append(chat_prompt_ids(llm.tokenizer, messages, tools=tools))
                params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=150,
                                             structured_outputs={"json": schema}))
            for out in llm.generate(prompts, params, use_tqdm=False):
                message, finish = ChatReply(mode, named=named).message(out.text, out.finish_reason)
                cut = temperature > 0 and mode == "required" and finish == "length"
                assert cut or finish == ("tool_calls" if mode == "required" else "stop"), out.text
                assert cut or message["content"] is None, out.text
                for call in message["tool_calls"]:
                    tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
                    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])
    assert llm.engine.num_free_blocks == llm.engine.kv.num_blocks
    llm.close()
