"""The messages between the launcher and the compute process, as typed dataclasses, and their wire form.

The wire: one stream socket, a msgpack map per message, `op` naming its type. Each direction has its own set of
types (`TO_WORKER`, `TO_LAUNCHER`); `decode` checks the op, the field names and the field types against the
dataclass and raises `ProtocolError` naming what is wrong. Both sides import this module, so a field is
added in one place: one line in its dataclass (with a default, so a sender that does not set it still decodes).

Sampling defaults live here too, once: `SamplingParams`'s own defaults are the engine's (greedy, no truncation,
what `generate()` and the tools use); `SamplingParams.for_request` applies an API request's defaults (the
model's generation config, else `API_DEFAULTS`) in one step, on the launcher's side.

Figures of the engine's accounting are named for what they are: `*_total` (summed over tokens) or
`*_per_token` (divided by the tokens), never the bare name for both.
"""
from __future__ import annotations

import array
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack


class ProtocolError(ValueError):
    """A message that is not one of this direction's types, or whose fields do not match its type."""


# ------------------------------------------------------------------------------------------------ token ids
# A prompt's ids cross as one bytes value of int32 little-endian, a list[int] on both ends: 16k ids as a msgpack list
# cost ~0.5 ms to pack and ~0.5 ms to unpack and check on this VM (an int object made per id), as bytes ~0.05 each
# (bench/NOTES.md session 16, h-api). A field marked `IDS_ON_THE_WIRE` is packed so; a plain list of ints still
# decodes (hand-written messages), checked as any list[int] is.
IDS_ON_THE_WIRE = {"wire": "int32le"}
_I32 = "i"
assert array.array(_I32).itemsize == 4, "array 'i' is not 4 bytes here: the ids' wire form needs another code"


def _packed(f: dataclasses.Field) -> bool:
    return f.metadata.get("wire") == IDS_ON_THE_WIRE["wire"]


def pack_ids(ids) -> bytes:
    """Token ids as int32 little-endian bytes; OverflowError / TypeError for an id that is not an int32."""
    a = array.array(_I32, ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data, where: str = "ids") -> list[int]:
    """`pack_ids`'s bytes back to a list of ints."""
    if len(data) % 4:
        raise ProtocolError(f"{where}: {len(data)} bytes is not a whole number of int32 ids")
    a = array.array(_I32)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# ------------------------------------------------------------------------------------------------ sampling
# What an API request gets for a sampling field it leaves out when the model's generation_config.json names no
# default either: OpenAI's defaults (temperature 1), not the engine's greedy choice.
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


@dataclass
class SamplingParams:
    """How the next token is chosen and when generation ends. A new field is one line here (with its default);
    the launcher fills it from the request field of the same name (`for_request`)."""
    temperature: float = 0.0         # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0 = off
    seed: Union[int, None] = None
    max_tokens: int = 256
    min_tokens: int = 0              # stop tokens cannot be chosen before this many tokens
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0               # drop tokens below min_p x the most likely token's probability
    presence_penalty: float = 0.0    # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0   # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF / vLLM: seen tokens' logits (prompt and answer) divided (> 0) or multiplied
    # (token id, bias) pairs, added to the logits; pairs, not a map: msgpack maps of this wire have string keys
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError("repetition_penalty must be in (0, 10]")
        bias = dict(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        for t, b in bias.items():
            if int(t) < 0 or not -100 <= float(b) <= 100:
                raise ValueError(f"logit_bias {t}: {b}: token ids >= 0, biases in [-100, 100]")
        self.logit_bias = tuple(sorted((int(t), float(b)) for t, b in bias.items()))

    @staticmethod
    def model_defaults(generation_config: dict) -> dict:
        """The request defaults a checkpoint's generation_config.json sets, over `API_DEFAULTS`."""
        out = dict(API_DEFAULTS)
        for name, default in API_DEFAULTS.items():
            v = generation_config.get(name)
            if v is not None:
                out[name] = type(default)(v)
        return out

    @classmethod
    def for_request(cls, given: dict, defaults: dict) -> "SamplingParams":
        """The request's fields that are set (not None) over `defaults` over the engine's own; fields that are
        not sampling fields are ignored, so a request object's whole field dict can be passed."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in defaults.items() if k in names}
        kw.update({k: v for k, v in given.items() if k in names and v is not None})
        return cls(**kw)


# ------------------------------------------------------------------------------------------------ launcher -> worker
TO_WORKER: dict[str, type] = {}
TO_LAUNCHER: dict[str, type] = {}


def _message(op: str, direction: dict):
    def register(cls):
        cls = dataclass(cls)
        cls.op = op
        direction[op] = cls
        return cls
    return register


@dataclass
class Images:
    """The images of one prompt: pixel values of all grids (rows in order, fp32 little-endian), each grid's
    (gh, gw), the flat positions of their `<image>` tokens in the prompt and one digest per grid."""
    pixel_values: bytes
    n_rows: int
    row_size: int
    grid_hw: list[list[int]]
    positions: list[int]
    digests: list[str]


@dataclass
class Grammar:
    """Constrained decoding (server/constrained.py builds it, gpu_worker/grammar.py compiles it): an xgrammar
    structural tag (JSON) and the special tokens it spells, which the grammar's vocabulary keeps."""
    structural_tag: str
    special_tokens: list[str] = field(default_factory=list)


@_message("generate", TO_WORKER)
class Generate:
    id: str
    prompt_ids: list[int] = field(metadata=IDS_ON_THE_WIRE)
    params: SamplingParams
    logprobs: Union[int, None] = None          # None: off; k: each token's log-probability and the k most likely
    keep_at: list[int] = field(default_factory=list)    # prompt lengths at which to keep a snapshot too
    use_snapshots: bool = True
    images: Union[Images, None] = None
    grammar: Union[Grammar, None] = None


@_message("cancel", TO_WORKER)
class Cancel:
    id: str


@_message("stats", TO_WORKER)
class StatsRequest:
    seq: int


@_message("shutdown", TO_WORKER)
class Shutdown:
    pass


# ------------------------------------------------------------------------------------------------ worker -> launcher
@dataclass
class WorkerInfo:
    pid: int
    device: str
    dtype: str
    vocab_size: int
    eos_token_ids: list[int]
    model_key: str
    cache_prefix: str
    cache_child_pids: list[int]
    snapshots_on_disk: int


@dataclass
class Timings:
    """One request's figures, as the response's llama.cpp-style `timings` start from."""
    cache_n: int            # prompt tokens restored from a snapshot
    prompt_n: int           # prompt tokens computed
    prompt_ms: float        # until the first token
    predicted_n: int        # tokens generated
    predicted_ms: float     # from the first token to the last
    decode_steps: int       # forward passes of one token (predicted_n - 1)


@dataclass
class EngineTotals:
    """What the engine's accounting added during one request (totals, not per token)."""
    tokens: int
    ms_waiting_for_disk_total: float
    ms_experts_total: float
    ms_waiting_for_router_total: float
    ms_bookkeeping_total: float
    bytes_over_pcie_total: int
    bytes_from_disk_decode_total: int
    expert_lookup_hits_total: int = 0        # this request's expert look-ups found in the RAM cache
    expert_lookup_misses_total: int = 0


@dataclass
class EngineStats:
    """The compute process's figures at scrape time. `accounting_per_token` holds `*_per_token` figures and
    `accounting_totals` `*_total` ones (gpu_worker.streaming.Accounting); `requests` the worker's request totals;
    `cache` the cache's counters; `snapshots` the snapshot store's; `prefill` the prefill accounting
    (gpu_worker.prefill_accounting: totals and the last prompt's figures)."""
    requests: dict[str, float] = field(default_factory=dict)
    accounting_per_token: dict[str, float] = field(default_factory=dict)
    accounting_totals: dict[str, float] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[str, Any] = field(default_factory=dict)
    prefill: dict[str, Any] = field(default_factory=dict)


@_message("status", TO_LAUNCHER)
class Status:
    message: str            # loading progress, for /health and sd_notify


@_message("ready", TO_LAUNCHER)
class Ready:
    info: WorkerInfo


@_message("fatal", TO_LAUNCHER)
class Fatal:
    message: str            # why loading failed, or why it cannot serve any more; the process exits after it


@_message("start", TO_LAUNCHER)
class Started:
    id: str
    cached_tokens: int
    snapshot: Union[str, None] = None       # where the restored snapshot came from ('ram' | 'disk')


@_message("token", TO_LAUNCHER)
class Token:
    id: str
    token: int
    finish_reason: Union[str, None] = None     # 'stop' | 'length' on the last token
    logprob: Union[float, None] = None
    top_logprobs: Union[list[tuple[int, float]], None] = None


@_message("done", TO_LAUNCHER)
class Done:
    id: str
    finish_reason: str                         # 'stop' | 'length' | 'cancelled'
    timings: Union[Timings, None] = None       # None: cancelled before it started
    engine: Union[EngineTotals, None] = None


@_message("error", TO_LAUNCHER)
class Error:
    id: str
    message: str
    crash: bool = False      # set by the launcher: the compute process died while serving the request
    abort: bool = False      # set by the launcher: dropped at shutdown
    store_damaged: Union[str, None] = None     # the block the expert store could not give (read twice)


@_message("stats", TO_LAUNCHER)
class StatsReply:
    seq: int
    stats: EngineStats


# ------------------------------------------------------------------------------------------------ the wire
def encode(msg) -> bytes:
    """One message as msgpack bytes."""
    if not dataclasses.is_dataclass(msg) or not hasattr(type(msg), "op"):
        raise ProtocolError(f"{type(msg).__name__} is not a message type")
    return msgpack.packb({"op": msg.op, **_plain(msg)}, use_bin_type=True)


def unpacker() -> msgpack.Unpacker:
    """A stream decoder of raw maps; each map then goes through `decode`."""
    return msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)


def decode(obj, direction: dict):
    """The typed message for one received map; `direction` is TO_WORKER or TO_LAUNCHER."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {type(obj).__name__}")
    op = obj.get("op")
    cls = direction.get(op)
    if cls is None:
        raise ProtocolError(f"unknown message op {op!r}; expected one of {', '.join(sorted(direction))}")
    return _build(cls, {k: v for k, v in obj.items() if k != "op"}, op)


# Items that pack and check as they are: a list of them (a prompt's ids, 16k and more) crosses the wire without a
# Python step per item (one per item cost 20 ms each way for 16k ids on a fast host, 50 on the GPU's)
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _plain(v):
    if dataclasses.is_dataclass(v):
        return {f.name: pack_ids(getattr(v, f.name)) if _packed(f) else _plain(getattr(v, f.name))
                for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        if set(map(type, v)) <= _SCALARS:
            return list(v)
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


_HINTS: dict[type, dict] = {}


def _build(cls, d: dict, where: str):
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - set(fields))
    if extra:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(map(repr, extra))}")
    missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    kw = {n: unpack_ids(v, f"{where}.{n}") if _packed(fields[n]) and isinstance(v, bytes)
          else _convert(v, hints[n], f"{where}.{n}") for n, v in d.items()}
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"{where}: {e}") from e


def _convert(v, t, where: str):
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(v, inner[0], where)
        raise ProtocolError(f"{where}: unsupported annotation {t}")
    if t is Any:
        return v
    if dataclasses.is_dataclass(t):
        if not isinstance(v, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
        return _build(t, v, where)
    if origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
        if origin is tuple and args and args[-1] is not Ellipsis:      # a fixed-length tuple
            if len(v) != len(args):
                raise ProtocolError(f"{where}: expected {len(args)} items, got {len(v)}")
            return tuple(_convert(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(v, args)))
        item = args[0] if args else Any
        if item in (int, float, str, bool) and set(map(type, v)) <= ({int, float} if item is float else {item}):
            return origin(map(float, v)) if item is float else origin(v)     # checked at C speed (prompt ids)
        return origin(_convert(x, item, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        if not isinstance(v, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
        return dict(v)
    if t is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(f"{where}: expected a number, got {type(v).__name__}")
        return float(v)
    if t is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(f"{where}: expected an integer, got {type(v).__name__}")
        return v
    if t in (str, bool, bytes):
        if not isinstance(v, t) or (t is bytes and isinstance(v, bool)):
            raise ProtocolError(f"{where}: expected {t.__name__}, got {type(v).__name__}")
        return v
    raise ProtocolError(f"{where}: unsupported annotation {t}")

