"""Tokenizer, chat template and incremental detokenization with stop strings."""

from __future__ import annotations

import json
from pathlib import Path

from disagg.engine.config import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from disagg.errors import ConfigError, RequestError

REPLACEMENT_CHAR = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence
ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]


class Tokenizer:
    def __init__(self, engine_dir: str | Path) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer as HFTokenizer

        d = self.engine_dir = Path(engine_dir)
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if not (d / name).is_file():
                raise ConfigError(f"{d / name} not found: rebuild the engine")
        self._tok = HFTokenizer.from_file(str(d / TOKENIZER_FILE))
        cfg = json.loads((d / TOKENIZER_CONFIG_FILE).read_text())
        self.add_bos = bool(cfg.get("add_bos_token"))
        self.bos_token = cfg.get("bos_token")
        self.eos_token = cfg.get("eos_token")
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(cfg.get("pad_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template = cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template) if template else None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """What one token stands for, as bytes: a byte-level BPE token may hold part of a
        character, which decoding it alone would turn into U+FFFD (OpenAI's logprobs give
        both: the text and the bytes)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        try:
            return bytes(_BYTE_DECODER[c] for c in piece)
        except KeyError:  # not a byte-level vocabulary (or an added token outside it)
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True
    ) -> str:
        check_messages(messages)
        if self._template is None:
            raise ConfigError("this engine has no chat template; send plain text")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_prompt(
        self, text: str = "", messages_json: str = "", chat: bool = False
    ) -> list[int]:
        """A request's prompt: JSON chat messages if given, else the text (as a user turn with
        `chat`, raw otherwise, as TensorRT-LLM's preprocessing does)."""
        if messages_json:
            try:
                messages = json.loads(messages_json)
            except ValueError as e:
                raise RequestError(f"messages is not valid JSON: {e}") from e
            return self.encode_chat(messages)
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.encode(text)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        # The template writes any BOS itself; the text is encoded without adding another.
        return self._tok.encode(self.apply_chat_template(messages), add_special_tokens=False).ids


def eos_token_ids(engine_dir: str | Path) -> set[int]:
    """The engine's end-of-sequence token ids, without building the tokenizer (a third of a
    second a decode restart need not spend): its special tokens are listed in
    tokenizer.json's added_tokens. Falls back to the whole tokenizer for one that is not."""
    d = Path(engine_dir)
    try:
        eos = json.loads((d / TOKENIZER_CONFIG_FILE).read_text()).get("eos_token")
        added = json.loads((d / TOKENIZER_FILE).read_text()).get("added_tokens") or []
        found = [t.get("id") for t in added if isinstance(t, dict) and t.get("content") == eos]
    except (OSError, ValueError, AttributeError, TypeError):  # (not the usual JSON objects)
        found, eos = [], None  # (Tokenizer says what is wrong with the files)
    ids = {i for i in found if isinstance(i, int)}
    if isinstance(eos, str) and len(found) == 1 and len(ids) == 1:
        return ids
    return {t for t in (Tokenizer(d).eos_token_id,) if t is not None}


def check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}].content must be a string")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: every byte as one printable character (the printable
    Latin-1 ones as themselves, the rest from U+0100 on), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _bytes_to_unicode()


class TextStream:
    """Turns a token stream into text deltas that are always whole characters, and ends it
    at the first stop string (which is not returned).

    While stop strings are set, the last (longest stop - 1) characters are held back, since
    they may be the start of a stop string; `flush()` releases them when the sequence ends
    for another reason. Concatenated deltas equal `decode(all tokens)` cut at the stop."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # tokens before this are fully in `text`
        self._read = 0
        self.text = ""  # decoded so far (emitted + held back)
        self._emitted = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that became safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            return ""  # mid-character (or nothing visible yet): wait for more tokens
        checked = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            start = max(0, checked - self._hold)
            hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self._hold if self._stop else len(self.text)
        if safe <= self._emitted:
            return ""
        delta = self.text[self._emitted : safe]
        self._emitted = safe
        return delta

    def flush(self) -> str:
        """Release everything held back (call once the sequence has finished)."""
        if not self.stopped and self._read < len(self._ids):
            # trailing incomplete character at the very end: emit what the decoder makes of it
            self.text += self._tok.decode(self._ids[self._prefix :])[
                len(self._tok.decode(self._ids[self._prefix : self._read])) :
            ]
            self._prefix = self._read = len(self._ids)
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
