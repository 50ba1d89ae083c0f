"""Errors raised by the renderer."""

from __future__ import annotations


class RenderError(ValueError):
    """The messages cannot be rendered: the official template would raise, or validation failed.

    `index` is the message index the problem is at (None when it concerns the whole list) and
    `field` the offending field, e.g. ``"content"`` or ``"tool_calls[0].function.name"``.
    """

    def __init__(
        self,
        reason: str,
        *,
        index: int | None = None,
        field: str | None = None,
        where: str | None = None,
    ) -> None:
        self.reason = reason
        self.index = index
        self.field = field
        if where is None:
            where = "messages" if index is None else f"message {index}"
        if field:
            where = f"{where}, field {field!r}"
        super().__init__(f"{where}: {reason}")


class PromptTooLong(RenderError):
    """The system block plus the current exchange alone exceed the token budget."""

    def __init__(
        self,
        *,
        needed: int,
        max_tokens: int,
        system_tokens: int,
        current_tokens: int,
        generation_tokens: int,
    ) -> None:
        self.needed = needed
        self.max_tokens = max_tokens
        self.system_tokens = system_tokens
        self.current_tokens = current_tokens
        self.generation_tokens = generation_tokens
        super().__init__(
            f"the prompt needs {needed} tokens without any history (system block {system_tokens}, "
            f"current exchange {current_tokens}, generation prompt {generation_tokens}) but the "
            f"token budget is {max_tokens}; shorten the system prompt or the current message",
            where="prompt",
        )
