"""The wire protocol: every message round-trips, framing, bad frames."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from structllm.config import EngineConfig
from structllm.core.engine_core import RequestStepOutput, StepOutput
from structllm.core.request import CoreRequest
from structllm.engine.frontend.core_connection import encode_request
from structllm.engine.protocol import (
    MAX_FRAME,
    AbortRequests,
    AddFailed,
    Fatal,
    FrameError,
    FrameReader,
    Heartbeat,
    LoadProgressMsg,
    Message,
    Ready,
    Shutdown,
    Start,
    decode,
    encode,
)
from structllm.errors import InvalidRequestError
from structllm.model.sampler import TokenLogprobs
from structllm.params import OutputKind, SamplingParams

PARAMS = SamplingParams(
    max_tokens=7,
    temperature=0.5,
    top_k=-1,
    seed=2**64 - 1,
    stop=["\n", "END"],
    stop_token_ids=[3, 4],
    logit_bias={"5": -1.5},
    allowed_token_ids=[5, 6, 7],
    logprobs=2,
    output_kind="delta",
)

MESSAGES: list[Message] = [
    Start(
        EngineConfig(model="tiny-random", num_blocks=8, max_model_len=64), 0.5, "x:1"
    ),
    CoreRequest(
        request_id="r#0",
        prompt_token_ids=(1, 2, 3),
        params=PARAMS,
        eos_token_ids=frozenset({2, 9}),
        priority=-3,
        arrival_time=1.25,
        cache_salt="tenant",
    ),
    CoreRequest(request_id="plain", prompt_token_ids=(0,), params=SamplingParams()),
    AbortRequests(["a", "b"]),
    Shutdown(),
    LoadProgressMsg("weights", 3, 10),
    Ready(256, 64, 8, 16, [2], 1234),
    StepOutput(
        outputs=(
            RequestStepOutput("a", (5,)),
            RequestStepOutput(
                "b",
                (6,),
                (TokenLogprobs(-0.25, 1, (6, 7), (-0.25, -2.0)),),
                "stop",
                6,
                0.125,
                16,
            ),
            RequestStepOutput("c", (7,), finish_reason="length", stop_reason="END"),
        ),
        num_batched_tokens=40,
        num_seqs=3,
        preempted=("d",),
        total_s=0.01,
        num_running=2,
        num_waiting=1,
        blocks_used=5,
        total_preemptions=4,
    ),
    AddFailed("r#1", "prompt must not be empty", "prompt"),
    Heartbeat(1, 2, 3),
    Fatal("EngineConfigError", "too small", "tb", during_load=True, field="num_blocks"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: Message) -> None:
    frame = encode(msg)
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4
    back = decode(frame[4:])
    assert type(back) is type(msg)
    assert back == msg


def test_sampling_params_arrive_typed_and_equal() -> None:
    request = MESSAGES[1]
    assert isinstance(request, CoreRequest)
    back = decode(encode(request)[4:])
    assert isinstance(back, CoreRequest)
    assert isinstance(back.params, SamplingParams)
    assert back.params == PARAMS
    assert back.params.output_kind is OutputKind.DELTA
    assert back.params.stop == ("\n", "END")
    assert back.params.logit_bias == ((5, -1.5),)
    assert back.eos_token_ids == frozenset({2, 9})
    assert back.prompt_token_ids == (1, 2, 3)


@given(cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_frames_split_anywhere_reassemble(cuts: list[int]) -> None:
    stream = b"".join(encode(m) for m in MESSAGES)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    reader = FrameReader()
    got: list[Message] = []
    last = 0
    for p in [*points, len(stream)]:
        got += reader.feed(stream[last:p])
        last = p
    assert got == MESSAGES


def test_a_frame_over_the_limit_is_refused_from_its_header() -> None:
    with pytest.raises(FrameError, match="exceeds the limit"):
        FrameReader().feed(struct.pack(">I", MAX_FRAME + 1))


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never valid msgpack
        b"\x93\x01\x02\x03",  # an array, not a tagged message
        b"\x81\xa4type\xa6Nobody",  # an unknown tag
        # a CoreRequest whose prompt is not a list of ints
        b"\x84\xa4type\xabCoreRequest\xaarequest_id\xa1r"
        b"\xb0prompt_token_ids\xa3abc\xa6params\x80",
    ],
)
def test_bad_frames_raise_frame_error(body: bytes) -> None:
    with pytest.raises(FrameError):
        FrameReader().feed(struct.pack(">I", len(body)) + body)


def test_invalid_sampling_params_in_a_frame_are_refused() -> None:
    """Decoding runs SamplingParams' own checks: a bad value never gets in."""
    good = encode(CoreRequest(request_id="r", prompt_token_ids=(1,), params=PARAMS))
    bad = good.replace(b"\xabtemperature\xcb?\xe0", b"\xabtemperature\xcb\xbf\xe0")
    assert bad != good  # temperature 0.5 -> -0.5
    with pytest.raises(FrameError, match="temperature"):
        decode(bad[4:])


def test_a_request_the_wire_cannot_carry_fails_alone() -> None:
    request = CoreRequest(
        request_id="r", prompt_token_ids=(2**70,), params=SamplingParams()
    )
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        encode_request(request)
