"""LoRA in the engine's lower layers: ``LoRARequest``, the config fields, the
prefix cache's adapter key and the core's adapter registry
(``core/lora_manager.py``).

Adapters are the PEFT files of tests/data/lora (written by
tools/record_lora_oracle.py) and copies of them with other random weights.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import safetensors.numpy

from structllm.config import EngineConfig, ServerConfig, add_arguments, from_arguments
from structllm.core.block_pool import ROOT_HASH, BlockPool, hash_block_tokens, root_hash
from structllm.core.lora_manager import NO_LORA, LoRAManager, SlotChange
from structllm.core.request import Request
from structllm.core.scheduler import Scheduler, SchedulerConfig
from structllm.errors import EngineConfigError, InvalidRequestError, ModelLoadError
from structllm.lora_request import LoRARequest
from structllm.model.llama import LlamaForCausalLM
from structllm.model.loader import load_model
from structllm.model.lora import enable_lora, read_peft_adapter
from structllm.model.lora_peft import WEIGHTS_FILE, LoRAAdapter
from structllm.params import SamplingParams

DATA = Path(__file__).parent / "data" / "lora"

# -- LoRARequest ---------------------------------------------------------------


def test_lora_request_is_vllms_and_checks_its_fields(tmp_path: Path) -> None:
    r = LoRARequest("sql", 1, "/adapters/sql")
    assert (r.name, r.adapter_id, r.path) == ("sql", 1, "/adapters/sql")
    assert r == LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/adapters/sql")
    assert LoRARequest("p", 2, tmp_path).lora_path == str(tmp_path)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        r.lora_int_id = 2  # type: ignore[misc]
    bad: list[tuple[Any, Any, Any, str]] = [
        ("", 1, "/a", "lora_name"),
        ("  ", 1, "/a", "lora_name"),
        (3, 1, "/a", "lora_name"),
        ("a", 0, "/a", "lora_int_id"),
        ("a", -1, "/a", "lora_int_id"),
        ("a", True, "/a", "lora_int_id"),
        ("a", 1.0, "/a", "lora_int_id"),
        ("a", 2**63, "/a", "lora_int_id"),
        ("a", 1, "", "lora_path"),
        ("a", 1, None, "lora_path"),
    ]
    for name, lora_id, path, field in bad:
        with pytest.raises(InvalidRequestError, match=field) as info:
            LoRARequest(name, lora_id, path)
        assert info.value.field == f"lora_request.{field}"


# -- configuration -------------------------------------------------------------


def test_lora_settings_and_their_flags() -> None:
    config = EngineConfig(model="m", enable_lora=True, max_loras=3, max_lora_rank=8)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (
        True,
        3,
        8,
    )
    assert not EngineConfig(model="m").enable_lora
    for field in ("max_loras", "max_lora_rank"):
        with pytest.raises(EngineConfigError) as info:
            EngineConfig(model="m", **{field: 0})  # type: ignore[arg-type]
        assert info.value.field == field
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServerConfig)
    # vLLM's form (several after one flag) and the repeated flag, together
    ns = parser.parse_args(
        ["--lora-modules", "a=/x", "b=/y=z", "--lora-modules", "c=/w"]
    )
    server = from_arguments(ServerConfig, ns, model_name="m")
    assert server.lora_modules == ("a=/x", "b=/y=z", "c=/w")
    assert ServerConfig(model_name="m").lora_modules == ()
    for modules, match in [
        (("a",), "'a' is not NAME=PATH"),
        (("=/x",), "is not NAME=PATH"),
        (("a=",), "is not NAME=PATH"),
        (("a=/x", "a=/y"), "the name 'a' is given twice"),
    ]:
        with pytest.raises(EngineConfigError, match=match) as e:
            ServerConfig(model_name="m", lora_modules=modules)
        assert e.value.field == "lora_modules"


def test_max_cpu_loras_is_vllms_and_becomes_a_flag() -> None:
    assert EngineConfig(model="m").max_cpu_loras is None  # as many as max_loras
    config = EngineConfig(model="m", max_loras=2, max_cpu_loras=2)
    assert config.max_cpu_loras == 2
    for bad, match in [(0, "max_cpu_loras"), (1, r"max_cpu_loras \(1\) must be >=")]:
        with pytest.raises(EngineConfigError, match=match) as info:
            EngineConfig(model="m", max_loras=2, max_cpu_loras=bad)
        assert info.value.field == "max_cpu_loras"
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    ns = parser.parse_args(["--max-loras", "2", "--max-cpu-loras", "5"])
    assert from_arguments(EngineConfig, ns, model="m").max_cpu_loras == 5
    ns = parser.parse_args([])
    assert from_arguments(EngineConfig, ns, model="m").max_cpu_loras is None


# -- the prefix cache's key ----------------------------------------------------


def test_an_adapter_puts_blocks_in_its_own_hash_space() -> None:
    a, b = bytes(16), bytes([1] * 16)
    roots = [
        root_hash(None),
        root_hash("t"),
        root_hash(None, a),
        root_hash(None, b),
        root_hash("t", a),
        root_hash("u", a),
    ]
    assert len(set(roots)) == len(roots)
    assert root_hash(None) == ROOT_HASH  # unchanged without an adapter
    assert root_hash("t", a) == root_hash("t", a)
    assert hash_block_tokens(root_hash(None, a), [1, 2]) != hash_block_tokens(
        ROOT_HASH, [1, 2]
    )


# -- the core's registry, over slots that record what they hold ----------------


@attrs.define(eq=False)
class FakeSlots:
    """A model's slots as the manager sees them: what each holds."""

    max_loras: int
    max_rank: int = 8
    held: list[LoRAAdapter | None] = attrs.field(init=False)
    loads: int = 0

    def __attrs_post_init__(self) -> None:
        self.held = [None] * self.max_loras

    def check_adapter(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ModelLoadError(f"{adapter.source}: r={adapter.rank} is over")

    def load_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        self.check_adapter(adapter)
        self.held[slot] = adapter
        self.loads += 1

    def clear_slot(self, slot: int) -> None:
        self.held[slot] = None

    def set_rows(self, rows: Any) -> None:
        raise AssertionError("the runner's, not the manager's")


def _fake_adapter(path: str, rank: int = 4) -> LoRAAdapter:
    """An adapter whose one matrix is seeded by its path: equal paths, equal
    weights (the directory ``same-as-X`` reads as ``X``)."""
    from structllm.model.lora_peft import fuse_pieces

    source = path.removeprefix("same-as-").encode()
    rng = np.random.default_rng(list(source))
    a = rng.standard_normal((rank, 6)).astype(np.float32)
    b = rng.standard_normal((6, rank)).astype(np.float32)
    p = fuse_pieces([(a, b)], [6], 1.0)
    return LoRAAdapter(source=path, rank=rank, scale=1.0, projections={"m": p})


def _reader(reads: list[str]) -> Any:
    def read(path: str) -> LoRAAdapter:
        reads.append(path)
        if "broken" in path:
            raise ModelLoadError(f"{path}/{WEIGHTS_FILE}: tensor x is cut short")
        return _fake_adapter(path, rank=16 if "big" in path else 4)

    return read


def _manager(max_loras: int = 2) -> tuple[LoRAManager, FakeSlots, list[str]]:
    slots, reads = FakeSlots(max_loras), list[str]()
    return LoRAManager(slots, _reader(reads), record_changes=True), slots, reads


def _lora(n: int, path: str | None = None) -> LoRARequest:
    return LoRARequest(f"a{n}", n, path or f"/ad/{n}")


def test_adapters_are_read_once_per_id_and_refused_when_they_clash() -> None:
    m, _, reads = _manager()
    assert m.add(_lora(1))
    assert not m.add(_lora(1))  # known: not read again
    assert reads == ["/ad/1"]
    clashes = [
        (_lora(1, "/elsewhere"), "id 1 is 'a1' from '/ad/1', not 'a1' from"),
        (LoRARequest("b", 1, "/ad/1"), "id 1 is 'a1'"),
    ]
    for request, match in clashes:
        with pytest.raises(InvalidRequestError, match=match) as info:
            m.add(request)
        assert info.value.field == "lora_request"
    # unreadable, or not fitting the slots: refused, nothing kept
    with pytest.raises(ModelLoadError, match="tensor x is cut short"):
        m.add(_lora(3, "/broken"))
    with pytest.raises(ModelLoadError, match="r=16 is over"):
        m.add(_lora(4, "/big"))
    assert [i.request.lora_int_id for i in m.adapters()] == [1]
    m.audit()


def test_slots_fill_on_demand_and_evict_the_least_recently_used_idle_one() -> None:
    m, slots, _ = _manager(max_loras=2)
    for n in (1, 2, 3):
        m.add(_lora(n))
    assert slots.loads == 0  # known, not resident
    assert m.slot_for(NO_LORA) == -1
    s1, s2 = m.slot_for(1), m.slot_for(2)
    assert {s1, s2} == {0, 1}
    assert m.slot_for(1) == s1  # resident: no load, and now the most recent
    assert slots.loads == 2
    # full: 3 takes the slot of the least recently used idle adapter, 2
    assert s2 is not None and m.slot_for(3, busy={1}) == s2
    held = slots.held[s2]
    assert held is not None and held.source == "/ad/3"
    # each step's adapters count as used: 1 is now older than 3... unless run
    assert m.rows([1, NO_LORA, 1]) == [s1, -1, s1]
    assert m.rows([NO_LORA, NO_LORA]) is None
    assert m.slot_for(2) == s2  # 3 was the least recent
    with pytest.raises(ValueError, match="adapter 3 is not in a slot"):
        m.rows([3])
    # every slot busy: the request waits
    assert m.slot_for(3, busy=[1, 2]) is None
    assert [c.lora_id for c in m.take_changes()] == [1, 2, 3, 2]
    assert m.take_changes() == []
    m.audit()


def test_the_host_forgets_the_least_recently_named_idle_adapter() -> None:
    slots, reads = FakeSlots(2), list[str]()
    m = LoRAManager(slots, _reader(reads), max_cpu_loras=3)
    for n in (1, 2, 3):
        m.add(_lora(n))
    m.acquire("r1", 1)
    assert m.slot_for(1) is not None and m.slot_for(3) is not None
    assert not m.add(_lora(2))  # named again: now the most recent
    m.add(_lora(4))  # over 3: 3 goes (1 is used, 2 was named since)
    assert [i.request.lora_int_id for i in m.adapters()] == [1, 2, 4]
    assert [h.source if h else None for h in slots.held].count("/ad/3") == 0
    m.audit()
    # while every adapter is in use the host holds them all...
    for n, rid in ((2, "r2"), (4, "r4")):
        m.acquire(rid, n)
    m.add(_lora(5))
    m.acquire("r5", 5)
    assert len(m.adapters()) == 4
    m.audit()
    # ... and the excess goes as their users end, least recently named first
    m.release(["r2", "r4"])
    assert [i.request.lora_int_id for i in m.adapters()] == [1, 4, 5]
    m.release(["r1", "r5"])
    assert [i.request.lora_int_id for i in m.adapters()] == [1, 4, 5]
    # a forgotten adapter is read again when a request names it (and 4,
    # idle the longest, makes room)
    assert m.add(_lora(3))
    assert reads.count("/ad/3") == 2
    assert [i.request.lora_int_id for i in m.adapters()] == [1, 3, 5]
    m.audit()
    with pytest.raises(ValueError, match="max_cpu_loras=1 is under the 2 slots"):
        LoRAManager(slots, _reader(reads), max_cpu_loras=1)


def test_unloading_lets_the_requests_using_it_finish() -> None:
    m, slots, reads = _manager(max_loras=2)
    m.add(_lora(1))
    m.add(_lora(2))
    m.acquire("r1", 1)
    m.acquire("r2", 1)
    slot = m.slot_for(1)
    assert slot is not None
    with pytest.raises(ValueError, match="holds an adapter already"):
        m.acquire("r1", 2)
    assert m.remove(1)
    assert not m.remove(1)  # being unloaded already
    assert not m.remove(9)
    # new requests are refused; the name is free at once
    with pytest.raises(InvalidRequestError, match=r"id 1 is not loaded \(it is being"):
        m.acquire("r3", 1)
    # the admitted ones run on with it: still resident, still in the rows
    [info] = [i for i in m.adapters() if i.request.lora_int_id == 1]
    assert (info.slot, info.users, info.unloading) == (slot, 2, True)
    assert m.rows([1]) == [slot]
    m.release(["r1"])
    assert slots.held[slot] is not None
    m.release(["r2", "unknown"])  # the last user: slot and host copy go
    assert slots.held[slot] is None
    assert [i.request.lora_int_id for i in m.adapters()] == [2]
    assert m.take_changes()[-1] == SlotChange(slot, 1, None)
    with pytest.raises(InvalidRequestError, match=r"id 1 is not loaded$"):
        m.acquire("r4", 1)
    # unused: gone at once; the same id may then name other weights
    assert m.remove(2)
    assert m.adapters() == ()
    assert m.add(_lora(2, "/other"))
    assert reads[-1] == "/other"
    m.audit()


def test_loading_again_while_unloading_revives_it() -> None:
    m, _, reads = _manager()
    m.add(_lora(1))
    m.acquire("r", 1)
    m.remove(1)
    m.add(LoRARequest("a1", 5, "/ad/5"))  # its name, under another id
    with pytest.raises(InvalidRequestError, match="being unloaded"):
        m.add(_lora(1, "/other"))
    assert not m.add(_lora(1))  # the same: revived, not read again
    assert reads == ["/ad/1", "/ad/5"]
    m.acquire("r2", 1)
    m.release(["r", "r2"])
    assert [(i.request.lora_int_id, i.unloading) for i in m.adapters()] == [
        (1, False),
        (5, False),
    ]
    m.audit()


def test_the_cache_key_names_the_weights_not_the_id() -> None:
    m, _, _ = _manager()
    m.add(_lora(1, "x"))
    m.add(_lora(2, "same-as-x"))
    m.add(_lora(3, "y"))
    assert m.cache_key(NO_LORA) is None
    assert m.cache_key(1) == m.cache_key(2) != m.cache_key(3)
    # an id unloaded and loaded again with other weights gets another key
    old = m.cache_key(3)
    m.remove(3)
    m.add(_lora(3, "z"))
    assert m.cache_key(3) != old


def test_random_use_keeps_the_books_and_never_evicts_a_busy_adapter() -> None:
    rng = random.Random(7)
    m, slots, _ = _manager(max_loras=3)
    running: dict[str, int] = {}  # request -> adapter, resident while running
    waiting: dict[str, int] = {}
    loaded: set[int] = set()
    for step in range(600):
        op = rng.random()
        if op < 0.15:
            n = rng.randint(1, 6)
            if all(i.request.lora_int_id != n for i in m.adapters()):
                m.add(_lora(n))
                loaded.add(n)
        elif op < 0.25 and loaded:
            n = rng.choice(sorted(loaded))
            m.remove(n)
            loaded.discard(n)
        elif op < 0.5 and loaded:
            rid = f"r{step}"
            m.acquire(rid, rng.choice(sorted(loaded)))
            waiting[rid] = m.lora_of(rid)
        elif op < 0.75 and waiting:
            rid = rng.choice(sorted(waiting))
            slot = m.slot_for(waiting[rid], busy=set(running.values()))
            if slot is not None:
                running[rid] = waiting.pop(rid)
        elif running or waiting:
            rid = rng.choice(sorted([*running, *waiting]))
            running.pop(rid, None)
            waiting.pop(rid, None)
            m.release([rid])
        m.audit()
        # every running request's adapter is in its slot, whatever happened
        rows = m.rows(list(running.values()))
        for lora_id, slot in zip(running.values(), rows or [], strict=True):
            held = slots.held[slot]
            assert held is not None and held.source == f"/ad/{lora_id}"
        assert len(set(running.values())) <= 3
    m.release([*running, *waiting])
    assert all(not i.unloading for i in m.adapters())
    m.audit()


# -- the scheduler's slot wait ------------------------------------------------


_SEQUENCE = itertools.count()


def _scheduler(max_loras: int, wait_steps: int) -> tuple[Scheduler, LoRAManager]:
    m = LoRAManager(FakeSlots(max_loras), _reader([]))
    config = SchedulerConfig(max_model_len=64, max_num_seqs=16)
    sched = Scheduler(config, BlockPool(256, 4), lora=m)
    sched.max_slot_wait_steps = wait_steps
    return sched, m


def _add(
    sched: Scheduler, m: LoRAManager, rid: str, lora_id: int, priority: int = 0
) -> None:
    """A request of 4 prompt tokens and 6 outputs with adapter ``lora_id``,
    queued as ``EngineCore.add_request`` does."""
    seq = next(_SEQUENCE)
    req = Request(
        request_id=rid,
        prompt_token_ids=(1, 2, 3, lora_id + 4),
        params=SamplingParams(max_tokens=6, ignore_eos=True),
        eos_token_ids=frozenset({0}),
        priority=priority,
        arrival_time=float(seq),
        sequence_number=seq,
        max_new_tokens=6,
        generator=np.random.default_rng(0),
    )
    if lora_id != NO_LORA:
        m.add(_lora(lora_id))
        req.lora_id, req.lora_key = lora_id, m.cache_key(lora_id)
    sched.add_request(req)
    if lora_id != NO_LORA:
        m.acquire(rid, lora_id)


def _step(sched: Scheduler) -> list[str]:
    """One step of a fake runner (every sample is token 7): the requests
    scheduled for the first time in it."""
    out = sched.schedule()
    sampled = {c.request.request_id: [7] for c in out.chunks if c.samples}
    first = [c.request.request_id for c in out.chunks if c.context_len == 0]
    sched.update_from_output(out, sampled)
    return first


@pytest.mark.parametrize("max_loras", [1, 2])
def test_a_request_waiting_for_a_slot_is_admitted_within_a_bound(
    max_loras: int,
) -> None:
    """Requests with the resident adapters arrive every step, each running
    a few steps, so their adapters' slots are never idle; the one request
    with another adapter is admitted once it has waited ``wait`` steps and
    the slots drain, never overtaken for ever."""
    wait = 8
    for bound in (wait, 10_000):
        sched, m = _scheduler(max_loras, bound)
        for step in range(max_loras):  # fill every slot
            _add(sched, m, f"a-{step}", step + 1)
            _step(sched)
        _add(sched, m, "late", 9)
        admitted_at = None
        base_admitted = 0
        for step in range(200):
            # the resident adapters' stream, and the base model's
            _add(sched, m, f"a-{100 + step}", step % max_loras + 1)
            _add(sched, m, f"base-{step}", NO_LORA)
            if step == wait + 1:  # one that ranks first goes first, held or not
                _add(sched, m, "urgent-0", 1, priority=-1)
            first = _step(sched)
            assert ("urgent-0" in first) == (step == wait + 1)
            base_admitted += sum(r.startswith("base") for r in first)
            if "late" in first:
                admitted_at = step
                break
            m.audit()
        if bound == wait:
            # passed over `wait` steps, then the 6-step requests drain
            assert admitted_at is not None and admitted_at <= wait + 6 + 1
            # the base model's requests were never held
            assert base_admitted == admitted_at + 1
            # and the held requests run once it is admitted: nothing is left
            for _ in range(100):
                _step(sched)
            assert not sched.has_unfinished_requests()
            assert sched.pool.num_used == 0 and not sched._slot_waits
            m.audit()
        else:
            assert admitted_at is None  # starved: the bound is what helps


# -- over a real model's slots -------------------------------------------------


def _random_copy(tmp_path: Path, name: str, seed: int) -> Path:
    """A copy of adapter ``name`` with other random B matrices."""
    d = Path(shutil.copytree(DATA / name, tmp_path / f"{name}-{seed}"))
    file = d / WEIGHTS_FILE
    rng = np.random.default_rng(seed)
    tensors = {
        k: (rng.standard_normal(v.shape) * 0.1).astype(v.dtype)
        if ".lora_B." in k
        else v
        for k, v in safetensors.numpy.load_file(str(file)).items()
    }
    safetensors.numpy.save_file(tensors, str(file))
    return d


def test_the_manager_fills_a_models_slots(tmp_path: Path) -> None:
    model = load_model(DATA / "llama-base", backend="eager", block_size=4).model
    assert isinstance(model, LlamaForCausalLM)
    slots = enable_lora(model, max_loras=2, max_lora_rank=4)

    def read(path: str) -> LoRAAdapter:
        return read_peft_adapter(path, model.config, max_rank=8)

    m = LoRAManager(slots, read)
    m.add(LoRARequest("qv", 1, str(DATA / "llama-qv-r4")))
    m.add(LoRARequest("qv2", 2, str(_random_copy(tmp_path, "llama-qv-r4", 1))))
    # rank 8 over the slots' 4: refused when read, not when a step needs it
    with pytest.raises(ModelLoadError, match="r=8 is over max_lora_rank=4"):
        m.add(LoRARequest("all", 3, str(DATA / "llama-all-r8")))
    assert m.cache_key(1) != m.cache_key(2)
    s1 = m.slot_for(1)
    assert s1 is not None
    held = slots.adapters[s1]
    assert held is not None and held.source == str(DATA / "llama-qv-r4")
    model.set_lora_rows(m.rows([1, NO_LORA]))
    assert model.lora is not None and model.lora.batch.rows is not None
    m.remove(1)
    assert slots.adapters[s1] is None
    m.audit()


def test_the_core_refuses_lora_where_it_does_not_run() -> None:
    from structllm.core.lora_manager import enable_model_lora

    # a tensor-parallel rank 0 needs its followers (the core process's group)
    config = EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match="starts the other ranks") as e:
        enable_model_lora(object(), config)  # type: ignore[arg-type]
    assert e.value.field == "enable_lora"
    with pytest.raises(EngineConfigError, match="object has no LoRA slots"):
        enable_model_lora(object(), EngineConfig(model="m", enable_lora=True))  # type: ignore[arg-type]


def test_data_parallel_routing_keys_prefixes_by_adapter() -> None:
    from structllm.engine.frontend.routing import PrefixRouter

    router = PrefixRouter(block_size=4, slack=1)
    tokens = list(range(9))
    base = router.prefix_hashes(tokens)
    one, two = (
        router.prefix_hashes(tokens, lora_id=1),
        router.prefix_hashes(tokens, lora_id=2),
    )
    assert len({tuple(base), tuple(one), tuple(two)}) == 3
    assert router.prefix_hashes(tokens, "s", 1) != one
    router.record(one, 1)
    assert router.affine(one) == 1
    assert router.affine(base) is None  # the base model's prompt: no affinity
