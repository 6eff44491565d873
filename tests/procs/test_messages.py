"""The launcher <-> compute process messages: every type survives the wire; anything else is a clear error."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest

from procs import messages as m

EXAMPLES = [
    m.Generate("r1", [1, 2, 3], m.SamplingParams(temperature=0.7, top_k=5, seed=2 ** 64 - 1, max_tokens=9,
                                                 stop_token_ids=(2, 7)),
               logprobs=3, keep_at=[2], use_snapshots=False,
               images=m.Images(b"\0" * 8, 1, 2, [[2, 2]], [0], ["d"])),
    m.Cancel("r1"), m.StatsRequest(4), m.Shutdown(),
    m.Status("loading"), m.Fatal("no store"),
    m.Ready(m.WorkerInfo(1, "cpu", "fp32", 100, [0, 1], "k", "/moestream-1-", [2, 3], 0)),
    m.Started("r1", 5, "ram"), m.Token("r1", 9, "length", -0.25, [(9, -0.25), (3, -2.0)]),
    m.Done("r1", "stop", m.Timings(1, 2, 3.5, 4, 5.5, 3), m.EngineTotals(3, 0.1, 0.2, 0.3, 0.4, 5, 6)),
    m.Done("r1", "cancelled"), m.Error("r1", "boom", crash=True),
    m.StatsReply(4, m.EngineStats(requests={"requests": 1}, accounting_per_token={"ms_experts_per_token": 0.5})),
]


def wire(msg):
    return msgpack.unpackb(m.encode(msg), raw=False)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_every_message_survives_the_wire(msg):
    direction = m.TO_WORKER if type(msg) in m.TO_WORKER.values() else m.TO_LAUNCHER
    assert m.decode(wire(msg), direction) == msg


def test_each_direction_has_its_own_types():
    assert {c.op for c in m.TO_WORKER.values()} == {"generate", "cancel", "stats", "shutdown"}
    with pytest.raises(m.ProtocolError, match="unknown message op 'token'"):
        m.decode(wire(m.Token("r", 1)), m.TO_WORKER)      # a launcher-bound message sent the wrong way


@pytest.mark.parametrize("obj, why", [
    ({"op": "nope"}, "unknown message op 'nope'; expected one of cancel, generate, shutdown, stats"),
    ({"id": "r"}, "unknown message op None"),
    ([1, 2], "a message must be a map"),
    ({"op": "generate", "id": "r"}, "generate: missing field(s) 'prompt_ids', 'params'"),
    ({"op": "cancel", "id": "r", "reason": "x"}, "cancel: unknown field(s) 'reason'"),
    ({"op": "cancel", "id": 3}, "cancel.id: expected str, got int"),
    ({"op": "generate", "id": "r", "prompt_ids": [1, "2"], "params": {}}, "generate.prompt_ids[1]: expected an integer"),
    ({"op": "generate", "id": "r", "prompt_ids": [1], "params": {"top_p": 0}}, "generate.params: top_p must be in"),
    ({"op": "generate", "id": "r", "prompt_ids": [1], "params": {"temperature": "hot"}}, "generate.params.temperature: expected a number"),
])
def test_malformed_messages_are_named(obj, why):
    with pytest.raises(m.ProtocolError) as e:
        m.decode(obj, m.TO_WORKER)
    assert why in str(e.value)
    good = {"op": "generate", "id": "r", "prompt_ids": [1], "params": {}}
    assert m.decode(good, m.TO_WORKER).params == m.SamplingParams()      # the twin: a well-formed one decodes


def test_a_new_field_with_a_default_is_one_line():
    """A message type with one more field still decodes what an older sender wrote (the default fills it)."""
    @dataclasses.dataclass
    class Newer(m.SamplingParams):
        min_p: float = 0.0
    assert m._build(Newer, {"temperature": 0.5}, "params") == Newer(temperature=0.5)
    assert m._build(Newer, {"min_p": 0.1}, "params").min_p == 0.1


def test_sampling_defaults_are_applied_once_in_order():
    gen = m.SamplingParams.model_defaults({"temperature": 0.6, "top_k": None})
    assert gen == {"temperature": 0.6, "top_p": 1.0, "top_k": 0}          # generation config over the API's
    assert m.SamplingParams.model_defaults({}) == m.API_DEFAULTS
    p = m.SamplingParams.for_request({"temperature": None, "top_p": 0.5, "max_tokens": 3, "stream": True}, gen)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.5, 0, 3)   # request over defaults
    assert m.SamplingParams().temperature == 0.0           # the engine's own default: greedy
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        m.SamplingParams.for_request({"temperature": -1}, gen)


def test_a_long_prompt_crosses_without_a_step_per_id(monkeypatch):
    """16k ids are packed and checked at C speed (one Python step per id cost ~20 ms each way on a fast host):
    one bytes value on the wire, and the decode calls the per-item converter a bounded number of times. A plain
    list of ids (a hand-written message) still decodes, checked, and a bad id in it is named (the twins)."""
    import random
    ids = [random.randrange(1 << 17) for _ in range(16_384)]
    msg = m.Generate("r", ids, m.SamplingParams(), keep_at=[5, 9])
    calls = {"n": 0}
    real = m._convert

    def counting(*a):
        calls["n"] += 1
        return real(*a)
    monkeypatch.setattr(m, "_convert", counting)
    assert isinstance(wire(msg)["prompt_ids"], bytes)
    got = m.decode(wire(msg), m.TO_WORKER)
    assert got == msg and type(got.prompt_ids) is list and calls["n"] < 100
    as_list = {**wire(msg), "prompt_ids": ids}
    assert m.decode(as_list, m.TO_WORKER) == msg
    for bad, why in ((True, "expected an integer, got bool"), (1.5, "expected an integer, got float"),
                     (None, "expected an integer, got NoneType")):
        obj = {**wire(msg), "prompt_ids": list(ids)}
        obj["prompt_ids"][12_345] = bad
        with pytest.raises(m.ProtocolError, match=rf"prompt_ids\[12345\]: {why}"):
            m.decode(obj, m.TO_WORKER)
    obj = wire(m.Generate("r", [1], m.SamplingParams(), images=m.Images(b"\0", 1, 2, [[2, 2]], [0], ["d", 3])))
    with pytest.raises(m.ProtocolError, match=r"digests\[1\]: expected str, got int"):
        m.decode(obj, m.TO_WORKER)


def _ids(n: int) -> list[int]:
    """n ids over the whole int32 range, its ends included, and ids whose bytes differ from each other's."""
    import random
    rng = random.Random(n)
    ends = [0, 1, 255, 256, 65_535, 65_536, (1 << 31) - 1]
    return (ends + [rng.randrange(1 << 31) for _ in range(n)])[:n]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 16_001])
def test_ids_round_trip_exactly(n):
    """The prompt's ids as int32 little-endian bytes (`pack_ids` / `unpack_ids`) come back equal, in order, as a
    list of ints, at odd sizes, through the whole message and the stream decoder."""
    ids = _ids(n)
    packed = m.pack_ids(ids)
    assert len(packed) == 4 * n and m.unpack_ids(packed) == ids and type(m.unpack_ids(packed)) is list
    msg = m.Generate("r", ids, m.SamplingParams(max_tokens=3), keep_at=[n // 2])
    u = m.unpacker()
    u.feed(m.encode(msg) * 2)           # two messages back to back: each one ends where its bytes say
    got = [m.decode(o, m.TO_WORKER) for o in u]
    assert got == [msg, msg] and type(got[0].prompt_ids) is list


@pytest.mark.parametrize("broken", ["big-endian", "int64", "int16"])
def test_must_fail_ids_packed_otherwise_are_caught(broken):
    """The twin: ids packed with the wrong byte order or width, fed to the real decoder, do not come back equal
    (or are refused), so the round trip's check above has teeth."""
    import array
    import sys
    ids = _ids(16_001)
    code = {"big-endian": "i", "int64": "q", "int16": "h"}[broken]
    a = array.array(code, [i & 0x7FFF for i in ids] if code == "h" else ids)
    if broken == "big-endian" or sys.byteorder != "little":
        a.byteswap()
    obj = {**wire(m.Generate("r", ids, m.SamplingParams())), "prompt_ids": a.tobytes()}
    try:
        got = m.decode(obj, m.TO_WORKER).prompt_ids
    except m.ProtocolError as e:
        assert "whole number of int32 ids" in str(e)      # int16 of an odd count: 32,002 bytes
        return
    assert got != ids


def test_ids_that_are_not_int32_are_refused():
    """An odd byte count is named on decode; an id outside int32 cannot be packed (the launcher's dispatch then
    fails that one request, server/worker_client.py)."""
    obj = {**wire(m.Generate("r", [1, 2], m.SamplingParams())), "prompt_ids": b"\0" * 7}
    with pytest.raises(m.ProtocolError, match="generate.prompt_ids: 7 bytes is not a whole number of int32 ids"):
        m.decode(obj, m.TO_WORKER)
    for bad in (1 << 31, -(1 << 31) - 1):
        with pytest.raises(OverflowError):
            m.encode(m.Generate("r", [1, bad], m.SamplingParams()))
    with pytest.raises(TypeError):
        m.encode(m.Generate("r", [1, 1.5], m.SamplingParams()))
