"""The errors a request is refused with: one type per kind, each naming the request field it is about.

    InvalidRequest(ValueError)          a field's value the engine does not take (`param`: the field)
      InvalidType(TypeError)            ... a field of the wrong type (a TypeError too)
      ContextLengthExceeded             the prompt, or the prompt and max_tokens, past what one request can hold
                                        (max_model_len, or the KV pool); code `context_length_exceeded`
      UnsupportedFeature                something this model or engine does not do (images to a text model, stop
                                        strings without a tokenizer, LoRA without a lora_config)
      InvalidConstraint                 an output constraint the grammar library does not compile (`kind`: which,
                                        `reason`: the library's error); code `invalid_constraint`
    EngineUnavailable(RuntimeError)     not a request's fault: the engine serves nothing any more (a lost host)

`param` names the request's field as the engine takes it: a `SamplingParams` field ("max_tokens", "stop_token_ids",
"structured", ...), "prompt", "images", "lora_request", "request_id", "cache_salt" or "sampling_params". `code` is a
short machine string for a distinct kind, None for a plain bad value (the field says what). The messages are the
engine's own (`str(e)`): callers map the type, `param` and `code`, never the text (the server's 400s:
`pagedjax.serve.serving`). Each is a ValueError (InvalidType also a TypeError), so code catching those still does.

Plain Python, nothing of pagedjax: the bottom of the import layers, as `pagedjax.config.fields`.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request refused for the field `param` (see the module docstring); `code` None unless a kind's."""

    code: str | None = None

    def __init__(self, message: str, *, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code

    def for_request(self, request_id: str) -> InvalidRequest:
        """The same error (type, param, code), its message naming the request: "request '<id>': <message>"."""
        return _restore(type(self), (f"request {request_id!r}: {self}",), self.__dict__)

    def __reduce__(self):  # pickles and copies with its keyword-only fields
        return _restore, (type(self), self.args, self.__dict__)


def _restore(cls: type[InvalidRequest], args: tuple, state: dict) -> InvalidRequest:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidType(InvalidRequest, TypeError):
    """A request field of the wrong type (a TypeError too: no value of it is coerced)."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt (param "prompt"), or the prompt and max_tokens (param "max_tokens"), past what one request can
    hold: max_model_len, or the whole KV pool."""

    code = "context_length_exceeded"


class UnsupportedFeature(InvalidRequest):
    """A request for something this model or engine does not do; `code` says what (e.g. `images_not_supported`)."""

    code = "unsupported_feature"


class InvalidConstraint(InvalidRequest):
    """An output constraint (`SamplingParams.structured`) the grammar library refuses: `kind` is the constraint's
    kind ("json", "regex", "choice", "grammar", ...), `reason` the library's error."""

    code = "invalid_constraint"

    def __init__(self, message: str, *, kind: str, reason: str):
        super().__init__(message, param="structured")
        self.kind = kind
        self.reason = reason


class EngineUnavailable(RuntimeError):
    """Not a request's fault: the engine can serve nothing any more (e.g. a host of a multi-host engine was lost,
    `pagedjax.engine.multihost`); every later call raises it too. A front end fails its requests and stops."""
