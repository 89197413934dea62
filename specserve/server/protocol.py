"""OpenAI-compatible request bodies (pydantic), and how they become SamplingParams.

Unknown fields are ignored, as OpenAI's server does; fields we cannot honour (``n`` > 1,
logprobs, penalties) are refused with a 400 rather than silently dropped.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """specserve extension: per-request speculation control."""

    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: int | None = Field(
        None, description="most draft tokens per step for this request; 0 turns speculation off")


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions, named as vLLM names them.
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None

    def unsupported(self) -> str | None:
        """Why this request asks for something we do not do, or None."""
        if self.n != 1:
            return "n must be 1: one completion per prompt is supported"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        if getattr(self, "logprobs", None) or getattr(self, "top_logprobs", None):
            return "logprobs are not supported"
        if getattr(self, "echo", False):
            return "echo is not supported"
        if getattr(self, "suffix", None):
            return "suffix is not supported"
        if getattr(self, "best_of", None) not in (None, 1):
            return "best_of must be 1: one completion per prompt is supported"
        return None

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """ValueError (a 400) when a value is out of range."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=_first(self._max_tokens(), default_max_tokens), stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else None)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16          # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One prompt (text or token ids) per choice."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

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
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools are not supported"
        return super().unsupported()

    def _max_tokens(self) -> int | None:
        return _first(self.max_completion_tokens, self.max_tokens)

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def _first(*values):
    """The first value that is not None (0 is a value: it is refused, not defaulted)."""
    return next((v for v in values if v is not None), None)
