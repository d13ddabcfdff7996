"""Checkpoint chat templates: rendered when they can be, refused loudly when they refuse."""

from __future__ import annotations

import pytest

from pdmesh.services.engine.tokenizer import ChatTemplateError, HFTokenizer, chatml

STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}"
          "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
          "[assistant]{% endif %}")


def tok(template: str | None) -> HFTokenizer:
    return HFTokenizer(core=None, eos_token_ids=[0], chat_template=template)  # type: ignore[arg-type]


def test_checkpoint_template_is_rendered() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert tok(STRICT).apply_chat_template(msgs) == "[user]hi[assistant]"


def test_a_refusing_template_raises_instead_of_serving_another_prompt() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        tok(STRICT).apply_chat_template(msgs)


def test_no_template_or_a_broken_one_falls_back_to_chatml() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert tok(None).apply_chat_template(msgs) == chatml(msgs)
    assert tok("{% if %}").apply_chat_template(msgs) == chatml(msgs)
