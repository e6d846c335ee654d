"""SGLang's JSON shapes for the CPU engine: request bodies in, response bodies out.

What it does: turns a /generate or /v1/chat/completions body into scheduler `Request`s (one per
prompt and sample) and finished `Request`s back into SGLang 0.5.x response objects, key for key
with the responses recorded from a real server (shared/fixtures/sglang-0.5.14/): /generate's
{text, output_ids, meta_info}, SSE chunks, and the OpenAI chat completion with SGLang's
extensions (matched_stop, prompt_token_ids with return_prompt_token_ids, meta_info with
return_meta_info: its output_token_logprobs carry the ids when logprobs were asked for).

What it deliberately does not do: talk HTTP or touch the scheduler (routes.py does);
chat streaming, tools, reasoning parsers, multimodal input, /v1/completions.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

from .model import ModelRunner
from .request import Request
from .sampling import RequestSampling, parse_sampling_params


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message goes back to the client."""


AdapterResolver = Callable[[str | None], str | None]  # adapter name → load id (raises BadRequest)


# ---- /generate ---------------------------------------------------------------------------
def generate_requests(body: dict, runner: ModelRunner, resolve: AdapterResolver) -> tuple[list[Request], bool]:
    """Scheduler requests for a /generate body, prompt-major (p0s0, p0s1, ..., p1s0, ...).

    Returns (requests, is_batch); is_batch means the response is a list.
    """
    prompts, is_batch = _prompts(body, runner)
    sampling = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    adapters = _per_prompt(body.get("lora_path"), len(prompts), "lora_path")
    params = [check_token_ids(parse_sampling_params(s), runner) for s in sampling]
    ids = [resolve(a) for a in adapters]
    top = int(body.get("top_logprobs_num") or 0)
    if top < 0:
        raise BadRequest(f"top_logprobs_num must be >= 0, got {top}")
    reqs = []
    for prompt, p, adapter_id in zip(prompts, params, ids):
        check_length(prompt, p, runner)
        for j in range(p.n):
            reqs.append(Request(input_ids=prompt, params=p, adapter_id=adapter_id,
                                return_logprob=bool(body.get("return_logprob", False)),
                                logprob_start_len=int(_default(body.get("logprob_start_len"), -1)),
                                top_logprobs_num=top, stream=bool(body.get("stream", False)),
                                sample_index=j))
    return reqs, is_batch or len(reqs) > 1


def _prompts(body: dict, runner: ModelRunner) -> tuple[list[list[int]], bool]:
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        vocab = runner.config.vocab_size
        for p in prompts:
            if not isinstance(p, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in p):
                raise BadRequest(f"input_ids must be a list of token ids in [0, {vocab}) or a list of such lists")
    elif body.get("text") is not None:
        text = body["text"]
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        for t in texts:
            refuse_long_text(len(t), runner)
        prompts = [runner.encode(t) for t in texts]
    else:
        raise BadRequest("Either text or input_ids should be provided.")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadRequest("The input is empty: provide at least one token")
    return prompts, is_batch


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} is a list of {len(value)} items for {n} prompts")
        return value
    return [value] * n


def check_token_ids(params: RequestSampling, runner: ModelRunner) -> RequestSampling:
    """stop_token_ids inside the vocabulary; one outside would fail the whole decode batch."""
    vocab = runner.config.vocab_size
    bad = sorted(t for t in params.stop_token_ids if not 0 <= t < vocab)
    if bad:
        raise BadRequest(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return params


def refuse_long_text(n_chars: int, runner: ModelRunner) -> None:
    """A text of `n_chars` needs at least n_chars / max_token_chars tokens: refuse one that cannot
    fit the context by its length alone, before tokenising it (time and memory)."""
    if n_chars > runner.context_len * runner.max_token_chars:
        raise BadRequest(f"The input ({n_chars} characters, so at least {n_chars // runner.max_token_chars} tokens) "
                         f"is longer than the model's context length ({runner.context_len} tokens).")


def check_length(prompt: list[int], params: RequestSampling, runner: ModelRunner) -> None:
    context = runner.context_len
    if len(prompt) >= context:
        raise BadRequest(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                         f"({context} tokens).")
    total = len(prompt) + params.max_new_tokens
    if total > context:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                         f"You requested a total of {total} tokens: {len(prompt)} tokens from the input messages "
                         f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of "
                         "tokens in the input messages or the completion to fit within the limit.")


def generate_response(req: Request, runner: ModelRunner, with_text: bool = False,
                      n_tokens: int | None = None, finished: bool = True) -> dict:
    """SGLang's /generate object for `req` (the first `n_tokens` outputs while streaming)."""
    n = len(req.output_ids) if n_tokens is None else n_tokens
    output_ids = req.output_ids[:n]
    reason = req.finish_reason if finished else None
    meta = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.input_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "queue_time": (req.dispatch_ts or req.received_ts) - req.received_ts,
    }
    if req.return_logprob:
        meta.update(_logprob_fields(req, runner, n, with_text))
    now = time.time()
    meta.update({
        "reasoning_tokens": 0,
        "completion_tokens": n,
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": None,
        "dp_rank": None,
    })
    if finished:
        decode_s = (req.finished_ts or now) - (req.first_token_ts or now)
        meta.update({
            "e2e_latency": (req.finished_ts or now) - req.received_ts,
            "request_received_ts": req.received_ts,
            "api_server_dispatch_finish_ts": req.received_ts,
            "request_finished_ts": req.finished_ts,
            "decode_throughput": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "response_sent_to_client_ts": now,
        })
    return {"text": output_text(req, runner, output_ids, reason), "output_ids": output_ids, "meta_info": meta}


def _logprob_fields(req: Request, runner: ModelRunner, n: int, with_text: bool) -> dict:
    def triple(logprob, token_id):
        return [logprob, token_id, runner.token_strings([token_id])[0] if with_text else None]

    start = max(req.logprob_start_len, 0)
    fields = {
        "input_token_logprobs": [triple(lp, req.input_ids[start + i]) for i, lp in enumerate(req.input_logprobs)],
        "output_token_logprobs": [triple(lp, t) for lp, t in zip(req.output_logprobs[:n], req.output_ids[:n])],
        "output_token_logprobs_length": min(n, len(req.output_logprobs)),
    }
    if req.top_logprobs_num > 0:
        fields["input_top_logprobs"] = [None if top is None else [triple(lp, t) for lp, t in top]
                                        for top in req.input_top_logprobs]
        fields["output_top_logprobs"] = [[triple(lp, t) for lp, t in top] for top in req.output_top_logprobs[:n]]
    return fields


def output_text(req: Request, runner: ModelRunner, output_ids: list[int], reason: dict | None) -> str:
    """Decoded output; a matched stop token or stop string is trimmed unless no_stop_trim."""
    p = req.params
    matched = (reason or {}).get("matched")
    trim = reason is not None and reason.get("type") == "stop" and not p.no_stop_trim
    if trim and isinstance(matched, int) and output_ids and output_ids[-1] == matched:
        output_ids = output_ids[:-1]
    text = runner.decode(output_ids, p.skip_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[:text.index(matched)]
    return text


def _default(value, default):
    return default if value is None else value


# ---- /v1/chat/completions ----------------------------------------------------------------
def parse_model_parameter(model: str, served_model_name: str) -> tuple[str, str | None]:
    """SGLang's _parse_model_parameter: "<served>:<adapter>" selects an adapter; a bare name
    (no colon) serves the base model; otherwise split on the first colon."""
    if ":" not in model or model == served_model_name:
        return model, None
    if model.startswith(f"{served_model_name}:"):
        base, adapter = served_model_name, model[len(served_model_name) + 1:]
    else:
        base, adapter = model.split(":", 1)
    return base.strip(), adapter.strip() or None


def chat_requests(body: dict, runner: ModelRunner, resolve: AdapterResolver,
                  served_model_name: str) -> list[Request]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported on /v1/chat/completions by the CPU engine; "
                         "use /generate with stream=true")
    refuse_long_text(sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict)), runner)
    try:
        prompt = runner.render_chat(messages)
    except Exception as e:
        raise BadRequest(f"could not render messages with the chat template: {e}") from e
    max_tokens = _default(body.get("max_completion_tokens"), body.get("max_tokens"))
    raw = {
        "max_new_tokens": max_tokens if max_tokens is not None else runner.context_len - len(prompt),
        "temperature": _default(body.get("temperature"), 1.0),
        "top_p": body.get("top_p"), "top_k": body.get("top_k"), "min_p": body.get("min_p"),
        "stop": body.get("stop"), "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"), "n": body.get("n"), "sampling_seed": body.get("seed"),
        "min_new_tokens": body.get("min_tokens"), "skip_special_tokens": body.get("skip_special_tokens"),
        "no_stop_trim": body.get("no_stop_trim"),
    }
    params = check_token_ids(parse_sampling_params({k: v for k, v in raw.items() if v is not None}), runner)
    check_length(prompt, params, runner)
    _, adapter = parse_model_parameter(str(body.get("model") or served_model_name), served_model_name)
    adapter_id = resolve(adapter if adapter is not None else body.get("lora_path"))
    top = int(body.get("top_logprobs") or 0)
    return [Request(input_ids=prompt, params=params, adapter_id=adapter_id,
                    return_logprob=bool(body.get("logprobs")), top_logprobs_num=top, sample_index=j)
            for j in range(params.n)]


def chat_response(body: dict, reqs: list[Request], runner: ModelRunner, served_model_name: str,
                  enable_cache_report: bool) -> dict:
    choices = [_chat_choice(i, req, body, runner) for i, req in enumerate(reqs)]
    prompt_tokens = len(reqs[0].input_ids)
    completion_tokens = sum(len(r.output_ids) for r in reqs)
    cached = reqs[0].cached_tokens  # SGLang counts a prompt's cached tokens once (first choice)
    return {
        "id": uuid.uuid4().hex,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            # SGLang fills this only with --enable-cache-report, and only when something hit.
            "prompt_tokens_details": {"cached_tokens": cached} if enable_cache_report and cached > 0 else None,
            "reasoning_tokens": 0,
        },
        "metadata": {"weight_version": "default"},
    }


def _chat_choice(index: int, req: Request, body: dict, runner: ModelRunner) -> dict:
    reason = req.finish_reason or {}
    choice = {
        "index": index,
        "message": {"role": "assistant", "content": output_text(req, runner, req.output_ids, reason),
                    "reasoning_content": None, "tool_calls": None},
        "logprobs": _chat_logprobs(req, runner) if req.return_logprob else None,
        "finish_reason": reason.get("type"),
        "matched_stop": reason.get("matched") if reason.get("type") == "stop" else None,
    }
    if body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = list(req.input_ids)
    if body.get("return_meta_info"):
        choice["meta_info"] = generate_response(req, runner, with_text=True)["meta_info"]
    return choice


def _chat_logprobs(req: Request, runner: ModelRunner) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = runner.token_strings([token_id])[0]
        return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": logprob}

    content = []
    for j, (token_id, logprob) in enumerate(zip(req.output_ids, req.output_logprobs)):
        top = req.output_top_logprobs[j] if j < len(req.output_top_logprobs) else []
        content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for lp, t in top]})
    return {"content": content}
