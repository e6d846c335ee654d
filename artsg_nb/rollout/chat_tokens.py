"""Chat tokenisation of rollouts: the prompt's ids, and the ids appended after a model turn.

What it does: `render_ids` / `chat_text` apply the tokenizer's chat template; `env_suffix_ids` gives
the tokens that follow a model reply (its turn ending, the env's messages, the generation prompt)
without re-tokenising what the model generated, so a multi-turn history stays token-exact.

Message text is text, never control tokens. transformers' `apply_chat_template(tokenize=True)`
(5.x, the version here) renders the template to a string and tokenises it whole, so a user or tool
message holding "<|im_end|>\n<|im_start|>assistant\n" becomes those special tokens: the prompt
has injected an assistant turn. SGLang's and vLLM's chat endpoints render through the same
`apply_chat_template` and do the same (neither escapes message content; raw token ids, which is
what artsg_nb sends, are taken as given). Here, a message whose content holds the text of a
special token is rendered with its content tokenised as plain text (`split_special_tokens=True`:
"<|im_end|>" becomes the tokens of "<", "|", "im", ...), the template's own markup as usual.
That needs a template that writes message content verbatim (ChatML, Llama, Qwen, SmolLM2 do);
where a template alters the content, such a message is refused (PromptTextError) rather than
guessed at. Messages without control text render exactly as before (one tokenisation of the whole).
A lone surrogate ("\ud800", which no UTF-8 tokenizer can encode) is refused with where it is.

What it does not do: send requests or keep episodes (groups.py).
"""
from __future__ import annotations

import re

from .trajectory import RolloutError

_SENTINEL = "\u2063artsg-sentinel\u2063"  # stands in for a reply to find the template's turn ending
_HOLDER = "\u2063artsg-content-{}\u2063"  # stands in for message i's content while the template renders
_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(RolloutError):
    """The tokenizer or its chat template could not turn a prompt into tokens."""


class PromptTextError(TokenizerError):
    """A message's text cannot be tokenised as text (a lone surrogate; control text under a
    template that alters message content)."""


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template; message text that spells a
    special token is tokenised as text (module docstring)."""
    check_text(messages)
    if not _with_control_text(tokenizer, messages):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                            add_generation_prompt=add_generation_prompt)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    masked, fills = _masked(messages)
    text = chat_text(tokenizer, masked, add_generation_prompt)
    if _filled(text, fills) != chat_text(tokenizer, messages, add_generation_prompt):
        raise PromptTextError("a message holds the text of a chat control token, and this chat template alters "
                              "message text, so it cannot be kept as text. Try: remove the control token text "
                              f"({', '.join(map(repr, _with_control_text(tokenizer, messages)))}) from the prompt.")
    return encode_filled(tokenizer, text, fills)


def check_text(messages: list[dict]) -> None:
    """Raise PromptTextError naming the message and position of a lone surrogate."""
    for i, m in enumerate(messages):
        content = m.get("content")
        hit = _SURROGATE.search(content) if isinstance(content, str) else None
        if hit:
            raise PromptTextError(
                f"message {i} ({m.get('role')}) holds a lone surrogate U+{ord(hit.group()):04X} at character "
                f"{hit.start()}: it is not valid Unicode, so no tokenizer can encode it. Try: rejoin surrogate "
                "pairs with text.encode('utf-16', 'surrogatepass').decode('utf-16'), or drop them with "
                "text.encode('utf-8', 'replace').decode('utf-8') where the data is read.")


def _control_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens ("<|im_start|>", "<|im_end|>", ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in added.values() if getattr(t, "special", False)}
                  | set(getattr(tokenizer, "all_special_tokens", ())), key=len, reverse=True)


def _with_control_text(tokenizer, messages: list[dict]) -> list[str]:
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    return [t for t in _control_texts(tokenizer) if t and any(t in c for c in contents)]


def _masked(messages: list[dict], start: int = 0) -> tuple[list[dict], dict[str, str]]:
    """`messages` with each text content replaced by a placeholder, and placeholder → content."""
    masked, fills = [], {}
    for i, m in enumerate(messages, start):
        if isinstance(m.get("content"), str):
            fills[_HOLDER.format(i)] = m["content"]
            m = {**m, "content": _HOLDER.format(i)}
        masked.append(m)
    return masked, fills


def _filled(text: str, fills: dict[str, str]) -> str:
    for holder, content in fills.items():
        text = text.replace(holder, content)
    return text


def encode_filled(tokenizer, text: str, fills: dict[str, str]) -> list[int]:
    """Ids of `text` with each placeholder replaced by its content: the template's parts tokenised
    as usual (special tokens parsed), the contents as plain text (special tokens split)."""
    ids, pos = [], 0
    for holder, content in sorted(fills.items(), key=lambda kv: text.find(kv[0])):
        at = text.find(holder, pos)
        if at < 0:
            continue  # a template that leaves this message out
        ids += tokenizer.encode(text[pos:at], add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        pos = at + len(holder)
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)


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
    check_text(new_messages)
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
    escape = bool(_with_control_text(tokenizer, new_messages))
    new, fills = _masked(new_messages, len(messages)) if escape else (new_messages, {})
    whole = chat_text(tokenizer, messages + new, add_generation_prompt=True)
    if not whole.startswith(previous):
        raise RolloutError("the chat template re-renders earlier turns when a message is added; "
                           "multi-turn token histories need an append-only template")
    eos_text = tokenizer.decode(eos) if eos else ""
    rest = closing[len(eos_text):] if eos_text and closing.startswith(eos_text) else closing
    tail = encode_filled(tokenizer, rest + whole[len(previous):], fills)
    return added + tail, True


def _canonical(tokenizer, text: str, reply_ids: list[int], eos: list[int]) -> bool:
    """Are the model's tokens (less a trailing eos) how the tokenizer itself splits `text`?"""
    ids = reply_ids[:-len(eos)] if eos and reply_ids[-len(eos):] == eos else reply_ids
    return tokenizer.encode(text, add_special_tokens=False) == list(ids)
