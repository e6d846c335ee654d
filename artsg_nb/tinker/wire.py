"""The Tinker API's wire formats, as the `tinker` client (0.38) sends and reads them.

What it does: pydantic models of the JSON request bodies the service reads (fields the client
sends and the service does not use are ignored), the conversion of a Tinker `Datum` into the
trainer's multi.losses.Datum (checking the inputs its loss function needs) and of its
SamplingParams into engines.SamplingParams (refusing what has no equivalent), and the protobuf bodies the
client uses for forward_backward requests and for the results of forward_backward and sample
(`tinker.proto.tinker_public_pb2`, the client's own schema: tokens as little-endian int32 bytes,
floats as float32 bytes, per-datum arrays concatenated with int64 byte offsets).

Read from: the client's tinker/proto/request_conv.py and response_conv.py (this is their
inverse), tinker/types/*.py, and SkyRL's server (NovaSky-AI/SkyRL skyrl/tinker/api.py and
proto_serialization.py), which serves the same client.

What it does not do: HTTP (server.py) or any training or sampling (service.py). Importing it does
not import `tinker`; the protobuf functions do (the server's environment has the client).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..engines.base import SamplingParams
from ..multi.losses import Datum
from .backend import LOSS_FUNCTIONS

PROTO_CONTENT_TYPE = "application/x-protobuf"

LOSS_INPUTS = {
    "cross_entropy": ({"target_tokens"}, {"weights"}),
    "importance_sampling": ({"target_tokens", "logprobs", "advantages"}, {"weights"}),
}
"""Per loss function: (loss_fn_inputs it needs, ones it accepts besides)."""


class WireError(ValueError):
    """A request the service cannot serve as sent; its message is the HTTP 400 detail."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""


class SessionRef(_Body):
    session_id: str


class LoraConfigBody(_Body):
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(_Body):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModel(_Body):
    session_id: str
    model_seq_id: int = 0
    base_model: str
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = OptimizerConfigBody()


class ModelRef(_Body):
    model_id: str


class AdamParamsBody(_Body):
    model_config = ConfigDict(extra="allow")
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(_Body):
    model_id: str
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None
    seq_id: int | None = None


class SaveWeights(_Body):
    model_id: str
    path: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=200)
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    seq_id: int | None = None


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsBody(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class ChunkBody(_Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInputBody(_Body):
    chunks: list[ChunkBody]


class Sample(_Body):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFuture(_Body):
    request_id: str
    allow_metadata_only: bool = False


class FwdBwd(BaseModel):
    """A forward_backward request, from either wire format."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, Any] | None
    data: list[Datum]
    forward_only: bool = False


# ---- Tinker's Datum → the trainer's -----------------------------------------------------------------------
def check_loss_fn(loss_fn: str, config: dict | None) -> None:
    """WireError unless `loss_fn` is one the service trains with, without a loss_fn_config."""
    if loss_fn not in LOSS_FUNCTIONS:
        raise WireError(f"loss_fn={loss_fn!r} is not supported by artsg_nb's Tinker server; supported: "
                        f"{', '.join(LOSS_FUNCTIONS)} (custom losses: forward_backward_custom runs client-side "
                        "on cross_entropy).")
    if config:
        raise WireError(f"loss_fn={loss_fn!r} takes no loss_fn_config here (got {sorted(config)}); "
                        "ppo/cispo clip thresholds are not supported.")


def token_datum(tokens: list[int], inputs: dict[str, list[float]], loss_fn: str, where: str) -> Datum:
    """One Tinker Datum (its model input's tokens, its loss_fn_inputs as flat lists) as the
    trainer's; weights default to 1 on every position (as Tinker's)."""
    needed, optional = LOSS_INPUTS[loss_fn]
    missing, unknown = needed - inputs.keys(), inputs.keys() - needed - optional
    if missing or unknown:
        raise WireError(f"{where}: loss_fn={loss_fn!r} needs loss_fn_inputs {sorted(needed)} (optional: "
                        f"{sorted(optional)}); missing {sorted(missing)}, not supported {sorted(unknown)}")
    n = len(tokens)
    bad = {k: len(v) for k, v in inputs.items() if len(v) != n}
    if bad or n == 0:
        raise WireError(f"{where}: every loss_fn_input needs one value per model-input token ({n}); got {bad}")
    weights = [float(w) for w in inputs.get("weights", [1.0] * n)]
    return Datum(input_tokens=[int(t) for t in tokens], target_tokens=[int(t) for t in inputs["target_tokens"]],
                 weights=weights,
                 advantages=[float(a) for a in inputs["advantages"]] if "advantages" in inputs else None,
                 logprobs=[float(x) for x in inputs["logprobs"]] if "logprobs" in inputs else None)


def text_tokens(chunks: list[ChunkBody], where: str) -> list[int]:
    """The tokens of a model input made of encoded_text chunks only (images are refused)."""
    kinds = sorted({c.type for c in chunks if c.type != "encoded_text" or c.tokens is None})
    if kinds:
        raise WireError(f"{where}: only encoded_text model-input chunks are supported (got {kinds})")
    return [t for c in chunks for t in c.tokens]


def fwdbwd_from_json(body: bytes) -> FwdBwd:
    """A forward_backward request in JSON (clients before 0.25)."""
    raw = _JsonFwdBwd.model_validate_json(body)
    fbi = raw.forward_backward_input
    check_loss_fn(fbi.loss_fn, fbi.loss_fn_config)
    data = [token_datum(text_tokens(d.model_input.chunks, f"datum {i}"),
                        {k: v.data for k, v in d.loss_fn_inputs.items()}, fbi.loss_fn, f"datum {i}")
            for i, d in enumerate(fbi.data)]
    return FwdBwd(model_id=raw.model_id, seq_id=raw.seq_id, loss_fn=fbi.loss_fn,
                  loss_fn_config=fbi.loss_fn_config, data=data)


class _JsonTensor(_Body):
    data: list[float]


class _JsonDatum(_Body):
    model_input: ModelInputBody
    loss_fn_inputs: dict[str, _JsonTensor]


class _JsonFwdBwdInput(_Body):
    data: list[_JsonDatum]
    loss_fn: str
    loss_fn_config: dict[str, Any] | None = None


class _JsonFwdBwd(_Body):
    model_id: str
    seq_id: int | None = None
    forward_backward_input: _JsonFwdBwdInput


def sampling_params(body: Sample) -> SamplingParams:
    """Tinker's SamplingParams as ours; what has no equivalent is refused by name."""
    sp = body.sampling_params
    unsupported = {k: v for k, v in {"top_k": sp.top_k if sp.top_k not in (-1, 0) else None,
                                     "topk_prompt_logprobs": body.topk_prompt_logprobs or None,
                                     "topk_sample_logprobs": body.topk_sample_logprobs or None,
                                     "target_prompt_logprobs": body.target_prompt_logprobs,
                                     "prompt_alt_tokens_k": body.prompt_alt_tokens_k or None,
                                     "prompt_logprobs_last_n": body.prompt_logprobs_last_n,
                                     "record_stability_info": body.record_stability_info or None}.items()
                   if v is not None}
    if unsupported:
        raise WireError(f"sample: {unsupported} not supported by artsg_nb's Tinker server; supported: num_samples, "
                        "max_tokens, temperature, top_p, stop (strings or token ids), seed, include_prompt_logprobs")
    if sp.max_tokens is None or sp.max_tokens <= 0:
        raise WireError("sample: SamplingParams.max_tokens is required (a positive number)")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    return SamplingParams(max_new_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, n=body.num_samples,
                          seed=sp.seed, stop=[s for s in stop if isinstance(s, str)] or None,
                          stop_token_ids=[s for s in stop if isinstance(s, int)] or None)


# ---- protobuf (the client's schema) -------------------------------------------------------------
def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise WireError("this request is in the tinker client's protobuf format, which needs the `tinker` package "
                        "in the server's environment: pip install tinker") from e
    return tinker_public_pb2


def fwdbwd_from_proto(body: bytes) -> FwdBwd:
    """A forward_backward request as the client sends it (request_conv.forward_backward_request_to_proto)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    config = {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    config = config or dict(msg.loss_fn_config)
    if not msg.forward_only:
        check_loss_fn(msg.loss_fn, config)
    loss_fn = msg.loss_fn if msg.loss_fn in LOSS_INPUTS else "cross_entropy"
    data = []
    for i, datum in enumerate(msg.data):
        tokens = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"datum {i}: only encoded_text model-input chunks are supported "
                                f"(got {chunk.WhichOneof('chunk')})")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _dense(t, f"datum {i} {name}") for name, t in datum.loss_fn_inputs.items()}
        if msg.forward_only:
            inputs = {k: v for k, v in inputs.items() if k in ("target_tokens", "weights")}
        data.append(token_datum(tokens, inputs, loss_fn, f"datum {i}"))
    return FwdBwd(model_id=msg.model_id, seq_id=msg.seq_id or None, loss_fn=msg.loss_fn, loss_fn_config=config or None,
                  data=data, forward_only=msg.forward_only)


def _dense(tensor, where: str) -> list:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64}
    if tensor.WhichOneof("encoding") != "dense" or tensor.dtype not in dtypes:
        raise WireError(f"{where}: only dense float32/int64 tensors are supported")
    return np.frombuffer(tensor.dense, dtype=dtypes[tensor.dtype]).tolist()


def fwdbwd_output_proto(per_datum: dict[str, list[list[float]]], n_datums: int, metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: one ArrayRecord whose fields (e.g. "logprobs") hold a float32
    array per datum, concatenated with int64 byte offsets (response_conv's inverse)."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord",
                                   metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)})
    record = out.loss_fn_outputs.add()
    record.num_datums = n_datums
    for name, arrays in per_datum.items():
        assert len(arrays) == n_datums, f"{name}: {len(arrays)} arrays for {n_datums} datums"
        flat = [np.asarray(a, dtype=np.float32) for a in arrays]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in flat])]).astype(np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in flat)
        field.offsets = offsets.tobytes()
        field.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


def sample_response_proto(sequences: list[tuple[str, list[int], list[float]]],
                          prompt_logprobs: list[float | None] | None) -> bytes:
    """A SampleResponse: per sequence (stop reason "stop"|"length", tokens, logprobs); the
    prompt's logprobs with NaN where there is none (its first token)."""
    pb = _pb()
    stop = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for reason, tokens, logprobs in sequences:
        out.sequences.append(pb.SampledSequence(stop_reason=stop[reason],
                                                tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
                                                logprobs=np.asarray(logprobs, dtype=np.float32).tobytes()))
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray([math.nan if x is None else x for x in prompt_logprobs],
                                         dtype=np.float32).tobytes()
    return out.SerializeToString()


StopReason = Literal["stop", "length"]
