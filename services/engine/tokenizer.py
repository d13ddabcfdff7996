"""Tokenizers: the Protocol the services use, a byte-level one for `tiny`, and a wrapper
around a `tokenizers.Tokenizer` (built from GGUF metadata or a tokenizer.json by
`checkpoint`). Imports without torch: the gateway uses it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizerCore

try:  # jinja2 is a dependency; without it, the documented fallback (ChatML) applies
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:  # pragma: no cover - only in an install without jinja2
    TemplateError = ImmutableSandboxedEnvironment = None  # type: ignore[assignment,misc]


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict],
                            tools: list[dict] | None = None) -> str: ...


def chatml(messages: list[dict]) -> str:
    """ChatML with the assistant turn opened (SmolLM2 and most instruct checkpoints)."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


class ByteTokenizer:
    """Byte-level tokenizer of the `tiny` model: ids 0..255 are bytes, 256 is BOS, 257 EOS.

    Chat template (plain text, so it round-trips through encode/decode):
        for each message: "<|{role}|>\\n{content}\\n", then "<|assistant|>\\n".
    """

    BOS = 256
    EOS = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.EOS})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict],
                            tools: list[dict] | None = None) -> str:
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"


class ChatTemplateError(ValueError):
    """The checkpoint's chat template refused the messages (answered as a 400)."""


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the eos ids and the chat template of its checkpoint.

    `chat_template` is the checkpoint's Jinja template; it is rendered with jinja2's
    sandbox when available, else ChatML is used.
    """

    def __init__(
        self,
        core: HFTokenizerCore,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        self.core = core
        self._eos = frozenset(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None  # compiled on first use

    @property
    def vocab_size(self) -> int:
        return self.core.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return self.core.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.core.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict],
                            tools: list[dict] | None = None) -> str:
        """Render the checkpoint's template (compiled once); ChatML when it has none.
        `tools` (OpenAI's tool objects) go to a template that renders them (`renders_tools`).

        A template that refuses the conversation (many raise on purpose, e.g. "roles must
        alternate") raises ChatTemplateError: serving a different prompt than the checkpoint
        expects would be a silent wrong answer.
        """
        template = self._compiled()
        if template is None:
            return chatml(messages)
        try:
            return template.render(messages=messages, add_generation_prompt=True,
                                   bos_token=self.bos_token, eos_token=self.eos_token,
                                   tools=tools)
        except Exception as exc:  # noqa: BLE001 - any refusal by the template is the client's
            raise ChatTemplateError(str(exc)) from None

    @property
    def renders_tools(self) -> bool:
        """The checkpoint's template renders a `tools` variable itself."""
        return "tools" in (self.chat_template or "")

    def _compiled(self):
        if not self.chat_template:
            return None
        if self._template is None:
            if ImmutableSandboxedEnvironment is None:
                return None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env.globals["raise_exception"] = raise_exception  # HF templates call this
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError:
                self.chat_template = None  # unusable template: ChatML, as documented
                return None
        return self._template
