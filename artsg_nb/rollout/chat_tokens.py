"""Chat tokenisation of rollouts: the prompt's ids, and the ids appended after a model turn.

What it does: `render_ids` / `chat_text` apply the tokenizer's chat template; `env_suffix_ids` gives
the tokens that follow a model reply (its turn ending, the env's messages, the generation prompt)
without re-tokenising what the model generated, so a multi-turn history stays token-exact.

What it does not do: send requests or keep episodes (groups.py).
"""
from __future__ import annotations

from .trajectory import RolloutError

_SENTINEL = "\u2063artsg-sentinel\u2063"  # stands in for a reply to find the template's turn ending


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def turn_end_text(tokenizer, messages: list[dict]) -> str:
    """What the template writes after an assistant reply (ChatML: "<|im_end|>\\n")."""
    text = chat_text(tokenizer, messages + [{"role": "assistant", "content": _SENTINEL}], False)
    if _SENTINEL not in text:
        raise RolloutError("the chat template dropped the assistant content; cannot find where an "
                           "assistant turn ends")
    return text[text.rindex(_SENTINEL) + len(_SENTINEL):]


def env_suffix_ids(tokenizer, history_ids: list[int], messages: list[dict],
                   new_messages: list[dict], reply_ids: list[int] | None = None) -> tuple[list[int], bool]:
    """Tokens to append after a model turn: the turn's closing tokens, `new_messages`, the
    generation prompt. Returns (ids, used_fallback).

    `history_ids` are the tokens so far, ending with the model's reply; `messages` the
    conversation so far, ending with that reply as an assistant message.

    1. The turn-closing token (eos, "<|im_end|>") is added when the server's output lacks it.
    2. Preferred: render the whole conversation (+ new messages + generation prompt) and take
       the tokens after `history_ids` — valid when `history_ids` is a token prefix of that
       rendering. A sampled reply is often not the canonical tokenisation of its own text
       (or its text was cut mid-character), so the prefix often does not match. Then:
    3. Fallback: tokenise, as text, only what the template adds after the reply (the rest of
       the turn ending, the new messages, the generation prompt) and append it. With ChatML
       every such piece starts after a special token, so no BPE merge crosses the boundary.
    Step 2 tokenises the whole history (O(history) per turn: ~4 ms at 1.5k tokens, ~25 ms at
    6k on one core); given the model's `reply_ids`, it is skipped when they are not the reply
    text's own tokenisation: the prefix then (nearly) never matches, and the fallback is valid.
    """
    closing = turn_end_text(tokenizer, messages[:-1])
    end_ids = tokenizer.encode(closing, add_special_tokens=False)
    eos = end_ids[:1]  # the turn ending's first token: the end-of-turn token in ChatML-like templates
    known = list(history_ids)
    added: list[int] = []
    if eos and known[-len(eos):] != eos:
        added, known = list(eos), known + eos
    if reply_ids is None or _canonical(tokenizer, messages[-1]["content"], reply_ids, eos):
        full = render_ids(tokenizer, messages + new_messages, add_generation_prompt=True)
        if full[:len(known)] == known:
            return added + full[len(known):], False
    previous = chat_text(tokenizer, messages, add_generation_prompt=False)
    whole = chat_text(tokenizer, messages + new_messages, add_generation_prompt=True)
    if not whole.startswith(previous):
        raise RolloutError("the chat template re-renders earlier turns when a message is added; "
                           "multi-turn token histories need an append-only template")
    eos_text = tokenizer.decode(eos) if eos else ""
    rest = closing[len(eos_text):] if eos_text and closing.startswith(eos_text) else closing
    tail = tokenizer.encode(rest + whole[len(previous):], add_special_tokens=False)
    return added + tail, True


def _canonical(tokenizer, text: str, reply_ids: list[int], eos: list[int]) -> bool:
    """Are the model's tokens (less a trailing eos) how the tokenizer itself splits `text`?"""
    ids = reply_ids[:-len(eos)] if eos and reply_ids[-len(eos):] == eos else reply_ids
    return tokenizer.encode(text, add_special_tokens=False) == list(ids)
