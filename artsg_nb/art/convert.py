"""ART's trajectories as ours: `art.TrajectoryGroup`s → `rollout.TrajectoryGroup`s, token-exact.

What it does: an ART rollout appends the `Choice` objects that `chat.completions.create(...,
logprobs=True)` returned to `Trajectory.messages_and_choices`. `to_groups` turns each trajectory
into a `rollout.Trajectory` (token ids, completion mask, server logprobs, reward) the trainer
takes as is:

- The model's tokens are the server's, never re-tokenised text. A choice's token ids come, in
  order of preference, from SGLang's `meta_info.output_token_logprobs` (the request sent
  `return_meta_info: true`, which `model.openai_client()` does for you under SGLangBackend),
  from vLLM's `token_ids` (`return_token_ids: true`), from `token_id:<n>` strings, or from the
  logprob entries' token strings, each
  looked up in the vocabulary: exact where one token decodes to that string. A string several
  tokens decode to ("�": a byte of a character split over tokens) is resolved by `resolve`
  (the backend's: which of those tokens has the logprob the server reported, under the
  trainer's weights, which are the served adapter's), or is an error naming the trajectory.
- The rest (prompt, env and tool-result messages between model turns) is the chat template of
  the conversation with a sentinel in place of each reply, split there and tokenised piece by
  piece (each piece starts at a template boundary, so no token crosses it). The first piece is
  what the server rendered as the prompt; SGLang's `prompt_token_ids` replace it when present.
- What cannot be scored is an error (`UnsupportedTrajectory`) that names the trajectory: a
  Choice without logprobs, a reply with tool calls, `additional_histories`, no Choice at all.
  A trajectory whose ids stay ambiguous (`AmbiguousTokens`) is left out of the update like a
  failed rollout (its group keeps the others; history column failed_rollouts), with a warning.
  Messages after the last Choice carry nothing to train on and are left out (as ART does).

What it does not do: talk HTTP, or import `art` (it reads the objects by attribute, so it is
testable with any look-alike); the advantages and the loss are grpo.py's.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

from ..rollout.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

SENTINEL = "\u2063artsg-art-reply\u2063"  # stands in for each reply in the rendered conversation


class UnsupportedTrajectory(ValueError):
    """An ART trajectory this backend cannot turn into tokens it can train on."""


class AmbiguousTokens(UnsupportedTrajectory):
    """The server sent no ids and a token string does not say which token was sampled."""


Resolver = Callable[[list, list, float, str], int]
"""resolve(ids so far, candidate ids, the server's logprob, where) -> the sampled id (or raises)."""


def to_groups(art_groups: Iterable[Any], tokenizer, adapter: str | None,
              resolve: Resolver | None = None) -> list[TrajectoryGroup]:
    """One of our groups per ART group with trajectories (a group whose rollouts all raised is
    left out: ART records those in `group.exceptions`); `adapter` is recorded as the sampler."""
    groups, unknown = [], []
    for gi, group in enumerate(art_groups):
        trajs = []
        for ti, t in enumerate(group.trajectories):
            try:
                trajs.append(to_trajectory(t, tokenizer, adapter, f"group {gi}, trajectory {ti}", gi, resolve))
            except AmbiguousTokens as e:  # left out like a failed rollout: its tokens are not known exactly
                unknown.append(str(e))
                trajs.append(Trajectory(messages=[], token_ids=[], completion_mask=[], logprobs=[], adapter=adapter,
                                        seed=gi, error=f"AmbiguousTokens: {e}"))
        if trajs:
            groups.append(TrajectoryGroup(seed=gi, trajectories=trajs))
    if unknown:
        log.warning("%d trajectories left out: their token ids are not known exactly (first: %s)", len(unknown),
                    unknown[0])
    if not groups:
        raise UnsupportedTrajectory("no trajectory to train on: every group is empty (all rollouts raised? see "
                                    "each art.TrajectoryGroup's `exceptions`)")
    return groups


def to_trajectory(traj: Any, tokenizer, adapter: str | None, where: str = "trajectory", seed: int = 0,
                  resolve: Resolver | None = None) -> Trajectory:
    """One ART trajectory as token ids + mask + logprobs (see the module docstring)."""
    if getattr(traj, "additional_histories", None):
        raise UnsupportedTrajectory(f"{where}: additional_histories are not supported by SGLangBackend; "
                                    "train each history as a trajectory of its own")
    items = list(traj.messages_and_choices)
    choice_at = [i for i, x in enumerate(items) if _is_choice(x)]
    if not choice_at:
        raise UnsupportedTrajectory(f"{where}: no Choice in messages_and_choices; append the Choice that "
                                    "chat.completions.create(..., logprobs=True) returned (response.choices[0])")
    items = items[:choice_at[-1] + 1]  # later messages carry nothing to train on
    for k, i in enumerate(choice_at):
        _check_choice(items[i], f"{where}, reply {k} (messages_and_choices[{i}])")
    pieces = _template_pieces(tokenizer, items, getattr(traj, "tools", None), where)
    first = items[choice_at[0]]
    prompt = _extra(first, "prompt_token_ids")
    ids = list(prompt) if prompt else _encode(tokenizer, pieces[0])
    mask, logprobs = [0] * len(ids), [0.0] * len(ids)
    prompt_len = len(ids)
    for k, i in enumerate(choice_at):
        reply_ids, reply_lps = choice_tokens(items[i], tokenizer, f"{where}, reply {k}")
        for j, token in enumerate(reply_ids):
            if isinstance(token, tuple):  # several candidates: ask the resolver, left to right
                what = f"{where}, reply {k}, token {j}"
                if resolve is None:
                    raise AmbiguousTokens(f"{what}: {_AMBIGUOUS}")
                reply_ids[j] = resolve(ids + reply_ids[:j], list(token), reply_lps[j], what)
        ids += reply_ids
        mask += [1] * len(reply_ids)
        logprobs += reply_lps
        if k + 1 < len(choice_at):
            between = _encode(tokenizer, pieces[k + 1])
            if reply_ids and between and between[0] == reply_ids[-1]:
                between = between[1:]  # the model emitted the turn's end token the template writes too
            ids += between
            mask += [0] * len(between)
            logprobs += [0.0] * len(between)
    reward = float(traj.reward)
    return Trajectory(messages=_messages(items), token_ids=ids, completion_mask=mask, logprobs=logprobs,
                      reward=reward, error=None if math.isfinite(reward) else f"RolloutError: {where}: reward {reward}",
                      turns=len(choice_at), adapter=adapter, prompt_len=prompt_len, seed=seed,
                      finish_reasons=[str(items[i].finish_reason) for i in choice_at])


def choice_tokens(choice: Any, tokenizer, where: str = "reply") -> tuple[list, list[float]]:
    """(token ids, logprobs) of one Choice's reply, from the server's own ids where it sent them;
    a tuple of candidate ids stands where the token string alone does not say which it is."""
    content = list(choice.logprobs.content)
    logprobs = [float(c.logprob) for c in content]
    ids = _server_ids(choice)
    if ids is not None:
        if len(ids) != len(content):
            raise UnsupportedTrajectory(f"{where}: the server sent {len(ids)} token ids but logprobs for "
                                        f"{len(content)} tokens; cannot align them")
        return ids, logprobs
    try:
        return [int(c.token.split("token_id:", 1)[1]) for c in content], logprobs
    except (IndexError, ValueError, AttributeError):
        pass
    table, ambiguous = _vocab_lookup(tokenizer)
    out: list = []
    for j, c in enumerate(content):
        if c.token not in table:
            raise UnsupportedTrajectory(f"{where}: no token decodes to the string {c.token!r} (token {j}); {_IDS_HINT}")
        out.append(ambiguous.get(c.token, table[c.token]))
    return out, logprobs


_IDS_HINT = ("use model.openai_client(), which asks the server for its token ids, or send them yourself: "
             "extra_body={'return_meta_info': True, 'return_prompt_token_ids': True} on SGLang "
             "(not with stream=True), {'return_token_ids': True} on vLLM")
_AMBIGUOUS = f"the server sent no token ids and several tokens decode to this token's string; {_IDS_HINT}"


def _check_choice(choice: Any, where: str) -> None:
    message = getattr(choice, "message", None)
    if message is not None and getattr(message, "tool_calls", None):
        raise UnsupportedTrajectory(f"{where}: the reply has tool calls; SGLangBackend trains on replies as text "
                                    "and cannot score tool calls the server parsed out of it")
    if getattr(choice, "logprobs", None) is None or not getattr(choice.logprobs, "content", None):
        raise UnsupportedTrajectory(f"{where}: the Choice has no logprobs; request them with "
                                    "chat.completions.create(..., logprobs=True)")


def _is_choice(x: Any) -> bool:
    return not isinstance(x, dict) and hasattr(x, "message") and hasattr(x, "finish_reason")


def _server_ids(choice: Any) -> list[int] | None:
    """The reply's ids as the server sent them: SGLang's [logprob, id, text] triples in
    meta_info.output_token_logprobs, else vLLM's token_ids; None when it sent neither."""
    meta = _extra(choice, "meta_info") or {}
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if triples:
        return [int(t[1]) for t in triples]
    ids = _extra(choice, "token_ids")
    return [int(i) for i in ids] if ids is not None else None


def _extra(choice: Any, key: str):
    """A field SGLang adds to a choice (openai keeps unknown fields in `model_extra`)."""
    extra = getattr(choice, "model_extra", None) or {}
    return extra.get(key, getattr(choice, key, None))


def _messages(items: list) -> list[dict]:
    out = []
    for x in items:
        if _is_choice(x):
            out.append({"role": "assistant", "content": x.message.content or ""})
        else:
            out.append({**x, "content": x.get("content") or ""})
    return out


def _template_pieces(tokenizer, items: list, tools, where: str) -> list[str]:
    """The rendered conversation split at each reply: [prompt, between 1-2, ..., ""]."""
    messages = []
    for x in items:
        if _is_choice(x):
            messages.append({"role": "assistant", "content": SENTINEL})
        else:
            if x.get("tool_calls"):
                raise UnsupportedTrajectory(f"{where}: an assistant message with tool_calls; SGLangBackend cannot "
                                            "score tool calls")
            messages.append({**x, "content": x.get("content") or ""})
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True, **kwargs)
    pieces = text.split(SENTINEL)
    n = sum(_is_choice(x) for x in items)
    if len(pieces) != n + 1:
        raise UnsupportedTrajectory(f"{where}: the chat template kept {len(pieces) - 1} of {n} replies; cannot "
                                    "find where each reply sits in the conversation")
    return pieces


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


_LOOKUPS: dict[int, tuple[Any, dict[str, int], dict[str, tuple[int, ...]]]] = {}


def _vocab_lookup(tokenizer) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """{decoded token string: id} over the vocabulary, and {string: its ids} for the strings
    several ids decode to. Built once per tokenizer (~1 s per 100k tokens)."""
    cached = _LOOKUPS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer:
        return cached[1], cached[2]
    by_string: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        by_string.setdefault(tokenizer.decode([i]), []).append(i)
    table = {s: ids[0] for s, ids in by_string.items()}
    ambiguous = {s: tuple(ids) for s, ids in by_string.items() if len(ids) > 1}
    _LOOKUPS[id(tokenizer)] = (tokenizer, table, ambiguous)
    return table, ambiguous
