"""Constrained decoding end to end: SamplingParams.structured_outputs through
the engine core, ``LLM`` and ``AsyncLLM``, on the random-weight ``tiny`` model.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.to_thread
import attrs
import jsonschema
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from structllm import LLM
from structllm.config import EngineConfig
from structllm.core.engine_core import EngineCore
from structllm.core.request import CoreRequest
from structllm.core.structured import StructuredOutputManager
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.protocol import decode, encode
from structllm.errors import InvalidRequestError
from structllm.model.sampler import Sampler, SamplingRow
from structllm.params import SamplingParams
from structllm.structured import StructuredOutputs
from structllm.text import ByteTokenizer
from tests.strategies import json_schemas

# --- the field and the wire -------------------------------------------------

CONSTRAINTS = [
    StructuredOutputs(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    ),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"[a-z]{2,5}\d"),
    StructuredOutputs(choice=["yes", "no", "maybe"]),
    StructuredOutputs(grammar='start: "a" start | "b"'),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_structured_outputs_round_trip_the_core_socket(
    constraint: StructuredOutputs,
) -> None:
    params = SamplingParams(max_tokens=9, seed=3, structured_outputs=constraint)
    request = CoreRequest(request_id="r#0", prompt_token_ids=(1, 2), params=params)
    back = decode(encode(request)[4:])
    assert isinstance(back, CoreRequest)
    assert back.params == params
    so = back.params.structured_outputs
    assert isinstance(so, StructuredOutputs)
    assert so.key == constraint.key
    assert so.kind == constraint.kind


def test_plain_params_still_round_trip_without_a_constraint() -> None:
    request = CoreRequest(
        request_id="r", prompt_token_ids=(1,), params=SamplingParams()
    )
    back = decode(encode(request)[4:])
    assert isinstance(back, CoreRequest)
    assert back.params.structured_outputs is None


@pytest.mark.parametrize("value", [{"json": {}}, "json", 3])
def test_structured_outputs_must_be_the_type(value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.field == "structured_outputs"


# --- the sampler ---------------------------------------------------------------


def _bitmask(allowed: list[set[int]], vocab: int) -> npt.NDArray[np.int32]:
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), dtype=np.uint8)
    for i, ids in enumerate(allowed):
        bits[i, sorted(ids)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_the_grammar_mask_comes_before_every_other_logit_change() -> None:
    """top-k keeps the best *allowed* tokens (were it applied first, the raw
    top tokens, all forbidden here, would leave nothing); logit_bias cannot
    revive a forbidden token; allowed_token_ids disjoint from the grammar
    leave the grammar's best; an unmasked row keeps its tokens and draws."""
    vocab = 40
    logits = np.random.default_rng(0).standard_normal((4, vocab), dtype=np.float32)
    worst = [int(t) for t in np.argsort(logits[3])[:6]]  # allowed in row 3
    top2 = {worst[-1], worst[-2]}
    seen = set()
    for seed in range(20):
        rows = [
            SamplingRow(SamplingParams(temperature=0, logit_bias={3: 100}), gen(0)),
            SamplingRow(SamplingParams(seed=1), gen(seed)),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[30]), gen(2)),
            SamplingRow(SamplingParams(temperature=100.0, top_k=2), gen(seed)),
        ]
        plain = Sampler().sample(
            logits[[1]], [attrs.evolve(rows[1], generator=gen(seed))]
        )
        out = Sampler().sample(
            logits,
            rows,
            bitmask=_bitmask([{5, 6}, {7, 8, 9}, set(worst)], vocab),
            bitmask_rows=[0, 2, 3],
        )
        assert out.token_ids[0] == (5 if logits[0, 5] > logits[0, 6] else 6)
        assert out.token_ids[1] == plain.token_ids[0]
        assert out.token_ids[2] == 7 + int(np.argmax(logits[2, 7:10]))
        assert out.token_ids[3] in top2
        seen.add(int(out.token_ids[3]))
    assert seen == top2


def gen(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# --- end to end: LLM ------------------------------------------------------------

ENGINE: dict[str, Any] = {"max_model_len": 512}
#: near-uniform over what the grammar allows: a random-weight model otherwise
#: repeats one digit of an unbounded number until max_tokens
HOT = 10.0

#: unconstrained requests batched with the constrained ones
FREE_PROMPTS = ["hello", "The sky is", "{"]
FREE = [
    SamplingParams(max_tokens=24, seed=7),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=24, seed=8, top_k=20, top_p=0.9, temperature=0.8),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", show_progress=False, **ENGINE)


@pytest.fixture(scope="module")
def free_reference(llm: LLM) -> list[list[int]]:
    """The unconstrained requests' tokens, each run alone."""
    return [
        list(llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids)
        for p, params in zip(FREE_PROMPTS, FREE, strict=True)
    ]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_idle(llm: LLM) -> None:
    core = llm.core
    assert not core.has_unfinished_requests()
    assert core.pool.num_used == 0
    assert core.structured.num_compiling == 0


@settings(
    max_examples=8,  # x 25 schemas: 200 per run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    schemas=st.lists(json_schemas, min_size=25, max_size=25),
    seed=st.integers(0, 2**32 - 1),
)
def test_generated_schemas_validate_batched_with_free_requests(
    llm: LLM,
    free_reference: list[list[int]],
    schemas: list[dict[str, Any]],
    seed: int,
) -> None:
    constrained = [
        SamplingParams(
            max_tokens=400,
            temperature=HOT,
            seed=seed + i,
            structured_outputs=StructuredOutputs(json=schema),
        )
        for i, schema in enumerate(schemas)
    ]
    prompts = [f"{i}: " for i in range(len(schemas))]
    outs = run(llm, [*FREE_PROMPTS, *prompts], [*FREE, *constrained])
    for out, expected in zip(outs, free_reference, strict=False):
        assert list(out.token_ids) == expected
    for out, schema in zip(outs[len(FREE) :], schemas, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert_idle(llm)


def _balanced(text: str) -> bool:
    """A sentence of ``start: "(" start ")" | "x"``."""
    depth = len(text) - len(text.lstrip("("))
    return text == "(" * depth + "x" + ")" * depth


#: (constraint, check, extra params): a random model in a free-form grammar
#: (any JSON object) writes strings for ever; logit_bias ends them sooner
CASES: dict[str, tuple[StructuredOutputs, Callable[[str], bool], dict[str, Any]]] = {
    "regex": (
        StructuredOutputs(regex=r"[a-z]{2,6}-\d{1,3}"),
        lambda t: re.fullmatch(r"[a-z]{2,6}-\d{1,3}", t) is not None,
        {},
    ),
    "choice": (
        StructuredOutputs(choice=["red", "green", "blue é"]),
        lambda t: t in ("red", "green", "blue é"),
        {},
    ),
    "lark-recursive": (
        StructuredOutputs(grammar='start: "(" start ")" | "x"'),
        _balanced,
        {},
    ),
    "lark-regex-terminal": (
        StructuredOutputs(grammar='start: item ("," item)*\nitem: /[a-c]{1,3}/'),
        lambda t: re.fullmatch(r"[a-c]{1,3}(,[a-c]{1,3})*", t) is not None,
        {},
    ),
    "gbnf": (
        StructuredOutputs(grammar='root ::= "yes" | "no"'),
        lambda t: t in ("yes", "no"),
        {},
    ),
    "json_object": (
        StructuredOutputs(json_object=True),
        lambda t: isinstance(json.loads(t), dict),
        {"logit_bias": {ord('"'): 30, ord("}"): 30, ord(","): 20}},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_regex_choice_grammar_and_json_object(
    llm: LLM, free_reference: list[list[int]], case: str
) -> None:
    constraint, check, extra = CASES[case]
    params = [
        SamplingParams(
            max_tokens=300,
            temperature=HOT,
            seed=s,
            structured_outputs=constraint,
            **extra,
        )
        for s in range(8)
    ]
    outs = run(llm, [*FREE_PROMPTS, *["ab"] * len(params)], [*FREE, *params])
    assert [list(o.token_ids) for o in outs[: len(FREE)]] == free_reference
    for out in outs[len(FREE) :]:
        assert out.finish_reason == "stop", out.text
        assert check(out.text), out.text
    assert_idle(llm)


def test_greedy_choice_ends_without_eos(llm: LLM) -> None:
    """A grammar nothing can extend finishes at its last token: no EOS needed."""
    (out,) = run(
        llm,
        ["x"],
        [
            SamplingParams(
                temperature=0, structured_outputs=StructuredOutputs(choice=["ok"])
            )
        ],
    )
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("ok", "stop", 2)


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs(json={"type": "wat"}),
        StructuredOutputs(json={"type": "string", "minLength": 5, "maxLength": 2}),
        StructuredOutputs(regex="(?=a)b"),
        StructuredOutputs(grammar="start: undefined_rule"),
    ],
    ids=lambda c: c.field,
)
def test_a_refused_spec_names_its_field_at_admission(
    llm: LLM, free_reference: list[list[int]], constraint: StructuredOutputs
) -> None:
    bad = SamplingParams(structured_outputs=constraint)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([*FREE_PROMPTS, "x"], [*FREE, bad], use_tqdm=False)
    assert info.value.field == constraint.field
    assert str(info.value).startswith(f"{constraint.field}: cannot compile")
    assert_idle(llm)  # nothing reached the core
    outs = run(llm, FREE_PROMPTS, FREE)
    assert [list(o.token_ids) for o in outs] == free_reference


def core_tokens(core: EngineCore) -> tuple[dict[str, list[int]], list[Any]]:
    """Step ``core`` until idle: tokens by request id, and the rejections."""
    tokens: dict[str, list[int]] = {}
    rejected = []
    while core.has_unfinished_requests():
        step = core.step()
        rejected += step.rejected
        for o in step.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, rejected


def test_a_spec_refused_in_the_core_drops_that_request_alone(
    free_reference: list[list[int]],
) -> None:
    """Past the front end's check (a caller of EngineCore itself), the
    compile thread's refusal drops the request unrun, reported in the step
    output naming the field; the others run as if it never came."""
    core = EngineCore(EngineConfig(model="tiny-random", **ENGINE))
    tok = ByteTokenizer()
    for i, (prompt, params) in enumerate(zip(FREE_PROMPTS, FREE, strict=True)):
        core.add_request(
            CoreRequest(
                request_id=f"free{i}",
                prompt_token_ids=tuple(tok.encode(prompt)),
                params=params,
            )
        )
    core.add_request(
        CoreRequest(
            request_id="bad",
            prompt_token_ids=(1, 2),
            params=SamplingParams(structured_outputs=StructuredOutputs(regex="(?=a)b")),
        )
    )
    tokens, rejected = core_tokens(core)
    assert [(r.request_id, r.field) for r in rejected] == [
        ("bad", "structured_outputs.regex")
    ]
    assert "look-around" in rejected[0].message
    assert [tokens[f"free{i}"] for i in range(len(FREE))] == free_reference
    assert "bad" not in tokens
    assert core.pool.num_used == 0 and core.structured.num_compiling == 0
    core.close()
    assert not [t for t in threading.enumerate() if "grammar" in t.name]


BOUNDED = StructuredOutputs(
    json={
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
)


def test_seeded_constrained_request_is_batch_independent(llm: LLM) -> None:
    """The same seeded constrained request gives the same tokens alone and
    batched with other constrained and free requests."""
    mine = [
        SamplingParams(max_tokens=200, temperature=t, seed=99, structured_outputs=so)
        for t, so in [(1.5, BOUNDED), (HOT, BOUNDED), (0.7, CASES["regex"][0])]
    ]
    alone = [run(llm, ["q"], [p])[0] for p in mine]
    others = [
        SamplingParams(
            max_tokens=200, temperature=HOT, seed=i, structured_outputs=BOUNDED
        )
        for i in range(6)
    ]
    batched = run(
        llm,
        [*FREE_PROMPTS, "q", "zz", "q", "y", "q", *["w"] * len(others)],
        [*FREE, mine[0], FREE[0], mine[1], FREE[2], mine[2], *others],
    )
    got = [batched[3], batched[5], batched[7]]
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in alone]
    assert alone[0].finish_reason == "stop"


def test_preemption_keeps_the_grammar_state() -> None:
    """Preempted by recompute, a constrained request keeps its accepted
    tokens and its matcher (which has accepted exactly them): its output is
    the one it gives without preemption."""
    params = [
        SamplingParams(
            max_tokens=120, temperature=HOT, seed=s, structured_outputs=BOUNDED
        )
        for s in range(6)
    ]
    prompts = [f"prompt {s} " * 3 for s in range(6)]
    roomy = LLM("tiny-random", show_progress=False, max_model_len=128)
    expected = [list(o.token_ids) for o in run(roomy, prompts, params)]
    tight = LLM(
        "tiny-random",
        show_progress=False,
        max_model_len=128,
        num_blocks=10,
        block_size=16,
    )
    outs = run(tight, prompts, params)
    assert tight.core.scheduler.total_preemptions > 0
    assert [list(o.token_ids) for o in outs] == expected
    schema = BOUNDED.json_schema()
    for out in outs:
        jsonschema.validate(json.loads(out.text), schema)
    assert_idle(tight)


def test_min_tokens_cannot_extend_a_complete_grammar(llm: LLM) -> None:
    """min_tokens masks EOS while the grammar could go on (``[ab]+`` gets at
    least min_tokens tokens); once nothing but EOS may follow, the request
    stops anyway ("stop", fewer tokens than min_tokens); ignore_eos alike."""
    grow = SamplingParams(
        max_tokens=50,
        min_tokens=12,
        temperature=HOT,
        seed=1,
        structured_outputs=StructuredOutputs(regex="[ab]+"),
        logit_bias={257: 100},  # EOS, as soon as it is allowed
    )
    done = SamplingParams(
        min_tokens=12, structured_outputs=StructuredOutputs(choice=["yes"])
    )
    ignoring = attrs.evolve(done, ignore_eos=True, min_tokens=0)
    a, b, c = run(llm, ["x", "x", "x"], [grow, done, ignoring])
    assert re.fullmatch("[ab]+", a.text) and a.finish_reason == "stop"
    assert len(a.token_ids) == 13  # 12 letters, then the first EOS allowed
    assert (b.text, b.finish_reason, len(b.token_ids)) == ("yes", "stop", 3)
    assert (c.text, c.finish_reason) == ("yes", "stop")


def test_max_tokens_mid_structure_is_length(llm: LLM) -> None:
    long = StructuredOutputs(json={"type": "string", "minLength": 40})
    (out,) = run(llm, ["x"], [SamplingParams(max_tokens=5, structured_outputs=long)])
    assert (out.finish_reason, len(out.token_ids)) == ("length", 5)
    assert out.text.startswith('"')
    assert_idle(llm)


# --- compiling off the step loop, and cancellation -------------------------------


class SlowCompiles:
    """Holds every grammar compile until ``release`` is set (a test hook on
    the core's compile threads, which run in this process)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.managers: list[StructuredOutputManager] = []
        real = StructuredOutputManager._compile

        def slow(manager: StructuredOutputManager, so: StructuredOutputs) -> Any:
            self.managers.append(manager)
            self.entered.set()
            assert self.release.wait(30)
            return real(manager, so)

        monkeypatch.setattr(StructuredOutputManager, "_compile", slow)

    def __enter__(self) -> SlowCompiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()  # a failing test must not leave a compile hanging


def test_a_compiling_grammar_delays_nobody_and_abort_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, free_reference: list[list[int]]
) -> None:
    slow = SlowCompiles(monkeypatch)
    core = EngineCore(EngineConfig(model="tiny-random", **ENGINE))
    with slow:
        _compile_meanwhile(core, slow, free_reference)
    core.close()


def _compile_meanwhile(
    core: EngineCore, slow: SlowCompiles, free_reference: list[list[int]]
) -> None:
    tok = ByteTokenizer()
    constrained = SamplingParams(
        max_tokens=100, temperature=HOT, seed=3, structured_outputs=BOUNDED
    )
    for rid in ("waits", "aborted"):
        core.add_request(
            CoreRequest(request_id=rid, prompt_token_ids=(5, 6), params=constrained)
        )
    core.add_request(
        CoreRequest(
            request_id="free",
            prompt_token_ids=tuple(tok.encode(FREE_PROMPTS[0])),
            params=FREE[0],
        )
    )
    assert slow.entered.wait(10)
    free: list[int] = []
    while len(free) < len(free_reference[0]):  # runs to the end meanwhile
        step = core.step()
        assert {o.request_id for o in step.outputs} == {"free"}
        free += step.outputs[0].new_token_ids
        assert core.scheduler.statistics().num_waiting == 2
    assert free == free_reference[0]
    assert core.structured.num_compiling == 2
    core.abort_requests(["aborted"])
    assert core.structured.num_compiling == 1
    slow.release.set()
    tokens, rejected = core_tokens(core)
    assert not rejected and set(tokens) == {"waits"}
    text = tok.decode([t for t in tokens["waits"] if t != 257])
    jsonschema.validate(json.loads(text), BOUNDED.json_schema())
    assert core.structured.num_compiling == 0 and core.pool.num_used == 0
    assert not core.scheduler.requests


def test_a_cached_grammar_needs_no_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    core = EngineCore(EngineConfig(model="tiny-random", **ENGINE))
    params = SamplingParams(max_tokens=8, structured_outputs=CASES["regex"][0])
    core.add_request(CoreRequest(request_id="a", prompt_token_ids=(1,), params=params))
    core_tokens(core)
    slow = SlowCompiles(monkeypatch)  # a compile now would hang the test
    core.add_request(CoreRequest(request_id="b", prompt_token_ids=(1,), params=params))
    assert core.structured.num_compiling == 0
    tokens, _ = core_tokens(core)
    assert tokens["b"] and not slow.entered.is_set()
    compiler = core.structured.compiler
    assert compiler is not None and compiler.statistics().hits == 1
    core.close()


# --- AsyncLLM ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_async_llm(**kw: Any) -> AsyncIterator[AsyncLLM]:
    args = {"executor": "inline", "show_progress": False, **ENGINE, **kw}
    async with AsyncLLM.open("tiny-random", **args) as engine:
        yield engine


async def wait_idle(engine: AsyncLLM) -> None:
    with anyio.fail_after(10):
        stats = await engine.wait_statistics(
            lambda s: s.blocks_used == 0 and s.running == 0 and s.waiting == 0
        )
    assert stats.live_requests == 0


@pytest.mark.anyio
@pytest.mark.parametrize("executor", ["inline", "process"])
async def test_async_llm_streams_constrained_and_free_together(
    llm: LLM, free_reference: list[list[int]], executor: str
) -> None:
    constrained = [
        SamplingParams(
            max_tokens=200, temperature=HOT, seed=s, structured_outputs=BOUNDED
        )
        for s in range(4)
    ]
    expected = [list(o.token_ids) for o in run(llm, ["q"] * 4, constrained)]
    results: dict[int, list[int]] = {}

    async def one(i: int, prompt: str, params: SamplingParams) -> None:
        out = await engine.complete(prompt, params)
        results[i] = list(out.token_ids)
        if params.structured_outputs is not None:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), BOUNDED.json_schema())

    async with open_async_llm(executor=executor) as engine:
        async with anyio.create_task_group() as tg:
            for i, (prompt, params) in enumerate(
                [
                    *zip(FREE_PROMPTS, FREE, strict=True),
                    *(("q", p) for p in constrained),
                ]
            ):
                tg.start_soon(one, i, prompt, params)
        await wait_idle(engine)
    assert [results[i] for i in range(len(FREE))] == free_reference
    assert [results[len(FREE) + i] for i in range(4)] == expected


@pytest.mark.anyio
async def test_async_llm_refuses_a_bad_spec_at_entry_while_others_stream(
    free_reference: list[list[int]],
) -> None:
    async with open_async_llm() as engine:
        async with engine.stream(FREE_PROMPTS[1], FREE[1]) as running:
            got: list[int] = []
            async for out in running:
                got = list(out.token_ids)
                if len(got) == 3:
                    bad = SamplingParams(
                        structured_outputs=StructuredOutputs(regex="(?=x)y")
                    )
                    with pytest.raises(InvalidRequestError) as info:
                        async with engine.stream("x", bad):
                            pytest.fail("a refused spec was admitted")
                    assert info.value.field == "structured_outputs.regex"
                    # what a server asks before promising a streaming 200
                    with pytest.raises(InvalidRequestError) as info:
                        engine.check_admission([1, 2], params=bad)
                    assert info.value.field == "structured_outputs.regex"
        assert got == free_reference[1]
        await wait_idle(engine)


@pytest.mark.anyio
async def test_cancel_while_the_grammar_compiles_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, free_reference: list[list[int]]
) -> None:
    """Leaving the block while the core compiles the request's grammar: the
    abort drops the compile job (its result is not kept for the request),
    no KV block was ever taken, and the engine serves on, meanwhile too;
    the same schema then compiles and constrains the next request."""
    slow = SlowCompiles(monkeypatch)
    params = SamplingParams(
        max_tokens=200, temperature=HOT, seed=5, structured_outputs=BOUNDED
    )
    with slow, anyio.fail_after(60):
        async with open_async_llm() as engine:
            with anyio.CancelScope() as scope:
                async with engine.stream("q", params) as s:
                    assert await anyio.to_thread.run_sync(slow.entered.wait, 10)
                    scope.cancel()
                    async for _ in s:
                        pytest.fail("a token came while the grammar compiled")
            assert scope.cancelled_caught and s.finish_reason == "abort"
            # the core reads the abort before this request, which runs to the
            # end while the aborted request's compile is still held
            out = await engine.complete(FREE_PROMPTS[0], FREE[0])
            assert list(out.token_ids) == free_reference[0]
            (manager,) = slow.managers
            assert manager.num_compiling == 0
            await wait_idle(engine)
            slow.release.set()
            out = await engine.complete("q", params)
            jsonschema.validate(json.loads(out.text), BOUNDED.json_schema())
            assert manager.num_compiling == 0


@pytest.mark.anyio
async def test_cancel_while_the_front_end_checks_the_spec_registers_nothing(
    monkeypatch: pytest.MonkeyPatch, free_reference: list[list[int]]
) -> None:
    """A new spec (one this process never checked: known-good specs skip the
    thread) is checked in a worker thread at admission; cancelling the
    caller meanwhile waits for the check, then raises: nothing registered."""
    import structllm.structured.compiler as compiler

    entered, release = threading.Event(), threading.Event()
    real = compiler.validate

    def slow_validate(constraint: StructuredOutputs, **kw: Any) -> None:
        entered.set()
        release.wait(10)
        real(constraint, **kw)

    monkeypatch.setattr(compiler, "validate", slow_validate)
    params = SamplingParams(
        max_tokens=50,
        structured_outputs=StructuredOutputs(regex=f"{uuid.uuid4().hex}[0-9]"),
    )
    async with open_async_llm() as engine:
        with anyio.CancelScope() as scope:

            async def cancel_once_in_thread() -> None:
                await anyio.to_thread.run_sync(entered.wait, 10)
                scope.cancel()
                release.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_in_thread)
                async with engine.stream("x", params):
                    pytest.fail("the request was admitted after cancellation")
        assert scope.cancelled_caught
        assert engine.statistics().live_requests == 0
        out = await engine.complete(FREE_PROMPTS[0], FREE[0])
        assert list(out.token_ids) == free_reference[0]
        await wait_idle(engine)


@pytest.mark.anyio
async def test_async_llm_fails_a_request_the_core_refuses_alone(
    monkeypatch: pytest.MonkeyPatch, free_reference: list[list[int]]
) -> None:
    """A refusal only the core finds (the front end's check skipped here)
    reaches the caller as InvalidRequestError naming the field, from inside
    the block; a request streaming meanwhile is unaffected."""
    import structllm.structured.compiler as compiler

    monkeypatch.setattr(compiler, "validate", lambda constraint, **kw: None)
    bad = SamplingParams(
        structured_outputs=StructuredOutputs(regex=f"(?={uuid.uuid4().hex})b")
    )
    async with open_async_llm() as engine:
        async with engine.stream(FREE_PROMPTS[1], FREE[1]) as running:
            got: list[int] = []
            async for out in running:
                got = list(out.token_ids)
                if len(got) == 2:
                    with pytest.raises(InvalidRequestError) as info:
                        async with engine.stream("x", bad) as refused:
                            async for _ in refused:
                                pytest.fail("a refused request produced output")
                    assert info.value.field == "structured_outputs.regex"
                    assert "look-around" in str(info.value)
        assert got == free_reference[1]
        await wait_idle(engine)
