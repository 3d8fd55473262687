"""OpenAI-compatible request bodies (pydantic: they also make the server's OpenAPI schema) and the error body.

Bounds live on the fields, so a bad value is refused with HTTP 400 naming the field and the allowed range before
anything reaches the engine. Fields vLLM accepts beyond OpenAI's (`top_k`, `ignore_eos`, `stop_token_ids`) are
accepted too. Fields that would change what is generated and that this engine cannot honour (`logit_bias`,
`best_of`, `response_format`, tools, penalties, guided decoding...) are refused with 400 naming the field unless they
carry their no-op value, as vLLM refuses what it cannot do: a 200 with unconstrained output would be a silent lie.
Other unknown fields (`user`, `metadata`, `store`, ...) change nothing and are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from chunkpilot.engine.core.sampling_params import (MAX_CACHE_SALT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                                    MAX_STOP_TOKEN_IDS, SamplingParams, )

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _only(*no_ops: Any, what: str):
    """A field this engine cannot honour: accepted only at a value that changes nothing (None, or `no_ops`)."""

    def check(value: Any) -> Any:
        if value is None or any(value == v for v in no_ops):
            return value
        allowed = " or ".join(repr(v) for v in no_ops)
        raise ValueError(f"not supported by this engine ({what}); leave it out" + (f" or send {allowed}" if allowed
                                                                                 else ""))

    return AfterValidator(check)


def _unsupported(*no_ops: Any, what: str) -> Any:
    return Field(None, description=f"Not supported ({what}): refused unless absent" +
                 (" or " + " / ".join(repr(v) for v in no_ops) if no_ops else "") + ".")


_SAMPLING = "this engine samples with temperature, top_p, top_k and seed only"
_GUIDED = "no constrained decoding: the output would not follow it"
_TOOLS = "no tool calling"
_TEXT = "text is detokenized one way: without special tokens, stop strings cut"
_TEMPLATE = "the model's own chat template, applied as is"


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far, so a client can tell how many tokens a
    # chunk stands for (tokens without text, such as the bytes of one character, wait for the next chunk that has
    # text) and time each token, not each chunk
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="The served model name (see GET /v1/models).")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    n: Annotated[int, Field(ge=1, le=1, description="Only 1 is supported.")] = 1
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="The SLO class to serve the request in (docs/slo-classes.md); `auto` and `default`: the "
                          "deployment's default. Echoed in the response.")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = Field(
        None, description="As in vLLM: prompts with different salts never share prefix-cache blocks.")
    # What would change the output and cannot be honoured: refused (see the module docstring).
    logit_bias: Annotated[Any, _only({}, what=_SAMPLING)] = _unsupported({}, what=_SAMPLING)
    presence_penalty: Annotated[Any, _only(0, what=_SAMPLING)] = _unsupported(0, what=_SAMPLING)
    frequency_penalty: Annotated[Any, _only(0, what=_SAMPLING)] = _unsupported(0, what=_SAMPLING)
    repetition_penalty: Annotated[Any, _only(1, what=_SAMPLING)] = _unsupported(1, what=_SAMPLING)
    min_p: Annotated[Any, _only(0, what=_SAMPLING)] = _unsupported(0, what=_SAMPLING)
    min_tokens: Annotated[Any, _only(0, what="stopping is by max_tokens, stop and EOS")] = _unsupported(
        0, what="stopping is by max_tokens, stop and EOS")
    response_format: Annotated[Any, _only({"type": "text"}, what=_GUIDED)] = _unsupported({"type": "text"},
                                                                                         what=_GUIDED)
    guided_json: Annotated[Any, _only(what=_GUIDED)] = _unsupported(what=_GUIDED)
    guided_regex: Annotated[Any, _only(what=_GUIDED)] = _unsupported(what=_GUIDED)
    guided_choice: Annotated[Any, _only(what=_GUIDED)] = _unsupported(what=_GUIDED)
    guided_grammar: Annotated[Any, _only(what=_GUIDED)] = _unsupported(what=_GUIDED)
    structured_outputs: Annotated[Any, _only(what=_GUIDED)] = _unsupported(what=_GUIDED)
    # vLLM's own extras that change what comes back
    use_beam_search: Annotated[Any, _only(False, what=_SAMPLING)] = _unsupported(False, what=_SAMPLING)
    length_penalty: Annotated[Any, _only(1, what=_SAMPLING)] = _unsupported(1, what=_SAMPLING)
    allowed_token_ids: Annotated[Any, _only(what=_SAMPLING)] = _unsupported(what=_SAMPLING)
    bad_words: Annotated[Any, _only([], what=_SAMPLING)] = _unsupported([], what=_SAMPLING)
    logits_processors: Annotated[Any, _only(what=_SAMPLING)] = _unsupported(what=_SAMPLING)
    include_stop_str_in_output: Annotated[Any, _only(False, what=_TEXT)] = _unsupported(False, what=_TEXT)
    skip_special_tokens: Annotated[Any, _only(True, what=_TEXT)] = _unsupported(True, what=_TEXT)
    spaces_between_special_tokens: Annotated[Any, _only(True, what=_TEXT)] = _unsupported(True, what=_TEXT)
    return_tokens_as_token_ids: Annotated[Any, _only(False, what=_TEXT)] = _unsupported(False, what=_TEXT)
    truncate_prompt_tokens: Annotated[Any, _only(what="prompts are never truncated")] = _unsupported(
        what="prompts are never truncated")
    prompt_logprobs: Annotated[Any, _only(what="no prompt logprobs")] = _unsupported(what="no prompt logprobs")

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
        )


class CompletionRequest(_Common):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] = Field(
        ..., description="A string, a list of token ids, or a list holding one string."
    )
    max_tokens: Annotated[int, Field(ge=1)] = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    best_of: Annotated[Any, _only(1, what="one sequence is generated per request")] = _unsupported(
        1, what="one sequence is generated per request")
    suffix: Annotated[Any, _only("", what="no fill-in-the-middle")] = _unsupported("", what="no fill-in-the-middle")

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # an assistant turn's tool calls would be dropped from the prompt: refused, as tools are
    tool_calls: Annotated[Any, _only([], what=_TOOLS)] = _unsupported([], what=_TOOLS)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # no tool calling: tools the model is told of but the server never parses would come back as plain text
    tools: Annotated[Any, _only([], what=_TOOLS)] = _unsupported([], what=_TOOLS)
    tool_choice: Annotated[Any, _only("none", "auto", what=_TOOLS)] = _unsupported("none", "auto", what=_TOOLS)
    functions: Annotated[Any, _only([], what=_TOOLS)] = _unsupported([], what=_TOOLS)
    function_call: Annotated[Any, _only("none", "auto", what=_TOOLS)] = _unsupported("none", "auto", what=_TOOLS)
    prediction: Annotated[Any, _only(what="no predicted outputs")] = _unsupported(what="no predicted outputs")
    audio: Annotated[Any, _only(what="text only")] = _unsupported(what="text only")
    modalities: Annotated[Any, _only(["text"], what="text only")] = _unsupported(["text"], what="text only")
    web_search_options: Annotated[Any, _only(what=_TOOLS)] = _unsupported(what=_TOOLS)
    moderation: Annotated[Any, _only(what="no moderation")] = _unsupported(what="no moderation")
    verbosity: Annotated[Any, _only("medium", what="no verbosity control")] = _unsupported(
        "medium", what="no verbosity control")
    echo: Annotated[Any, _only(False, what=_TEMPLATE)] = _unsupported(False, what=_TEMPLATE)
    add_generation_prompt: Annotated[Any, _only(True, what=_TEMPLATE)] = _unsupported(True, what=_TEMPLATE)
    continue_final_message: Annotated[Any, _only(False, what=_TEMPLATE)] = _unsupported(False, what=_TEMPLATE)
    chat_template: Annotated[Any, _only(what=_TEMPLATE)] = _unsupported(what=_TEMPLATE)
    chat_template_kwargs: Annotated[Any, _only({}, what=_TEMPLATE)] = _unsupported({}, what=_TEMPLATE)
    documents: Annotated[Any, _only(what=_TEMPLATE)] = _unsupported(what=_TEMPLATE)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": content or ""})
        return out


def error_body(message: str, type_: str, *, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
