"""Prompt encoding (chat template), stop strings and incremental detokenisation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from ..errors import SelfspecError


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int] | Sequence[dict], chat: bool,
                  vocab_size: int) -> list[int]:
    """Token ids for a prompt. A list of ids is used as is (never templated).

    With ``chat`` and a tokenizer that has a chat template, a text prompt becomes one user turn
    followed by the assistant generation prompt; a list of ``{"role", "content"}`` messages is
    templated as a conversation.
    """
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise SelfspecError("a conversation prompt needs a tokenizer with a chat template")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise SelfspecError("the prompt is empty; pass some text (or token ids)")
        if tokenizer is None:
            raise SelfspecError("this model has no tokenizer; pass the prompt as a list of token ids")
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids = [int(i) for i in ids]
    else:
        try:
            ids = [int(i) for i in cast(Sequence[int], prompt)]  # a conversation returned above
        except (TypeError, ValueError) as e:
            raise SelfspecError("the prompt must be a string or a list of integer token ids") from e
        if not ids:
            raise SelfspecError("the prompt is empty; pass some text (or token ids)")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise SelfspecError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}); check the prompt ids")
    if not ids:
        raise SelfspecError("the prompt encodes to zero tokens; pass some text")
    return ids


def make_stop_check(tokenizer: Any, stops: Sequence[str]) -> Callable[[list[int]], int | None] | None:
    """A function of the generated ids (one request's, growing) returning how many to keep when a
    stop string appeared (the tokens up to and including the one that completes it), else None.

    O(n) over a request: each call decodes only a window of the latest tokens, wide enough to
    hold any stop string (a character spans at most 4 byte-level tokens, a token at least one
    character otherwise), after the tokens already found to complete none."""
    if not stops:
        return None
    if tokenizer is None:
        raise SelfspecError("stop strings need a tokenizer; this model has none")
    reach = 4 * max(len(s) for s in stops) + 4  # tokens a stop string can span, at most
    clear = [0]  # leading tokens known to complete no stop string (this request's)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    def check(generated: list[int]) -> int | None:
        if clear[0] > len(generated):  # a new request reusing the check: start over
            clear[0] = 0
        start = max(0, clear[0] - reach)
        if not any(s in decode(generated[start:]) for s in stops):
            clear[0] = len(generated)
            return None
        for t in range(max(clear[0], start) + 1, len(generated) + 1):
            if any(s in decode(generated[start:t]) for s in stops):
                return t
        return len(generated)

    return check


class IncrementalDetokenizer:
    """Turns a growing list of ids into text pieces; holds back incomplete UTF-8 characters.

    O(n) over a request: each push decodes only the ids from ``prefix`` on (a few tokens before
    the ones not yet shown, so that a tokenizer's leading-space rule for the window's first token
    cancels out between the two decodes) rather than the whole text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the decode window starts here
        self.read = 0  # ids before this are shown

    def _after_shown(self, start: int) -> str | None:
        """The text of ``ids[start:]`` past what ``ids[start:read]`` decodes to; None where the
        window decodes otherwise than its start (then the whole text is decoded once)."""
        shown = self.tokenizer.decode(self.ids[start:self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[start:], skip_special_tokens=True)
        return text[len(shown):] if text.startswith(shown) else None

    def push(self, new: list[int]) -> str:
        self.ids.extend(new)
        piece = self._after_shown(self.prefix)
        if piece is None:
            piece = self._after_shown(0) or ""
        if not piece or piece.endswith("\ufffd"):  # nothing new, or an incomplete character: held back
            return ""
        self.prefix, self.read = max(self.prefix, self.read - 4), len(self.ids)
        return piece


def text_before_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` cut before the earliest occurrence of any stop string (unchanged if none)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class StopTextFilter:
    """Streams text without the stop string: holds back any tail that could be the start of a
    stop string, and drops the stop string (and anything after it) once it appears.

    ``push`` takes the next text piece and returns what may be shown now; ``flush`` returns the
    held-back rest at the end (nothing of it past a stop string when ``stopped``).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.ended = False

    def push(self, piece: str) -> str:
        if not self.stops:
            return piece
        if self.ended:
            return ""
        self.held += piece
        cut = text_before_stop(self.held, self.stops)
        if len(cut) < len(self.held):  # a stop string is complete: nothing after it is shown
            self.ended, self.held = True, ""
            return cut
        keep = 0  # the longest tail of held that is a proper prefix of a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:n]):
                    keep = n
                    break
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def flush(self, stopped: bool) -> str:
        """The held-back text at the end of generation."""
        rest, self.held = self.held, ""
        if self.ended:
            return ""
        return text_before_stop(rest, self.stops) if stopped else rest
