"""The Tinker SDK's binary wire format: the two places where the SDK speaks protobuf and nothing
else (a forward-backward request; the results of a forward-backward and of a sample, which it asks
for with ``Accept: application/x-protobuf``). Everything else it sends and reads is JSON.

The message definitions are the SDK's own (``tinker.proto.tinker_public_pb2``): the schema the
client encodes with is the one decoded here. Decoding is bounded: the body's size is capped before
it is read (``MAX_BODY_BYTES``), a zstd body may not inflate past ``MAX_INFLATED_BYTES``, and the
call's tokens and data are counted before anything is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_INFLATED_BYTES = 64 * 1024 * 1024
MAX_DATA = 1024  # data per forward-backward call (the SDK sends at most 1,024 a chunk)
MAX_TOKENS_PER_CALL = 65_536  # model input tokens per forward-backward call, all data together
LOSS_FN_INPUT_NAMES = ("target_tokens", "weights", "logprobs", "advantages")

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request the SDK would not have encoded so: the message names the field."""


@dataclass(frozen=True)
class WireDatum:
    tokens: list[int]
    inputs: dict[str, list[float] | list[int]]  # by name, each as long as ``tokens``


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False
    data: list[WireDatum] = field(default_factory=list)


def inflated(body: bytes, content_encoding: str) -> bytes:
    """The body as the SDK serialised it: a zstd one decompressed, at most MAX_INFLATED_BYTES."""
    if content_encoding.strip().lower() != "zstd":
        return body
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            whole = reader.read(MAX_INFLATED_BYTES + 1)
    except zstandard.ZstdError as exc:
        raise WireError(f"the zstd body is corrupt ({exc})") from None
    if len(whole) > MAX_INFLATED_BYTES:
        raise WireError(f"the body inflates past {MAX_INFLATED_BYTES // 2**20} MiB")
    return whole


def forward_backward_call(body: bytes) -> ForwardBackwardCall:
    """A forward-backward request's proto, checked: text tokens only, dense 1-D inputs as long as
    their datum's tokens, finite numbers, within the per-call caps."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise WireError("the body is not a ForwardBackwardRequest protobuf") from None
    if len(message.data) > MAX_DATA:
        raise WireError(f"data holds {len(message.data)} items; at most {MAX_DATA} a call")
    config = {name: value.number for name, value in message.loss_fn_config_v2.items() if value.WhichOneof("value") == "number"}
    config = config or dict(message.loss_fn_config)
    for name, number in config.items():
        if not math.isfinite(number):
            raise WireError(f"loss_fn_config.{name} is {number}; give a finite number")
    data, total = [], 0
    for index, datum in enumerate(message.data):
        tokens = _tokens(datum, f"data[{index}]")
        total += len(tokens)
        if total > MAX_TOKENS_PER_CALL:
            raise WireError(f"the call holds more than {MAX_TOKENS_PER_CALL:,} tokens; send it in smaller calls")
        inputs = {name: _vector(tensor, f"data[{index}].loss_fn_inputs.{name}") for name, tensor in datum.loss_fn_inputs.items()}
        for name, values in inputs.items():
            if len(values) != len(tokens):
                raise WireError(f"data[{index}].loss_fn_inputs.{name}: {len(values)} values for {len(tokens)} tokens")
        data.append(WireDatum(tokens, inputs))
    return ForwardBackwardCall(message.model_id, message.seq_id, message.loss_fn, config, message.forward_only, data)


def _tokens(datum: pb.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise WireError(f"{where}.model_input: only text tokens are taken here (no images or audio)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise WireError(f"{where}.model_input holds no tokens")
    return tokens


def _vector(tensor: pb.Tensor, where: str) -> list[float] | list[int]:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype must be float32 or int64")
    if tensor.HasField("sparse_csr") or len(tensor.shape) > 1:
        raise WireError(f"{where}: give a dense 1-D tensor")
    raw = tensor.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    values = np.frombuffer(raw, dtype=dtype)
    if tensor.shape and tensor.shape[0] != values.size:
        raise WireError(f"{where}: shape [{tensor.shape[0]}] but {values.size} values")
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise WireError(f"{where}: holds NaN or infinity; give finite numbers")
    return values.tolist()


def forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput as the SDK decodes it: one ArrayRecord whose ``logprobs`` field holds
    each datum's per-token log-probabilities."""
    arrays = [np.asarray(values, dtype=np.float32) for values in logprobs]
    offsets = np.cumsum([0] + [array.nbytes for array in arrays], dtype=np.int64)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
    batched = record.fields["logprobs"]
    batched.dtype = pb.DTYPE_FLOAT32
    batched.data = b"".join(array.tobytes() for array in arrays)
    batched.offsets = offsets.tobytes()
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics)
    return output.SerializeToString()


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # False: it ran to max_tokens


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """SampleResponse as the SDK decodes it. ``prompt_logprobs``: NaN where none was computed."""
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()
