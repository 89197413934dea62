"""OpenAI-compatible request bodies (pydantic), and how they become SamplingParams.

Every field of a request is honoured or refused, never ignored. The models declare each
field OpenAI's request types have (``openai.types``), plus vLLM's extensions this server
implements; any other field is refused with a 400 that names it (``extra="forbid"``). A
declared field the engine cannot honour yet is refused by name when it asks for anything
(``REFUSED``): ``n`` = 1 or ``function_call: "none"`` ask for nothing and pass. A few of OpenAI's
fields are advisory by definition (``ADVISORY``: an end user's id, a cache-routing key):
they never change an output, and are accepted.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import SamplingParams
from specserve.structured import StructuredOutputs
from specserve.tools import named_schema, required_schema

MAX_N = 64  # choices per prompt

# Fields that never change what a request returns by their definition (OpenAI's docs):
# identifiers for abuse monitoring and a hint for routing requests to a cache. Accepted.
ADVISORY = frozenset({"user", "safety_identifier", "prompt_cache_key"})


def _set(value) -> bool:
    """A field asks for something unless it is absent, null, false or empty."""
    return value is not None and value is not False and value != [] and value != {} and value != ""


def _given(value) -> bool:
    """A field whose mere presence asks for something (``{}`` included: its defaults)."""
    return value is not None


def _refusals(*rules: tuple[str, Callable[[Any], bool], str]) -> dict[str, tuple[Callable[[Any], bool], str]]:
    return {name: (asks, why) for name, asks, why in rules}


# field -> (does this value ask for something we do not do?, why it is refused)
REFUSED = _refusals(
    ("n", lambda v: v is not None and not 1 <= v <= MAX_N, f"n must be between 1 and {MAX_N}"),
    ("suffix", _set, "suffix is not supported"),
    ("functions", _set, "functions are not supported: use tools (functions is their deprecated form)"),
    ("function_call", lambda v: v not in (None, "none"),
     "function_call is not supported: use tool_choice (function_call is its deprecated form)"),
    ("audio", _given, "audio output is not supported"),
    ("modalities", lambda v: v not in (None, ["text"]), "modalities: only [\"text\"] is supported"),
    ("prediction", _given, "prediction (predicted outputs) is not supported"),
    ("reasoning_effort", _set, "reasoning_effort is not supported: the model does not reason in a separate channel"),
    ("verbosity", _set, "verbosity is not supported"),
    ("web_search_options", _given, "web search is not supported"),
    ("store", _set, "store: this server stores no completions"),
    ("metadata", _set, "metadata is kept with stored completions; this server stores none"),
    ("moderation", _given, "moderation is not supported"),
    ("service_tier", lambda v: v not in (None, "auto", "default"), "service_tier: this server has one tier"),
    ("prompt_cache_retention", lambda v: v not in (None, "in_memory"),
     "prompt_cache_retention: the prefix cache lives in memory only"),
    ("prompt_cache_options", _given, "prompt_cache_options are not supported"),
    # vLLM's extensions this server does not do yet.
    ("priority", _set, "priority is not supported: requests are served in arrival order"),
)


class _Strict(BaseModel):
    # Unknown fields are refused by name (the server's validation handler says so).
    # Strict types, as OpenAI's API is: "16" is not a number, 1.0 not an integer, true not 1.
    model_config = ConfigDict(extra="forbid", strict=True)

    def refused(self) -> tuple[str, str] | None:
        """The field that asks for something this server does not do, and why; or None."""
        return None


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.include_obfuscation:
            return "stream_options.include_obfuscation", "stream_options.include_obfuscation is not supported"
        return None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class JSONSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SpeculativeOptions(_Strict):
    """specserve extension: per-request speculation control."""

    num_speculative_tokens: int | None = Field(
        None, description="most draft tokens per step for this request; 0 turns speculation off")


class _SamplingRequest(_Strict):
    # Honoured (null, as some clients send it, means the default).
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None     # 1.0
    top_p: float | None = None           # 1.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1                    # choices per prompt (at most MAX_N)
    presence_penalty: float | None = None   # 0.0
    frequency_penalty: float | None = None  # 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    # Advisory (ADVISORY).
    user: str | None = None
    # Extensions, named as vLLM names them (null: the default): honoured ...
    top_k: int | None = None             # -1: off
    min_p: float | None = None           # 0.0
    ignore_eos: bool | None = None       # False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None  # True
    speculative: SpeculativeOptions | None = None
    repetition_penalty: float | None = None  # 1.0
    min_tokens: int | None = None            # 0
    bad_words: str | list[str] | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None    # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # ... and refused (REFUSED).
    priority: Any = None

    def refused(self) -> tuple[str, str] | None:
        """The first field that asks for something this server does not do (``REFUSED``)."""
        for name in type(self).model_fields:
            rule = REFUSED.get(name)
            if rule is not None and rule[0](getattr(self, name)):
                return name, rule[1]
        if self.stream_options is not None:
            if not self.stream:
                return "stream_options", "stream_options is only allowed when stream is true"
            return self.stream_options.refused()
        return None

    @property
    def num_choices(self) -> int:
        return _first(self.n, 1)

    def sampling_params(self, default_max_tokens: int | None, choice: int = 0) -> SamplingParams:
        """The ``choice``-th choice's settings (a seed becomes seed + choice, so that each
        choice has its own random stream). ValueError (a 400) when a value is out of range."""
        return SamplingParams(
            temperature=_first(self.temperature, 1.0), top_p=_first(self.top_p, 1.0),
            top_k=_first(self.top_k, -1), min_p=_first(self.min_p, 0.0),
            seed=None if self.seed is None else self.seed + choice,
            max_tokens=_first(self._max_tokens(), default_max_tokens), stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=_first(self.ignore_eos, False),
            skip_special_tokens=_first(self.skip_special_tokens, True),
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else None,
            presence_penalty=_first(self.presence_penalty, 0.0), frequency_penalty=_first(self.frequency_penalty, 0.0),
            repetition_penalty=_first(self.repetition_penalty, 1.0), logit_bias=_token_biases(self.logit_bias),
            min_tokens=_first(self.min_tokens, 0), bad_words=self.bad_words or [],
            logprobs=self._logprobs(), prompt_logprobs=self._prompt_logprobs(),
            structured_outputs=self.structured())

    def structured(self) -> StructuredOutputs | None:
        """What output structure the request asks for, from whichever field names it (one
        at most: ValueError, a 400, for two)."""
        asked = {name: spec for name, spec in self._structured_fields().items() if spec is not None}
        if len(asked) > 1:
            raise ValueError(f"{' and '.join(asked)} both ask for structured output; give one")
        return next(iter(asked.values()), None)

    def _structured_fields(self) -> dict[str, StructuredOutputs | None]:
        s = self.structured_outputs
        return {
            "structured_outputs": None if s is None else StructuredOutputs(
                json=s.json_, json_object=bool(s.json_object), regex=s.regex,
                choice=tuple(s.choice) if s.choice is not None else None, grammar=s.grammar),
            "guided_json": None if self.guided_json is None else StructuredOutputs(json=self.guided_json),
            "guided_regex": None if self.guided_regex is None else StructuredOutputs(regex=self.guided_regex),
            "guided_choice": None if self.guided_choice is None else StructuredOutputs(choice=self.guided_choice),
            "guided_grammar": None if self.guided_grammar is None else StructuredOutputs(grammar=self.guided_grammar),
        }

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16          # OpenAI's default for completions (null too)
    echo: bool | None = False            # the prompt before each choice's text (and its logprobs)
    logprobs: int | None = None          # per token: its log-probability and the N likeliest
    suffix: str | None = None
    best_of: int | None = None           # choices generated per prompt; the n best are returned
    prompt_logprobs: int | None = None   # vLLM's: the prompt tokens' log-probabilities

    def refused(self) -> tuple[str, str] | None:
        why = super().refused()
        if why is not None:
            return why
        best_of = self.num_generated
        if not 1 <= best_of <= MAX_N:
            return "best_of", f"best_of must be between 1 and {MAX_N}"
        if best_of < self.num_choices:
            return "best_of", "best_of must be at least n"
        if best_of > self.num_choices and self.stream:
            return "best_of", "best_of greater than n cannot be streamed: the best are known only at the end"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 asks for nothing unless echo is true (scoring a prompt)"
        return None

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt: ``best_of``, else ``n``."""
        return _first(self.best_of, self.num_choices)

    @property
    def scores_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the prompt (and its log-probabilities) alone."""
        return self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        # max_tokens 0 (echo): one token is generated and not returned.
        return _first(self.max_tokens, 16) or 1

    def _logprobs(self) -> int | None:
        # best_of ranks choices by their tokens' log-probabilities: computed, and returned if asked.
        if self.logprobs is None and self.num_generated > self.num_choices:
            return 0
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per choice."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None   # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self) -> dict:
        """The function as chat templates and schemas read it (no nulls)."""
        return self.function.model_dump(exclude_none=True)


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # a JSON text, as OpenAI returns it


class MessageToolCall(_Strict):
    """A tool call an assistant message carries back (a response's, resent)."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None  # given to the chat template (which may or may not use it)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls ...
    tool_call_id: str | None = None                  # ... and a tool message's answer to one
    # What an assistant message of a response carries back when a client resends it: null
    # passes; a function call, audio, a refusal or annotations are refused.
    refusal: str | None = None
    function_call: Any = None
    audio: Any = None
    annotations: Any = None

    def problem(self) -> str | None:
        for field in ("function_call", "audio", "refusal", "annotations"):
            if _set(getattr(self, field)):
                return f"{field} in a message is not supported (function_call, audio, refusals and annotations are not)"
        if self.tool_calls and self.role != "assistant":
            return "tool_calls: only an assistant message calls tools"
        if self.role == "tool" and not self.tool_call_id:
            return "a tool message needs the tool_call_id of the call it answers"
        if self.tool_call_id is not None and self.role != "tool":
            return "tool_call_id: only a tool message answers a tool call"
        return None

    def as_dict(self) -> dict:
        """The message as the chat template reads it (a call's arguments as an object,
        as templates expect them; ValueError if they are not JSON)."""
        message = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content parts must be text; got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False         # each output token's log-probability ...
    top_logprobs: int | None = None       # ... and the N likeliest tokens' at its place
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # True
    # OpenAI's chat fields this server refuses unless they ask for nothing (REFUSED), or
    # takes as advisory (ADVISORY).
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    moderation: Any = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    prompt_logprobs: Any = None  # vLLM's; here on /v1/completions only (REFUSED below)

    def refused(self) -> tuple[str, str] | None:
        for i, message in enumerate(self.messages):
            why = message.problem()
            if why:
                return f"messages.{i}", why
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs to be true"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs", "prompt_logprobs are returned by /v1/completions (echo or prompt_logprobs)"
        return self._tools_refused() or super().refused()

    def _tools_refused(self) -> tuple[str, str] | None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            return "tools", "tools: each tool needs a name of its own"
        if self.tool_choice not in (None, "none") and not names:
            return "tool_choice", "tool_choice needs tools to choose from"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            return "tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools"
        if self.parallel_tool_calls is not None and not names:
            return "parallel_tool_calls", "parallel_tool_calls needs tools"
        if self.tool_mode == "auto":
            if any(t.function.strict for t in self.tools):
                # Free text may or may not call a tool: no grammar holds the arguments to the schema.
                return "tools", ("a strict function is held to its schema with tool_choice \"required\" or a "
                                 "named tool; with tool_choice \"auto\" give strict false or leave it out")
            if self.response_format is not None and self.response_format.type != "text":
                return "response_format", "response_format and tool_choice \"auto\": give one"
        return None

    @property
    def tool_mode(self) -> str:
        """``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (OpenAI's default: auto
        with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def tool_list(self) -> list[dict] | None:
        return _tool_dicts(self.tools)

    def _max_tokens(self) -> int | None:
        return _first(self.max_completion_tokens, self.max_tokens)

    def _logprobs(self) -> int | None:
        return _first(self.top_logprobs, 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def _structured_fields(self) -> dict[str, StructuredOutputs | None]:
        fields = super()._structured_fields()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            fields["response_format"] = None
        elif fmt.type == "json_object":
            fields["response_format"] = StructuredOutputs(json_object=True)
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema: a json_schema response format needs a schema")
            fields["response_format"] = StructuredOutputs(json=fmt.json_schema.schema_)
        tools = {t.function.name: t.as_dict() for t in self.tools or ()}
        if self.tool_mode == "required":
            schema = required_schema(list(tools.values()), self.parallel_tool_calls is not False)
            fields["tool_choice"] = StructuredOutputs(json=schema)
        elif self.tool_mode == "named":
            fields["tool_choice"] = StructuredOutputs(json=named_schema(tools[self.tool_choice.function.name]))
        return fields


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a text prompt, or a chat through the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True       # a text prompt: the tokenizer's BOS and the like
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True    # a chat: ready for the assistant's turn
    tools: list[ToolDefinition] | None = None  # a chat: the tools, as the template writes them
    return_token_strs: bool = False

    def tool_list(self) -> list[dict] | None:
        return _tool_dicts(self.tools)

    def refused(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give exactly one of prompt and messages"
        if self.tools and self.messages is None:
            return "tools", "tools go with messages (a chat), not a text prompt"
        for i, message in enumerate(self.messages or ()):
            why = message.problem()
            if why:
                return f"messages.{i}", why
        return None


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int]


def _token_biases(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON's string keys) as SamplingParams takes it."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    return out


def _tool_dicts(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The tools' functions as the chat template and the schemas read them."""
    return [t.as_dict() for t in tools] if tools else None


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"a tool call's arguments must be a JSON object, got {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"a tool call's arguments must be a JSON object, got {text[:80]!r}")
    return value


def _first(*values):
    """The first value that is not None (0 is a value: it is refused, not defaulted)."""
    return next((v for v in values if v is not None), None)
