"""LoRA under tensor parallelism: each rank runs its share of the adapters.

Rank 0's adapter manager fills the slots; each step, after the step's
input, the followers get the slot changes since the last (they read their
own share of each adapter from its directory) and the step's rows
(``core.lora_manager.FollowedSlots``, ``engine.rank_group``). Two gloo
ranks over tests/data/lora/llama-base give the greedy tokens, and the
logprobs, of one, for a batch mixing three adapters and the base model
over two slots (so slots change hands mid-run), and after an unload.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import msgspec
import numpy as np
import pytest

from structllm import LLM, LoRARequest, SamplingParams
from structllm.core.lora_manager import FollowedSlots, LoRAManager, SlotChange
from structllm.engine.frontend.async_llm import AsyncLLM
from structllm.engine.rank_group.protocol import RankMessage, StepLoRA, frame
from structllm.model._paddle import paddle
from structllm.outputs import RequestOutput
from tests.test_lora_core import FakeSlots, _lora, _reader
from tests.test_lora_engine import ADAPTERS, DATA, _prompts

LORAS = [LoRARequest(n, i + 1, str(DATA / n)) for i, n in enumerate(ADAPTERS)]
ENGINE: dict[str, Any] = {
    "enable_lora": True,
    "max_loras": 2,
    "max_cpu_loras": 4,  # the unload below finds its adapter on the host
    "max_lora_rank": 8,
    "block_size": 4,
    "num_blocks": 96,
    "max_num_seqs": 8,
    "model_backend": "eager",
}
#: each step's chosen token and its logprob: numbers, not only ids
SCORED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _summary(out: RequestOutput) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    assert c.logprobs is not None
    ids = list(c.token_ids)
    return ids, [lp[t].logprob for t, lp in zip(ids, c.logprobs, strict=True)]


# -- rank 0's side, without processes ------------------------------------------


@attrs.define
class _Followers:
    sent: list[tuple[list[SlotChange], np.ndarray | None]] = attrs.Factory(list)

    def send_lora(self, changes: Sequence[SlotChange], rows: np.ndarray | None) -> None:
        self.sent.append((list(changes), rows))


@attrs.define(eq=False)
class _Slots(FakeSlots):
    rows: Any = None

    def set_rows(self, rows: Any) -> None:
        self.rows = rows


def test_each_steps_rows_carry_the_slot_changes_since_the_last() -> None:
    followers = _Followers()
    local = _Slots(2)
    slots = FollowedSlots(local, followers)
    m = LoRAManager(slots, _reader([]), record_changes=True)
    slots.changes = m.take_changes
    for n in (1, 2, 3):
        m.add(_lora(n))
    s1, s2 = m.slot_for(1), m.slot_for(2)
    assert s1 is not None and s2 is not None
    slots.set_rows([s1, -1, s2])
    s3 = m.slot_for(3, busy={1})  # takes 2's slot
    assert s3 == s2
    m.remove(1)  # idle: its slot is emptied at once
    slots.set_rows(None)
    slots.set_rows(None)
    [(first, rows), (second, none), (third, _)] = followers.sent
    assert first == [SlotChange(s1, 1, "/ad/1"), SlotChange(s2, 2, "/ad/2")]
    assert rows is not None and rows.tolist() == [s1, -1, s2]
    assert second == [SlotChange(s3, 3, "/ad/3"), SlotChange(s1, 1, None)]
    assert local.rows is None  # rank 0's own slots got the rows too
    assert none is None and third == []
    # rank 0's own slots changed as the followers are told
    held = [h.source if h else None for h in local.held]
    assert held[s3] == "/ad/3" and held[s1] is None
    # and the message survives its framing
    msg = StepLoRA(tuple((c.slot, c.path) for c in second), rows.tobytes())
    body = frame(msg)[4:]
    back = msgspec.msgpack.Decoder(RankMessage).decode(body)
    assert isinstance(back, StepLoRA) and back == msg and back.rows is not None
    assert np.frombuffer(back.rows, np.int64).tolist() == [s1, -1, s2]


def test_rank_0_keeps_its_share_and_keys_the_whole_adapter() -> None:
    from structllm.config import EngineConfig
    from structllm.core.lora_manager import adapter_digest, enable_model_lora
    from structllm.model.lora import read_peft_adapter
    from structllm.model.parallel import load_model_shard

    path = str(DATA / "llama-base")
    config = EngineConfig(
        model=path,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        tensor_parallel_size=2,
    )
    loaded = load_model_shard(path, 2, 0, backend="eager", block_size=4)
    followers = _Followers()
    m = enable_model_lora(loaded.model, config, followers)
    lora = LORAS[1]  # every projection
    m.add(lora)
    slot = m.slot_for(lora.lora_int_id)
    assert slot is not None
    m.rows([lora.lora_int_id])
    assert isinstance(m.slots, FollowedSlots)
    m.slots.set_rows([slot])
    [(changes, _)] = followers.sent
    assert changes == [SlotChange(slot, lora.lora_int_id, lora.lora_path)]
    whole = read_peft_adapter(lora.lora_path, loaded.config)
    o_proj = "model.layers.0.self_attn.o_proj"
    held = m.slots.local.adapters[slot]  # type: ignore[attr-defined]
    # o is row-parallel: rank 0 holds its half of A's input columns
    assert (
        held.projections[o_proj].a.shape[1] * 2 == whole.projections[o_proj].a.shape[1]
    )
    # the prefix cache's key is the whole adapter's, as on one rank: two
    # adapters equal on rank 0's share only never share blocks
    assert m.cache_key(lora.lora_int_id) == adapter_digest(whole)
    m.audit()


# -- two ranks -------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # two interpreters each
@pytest.mark.skipif(
    not hasattr(paddle.base.core, "ProcessGroupGloo"),
    reason="this Paddle build has no gloo (CPU) backend",
)
async def test_two_ranks_with_adapters_give_the_tokens_of_one(bpe_dir: Path) -> None:
    prompts = _prompts(4)
    choices: list[LoRARequest | None] = [*LORAS, None]
    one = LLM(
        str(DATA / "llama-base"), tokenizer=str(bpe_dir), show_progress=False, **ENGINE
    )
    # each alone on one rank
    alone = [
        _summary(one.generate([p], SCORED, lora_request=c, use_tqdm=False)[0])
        for p, c in zip(prompts, choices, strict=True)
    ]
    async with AsyncLLM.open(
        str(DATA / "llama-base"),
        tokenizer=str(bpe_dir),
        tensor_parallel_size=2,
        show_progress=False,
        **ENGINE,
    ) as two:
        results: list[tuple[list[int], list[float]] | None] = [None] * 4

        async def run(i: int) -> None:
            out = await two.complete(prompts[i], SCORED, lora_request=choices[i])
            results[i] = _summary(out)

        # together: three adapters over two slots, and the base model
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(run, i)
        # then with one unloaded (its slot emptied on every rank) and read
        # again by the request that names it
        assert await two.remove_lora(LORAS[0].lora_int_id)
        again = _summary(await two.complete(prompts[0], SCORED, lora_request=LORAS[0]))
        [state] = await two.inspect_cores()
        assert state is not None and state.blocks_used == 0
    for got, (want_ids, want_lps) in zip(results, alone, strict=True):
        assert got is not None
        ids, lps = got
        assert ids == want_ids
        np.testing.assert_allclose(lps, want_lps, atol=1e-4)
    assert again[0] == alone[0][0]
    np.testing.assert_allclose(again[1], alone[0][1], atol=1e-4)
    # the adapters do change the output: a rank that skipped its share would show
    assert len({round(lps[0], 4) for _, lps in alone}) == 4
