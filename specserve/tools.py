"""Tool calling for chat: the prompt a model sees its tools in, the grammar that makes it
call one, and the parsing of the calls out of its text, streamed or whole.

- ``ToolFormat`` is how a model family writes a call: ``hermes`` (Qwen 2.5/3, Hermes,
  SmolLM2: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or a list of
  calls inside each) or ``llama3_json`` (Llama 3.1–3.3: the whole answer is
  ``{"name": ..., "parameters": {...}}``, several separated by ``;``).
- ``ChatTools`` renders a conversation with tools through the model's chat template. A
  template that writes the tools (or a tool call, or a tool result) itself gets them as
  it expects; one that does not (the default model's) gets them written in the Hermes
  convention that Qwen's templates use: the tools in the system message, a call as
  ``<tool_call>`` text in the assistant's turn, a result as ``<tool_response>`` text in a
  user turn. Nothing is dropped: a template that ignores a part of the conversation
  never sees it raw.
- ``tool_choice`` ``"required"`` and a named tool are constrained by a JSON schema built
  from the tools (``required_schema``, ``named_schema``), as vLLM does: a list of
  ``{"name", "arguments"}`` calls, or the named tool's arguments alone.
- ``CallParser`` turns generated text into content and calls as it arrives: content is
  let out as soon as it cannot be the start of a call, and a call when it is complete.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: what may come before its calls
FORMATS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments as a JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


# ---------------------------------------------------------------------- schemas for required / named
def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The output of ``tool_choice: "required"``: a JSON list of one call (``parallel``:
    one or more), each ``{"name": <a tool's name>, "arguments": <its parameters>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1, **({} if parallel else {"maxItems": 1})}


def named_schema(tool: dict) -> dict:
    """The output of a named ``tool_choice``: that tool's arguments."""
    return _parameters(tool)


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``"required"`` output (None if it is not a whole list of calls: cut by
    ``max_tokens``)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    calls = [_call(item) for item in items] if isinstance(items, list) else [None]
    return calls if calls and all(calls) else None


def _call(item) -> ToolCall | None:
    """A call from its JSON: ``name`` and ``arguments`` (or Llama's ``parameters``)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # already a JSON text, as some models write it
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(item["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(item["name"], json.dumps(args, ensure_ascii=False))


# ---------------------------------------------------------------------- parsing generated text
@dataclass
class Parsed:
    """What a piece of generated text adds: content, and calls now complete."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class CallParser:
    """Content and tool calls out of a model's text, fed as it arrives (any split, a token
    or many at a time); ``feed`` then ``finish`` give what is known so far each time.

    Content is let out unless it could still begin a call; a call once its end is seen
    (at ``finish``, an unended last call counts if its JSON is whole). Text that looked
    like a call but does not parse as one is content after all: nothing is dropped.
    """

    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self._pending = ""      # text not yet given out
        self._in_call = False   # _pending is (the rest of) a call
        self._started = False   # llama3_json: some non-blank text has been seen
        self._after_call = False  # hermes: no content since the last call

    def feed(self, text: str) -> Parsed:
        self._pending += text
        return self._llama(final=False) if self.fmt == "llama3_json" else self._hermes(final=False)

    def finish(self) -> Parsed:
        return self._llama(final=True) if self.fmt == "llama3_json" else self._hermes(final=True)

    def _hermes(self, final: bool) -> Parsed:
        out = Parsed()
        while self._pending:
            if not self._in_call:
                start = self._pending.find(HERMES_OPEN)
                if start >= 0:  # the blank text right before a call is its layout (if it is one)
                    before = self._pending[:start].rstrip()
                    self._content(out, before)
                    self._pending, self._in_call = self._pending[len(before):], True
                    continue
                # Held back: what may begin a call, and blank text (it may come before one).
                cut = len(self._pending)
                if not final:
                    cut -= _prefix_overlap(self._pending, HERMES_OPEN)
                    cut = len(self._pending[:cut].rstrip())
                self._content(out, self._pending[:cut].rstrip() if final and self._after_call else self._pending[:cut])
                self._pending = self._pending[cut:]
                break
            start = self._pending.find(HERMES_OPEN)
            end = self._pending.find(HERMES_CLOSE)
            if end < 0 and not final:
                break
            whole = self._pending[:end + len(HERMES_CLOSE)] if end >= 0 else self._pending
            calls = _hermes_calls(whole[start + len(HERMES_OPEN):end if end >= 0 else None])
            if calls is None:  # not a call after all: the text (and the blank before it) is content
                self._content(out, whole)
            else:
                out.calls += calls
                self._after_call = True
            self._pending, self._in_call = self._pending[len(whole):], False
        return out

    def _content(self, out: Parsed, text: str) -> None:
        if self._after_call:  # the blank text right after a call is its layout
            text = text.lstrip()
            self._after_call = not text
        out.content += text

    def _llama(self, final: bool) -> Parsed:
        out = Parsed()
        if not self._started:
            stripped = self._pending.lstrip()
            if not final and PYTHON_TAG.startswith(stripped):  # blank, or maybe the tag: wait
                return out
            stripped = stripped.removeprefix(PYTHON_TAG).lstrip()
            if not stripped and not final:
                return out
            self._started, self._in_call = True, stripped.startswith("{")
        if not self._in_call:
            out.content, self._pending = self._pending, ""
            return out
        if final:
            calls = _llama_calls(self._pending)
            if calls is None:
                out.content = self._pending
            else:
                out.calls = calls
            self._pending = ""
        return out


def _prefix_overlap(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _hermes_calls(body: str) -> list[ToolCall] | None:
    """The calls inside one ``<tool_call>``: a JSON object, or a list of them (SmolLM2)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = [_call(v) for v in value] if isinstance(value, list) else [_call(value)]
    return calls if calls and all(calls) else None


def _llama_calls(text: str) -> list[ToolCall] | None:
    """Llama 3.x: one or more JSON objects, separated by ``;`` (after the optional
    ``<|python_tag|>``)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    while at < len(text):
        call, at = _decode_call(decoder, text, at)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(text) - len(rest) + (1 if rest else 0)
        while at < len(text) and text[at].isspace():
            at += 1
    return calls or None


def _decode_call(decoder: json.JSONDecoder, text: str, at: int) -> tuple[ToolCall | None, int]:
    """The call whose JSON starts at ``at``, and where it ends (None: not a whole call)."""
    try:
        value, end = decoder.raw_decode(text, at)
    except ValueError:
        return None, at
    return _call(value), end


class RequiredCallStream:
    """The calls of a ``"required"`` output (a JSON list, written by the grammar with ", "
    between items), each given out as soon as its object is complete."""

    def __init__(self) -> None:
        self._text, self._at = "", None  # _at: where the next item starts (None: before "[")
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[ToolCall]:
        self._text += text
        calls = []
        if self._at is None:
            start = self._text.find("[")
            if start < 0:
                return calls
            self._at = start + 1
        while True:
            while self._at < len(self._text) and self._text[self._at] in " ,\n":
                self._at += 1
            if self._at >= len(self._text) or self._text[self._at] != "{":
                return calls
            call, end = _decode_call(self._decoder, self._text, self._at)
            if call is None:
                return calls
            calls.append(call)
            self._at = end

    def rest(self) -> str:
        """The text no complete call took (output cut by ``max_tokens``), as written."""
        if self._at is None:
            return self._text
        rest = self._text[self._at:].lstrip(" ,\n")
        return "" if rest.strip() == "]" else rest


# ---------------------------------------------------------------------- the prompt
TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


class ChatTools:
    """How one tokenizer's chat template takes tools, tool calls and tool results (found
    once, by rendering probes), and the format its model calls tools in."""

    PROBE = "specserve_probe_fn"

    def __init__(self, tokenizer, fmt: str | None = None) -> None:
        template = tokenizer.chat_template or ""
        if fmt is None:
            fmt = "llama3_json" if PYTHON_TAG in template else "hermes"
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call parser {fmt!r}; known: {', '.join(FORMATS)}")
        self.format = fmt
        self.renders_tools = self._renders(tokenizer, [{"role": "user", "content": "x"}],
                                           tools=[_probe_tool(self.PROBE)])
        call = {"id": "call_1", "type": "function", "function": {"name": self.PROBE, "arguments": {"a": 1}}}
        self.renders_calls = self._renders(tokenizer, [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "", "tool_calls": [call]}])
        self.renders_results = self._renders(tokenizer, [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": self.PROBE}])
        if fmt == "llama3_json" and not self.renders_tools:
            raise ValueError("the llama3_json tool-call parser needs a chat template that writes the tools")

    def _renders(self, tokenizer, messages: list[dict], **kwargs) -> bool:
        """Whether the template writes the probe's name (False if it fails on the probe)."""
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:  # noqa: BLE001 - a template that cannot take this shape does not render it
            return False
        return self.PROBE in text

    def conversation(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) for the chat template: each part the template cannot write
        itself rewritten as Hermes text (see the module's docstring)."""
        functions = [{"type": "function", "function": t} for t in tools] if tools else None
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls") and not self.renders_calls:
                calls = "\n".join(f"{HERMES_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{HERMES_CLOSE}"
                                  for c in m["tool_calls"])
                m = {"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), calls]))}
            elif m["role"] == "tool" and not (self.renders_results and self.renders_calls):
                # (results after calls written as Hermes text are written the same way)
                response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
                if out and out[-1].get("_tool_results"):  # consecutive results share a user turn
                    out[-1]["content"] += "\n" + response
                    continue
                m = {"role": "user", "content": response, "_tool_results": True}
            out.append(m)
        out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
        if functions and not self.renders_tools:
            listed = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f, ensure_ascii=False) for f in functions))
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{listed}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": listed})
            functions = None
        return out, functions


def _call_json(call: dict) -> dict:
    function = call["function"]
    return {"name": function["name"], "arguments": function["arguments"]}


def _probe_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}



# ---------------------------------------------------------------------- a chat reply
class ChatReply:
    """One chat choice's text as OpenAI's reply: content and ``tool_calls``, per
    ``tool_choice`` (``"none"``, ``"auto"``, ``"required"``, or ``"named"`` with the
    tool's name). ``feed`` takes the text as it comes and gives a streamed delta's parts; a whole
    reply is the same text fed at once, so the two always agree."""

    def __init__(self, tool_choice: str = "none", fmt: str = "hermes", named: str | None = None) -> None:
        if (tool_choice == "named") != (named is not None):
            raise ValueError("a named tool_choice, and only it, names its tool")
        self.tool_choice, self.named = tool_choice, named
        self._parser = CallParser(fmt) if tool_choice == "auto" else None
        self._required = RequiredCallStream() if tool_choice == "required" else None
        self.calls: list[ToolCall] = []
        self.content = ""
        self._named_sent = False
        if named is not None:
            self.calls.append(ToolCall(named, ""))

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, tool-call deltas in OpenAI's streamed shape) that ``text`` adds;
        ``final``: the output ended with it."""
        if self.named is not None:  # the output is the arguments: they stream as they come
            call = self.calls[0] = ToolCall(self.calls[0].name, self.calls[0].arguments + text, self.calls[0].id)
            if not self._named_sent:
                self._named_sent = True
                return "", [{**call.as_dict(0), "function": {"name": call.name, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if self._required is not None:  # at the end, what no call took (cut short) is content
            calls = self._more(self._required.feed(text))
            content = self._required.rest() if final else ""
            self.content += content
            return content, calls
        if self._parser is None:
            self.content += text
            return text, []
        parsed = self._parser.feed(text)
        if final:
            last = self._parser.finish()
            parsed = Parsed(parsed.content + last.content, parsed.calls + last.calls)
        self.content += parsed.content
        return parsed.content, self._more(parsed.calls)

    def _more(self, calls: list[ToolCall]) -> list[dict]:
        first = len(self.calls)
        self.calls += calls
        return [call.as_dict(first + i) for i, call in enumerate(calls)]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: ``"tool_calls"`` when the model chose to call tools and its output
        ended by itself (a named tool is called by the request, and ends with ``"stop"``)."""
        if reason == "stop" and self.calls and self.named is None:
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the whole reply's ``message``, its ``finish_reason``) from its whole text."""
        self.feed(text, final=True)
        message = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [call.as_dict() for call in self.calls]
        return message, self.finish_reason(reason)
