"""A decode step's kernel calls, checked and bound once, then run each step.

A step of decode rows alone (``LlamaForCausalLM._decode_layers``) makes the
same kernel calls at every step of a batch size: for each layer the fused
q/k/v projection, the attention (RoPE, the cache writes and the paged
attention in one call), the o projection, two residual adds with their
norms, gate/up, SwiGLU and down; SmolLM2-135M's 30 layers are 240 calls.
Only what their arrays hold changes: the embeddings, and the positions,
slots, block tables and key counts of the step. A :class:`DecodePlan` owns
the step's buffers, those four inputs among them, and the calls bound to
them (``kernels.Call``, each checked when the plan is made); a step copies
its inputs in and runs the calls.

The Python between the kernels was the cost: argument checks, views,
buffer lookups and method calls. A microbenchmark puts them at ~2 us a
call; in a step, with every cache cold from the weights streamed through
it, SmolLM2-135M Q8_0 (q8 activations, 2 threads, batch 1, 200 cached
tokens) took 9.1 ms a step against 6.9 ms for the same kernel calls
replayed back to back (docs/benchmarks.md, "The decode plan").
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence

import attrs
import numpy as np

from structllm.model import kernels
from structllm.model._paddle import paddle
from structllm.model.attention import AttentionMetadata, PortableAttention

__all__ = ["DecodePlan", "DecodePlans", "host_buffer"]

#: a step buffer: a host tensor and its numpy view (the same memory)
Buffer = tuple[paddle.Tensor, np.ndarray]


def host_buffer(shape: tuple[int, ...]) -> Buffer:
    """A float32 host tensor of ``shape``, uninitialised, and its view."""
    tensor = paddle.empty(list(shape), "float32")
    return tensor, np.from_dlpack(tensor)


@attrs.define(eq=False)
class DecodePlan:
    """The kernel calls of a decode step of ``rows`` rows over ``caches``,
    bound to this plan's buffers (see the module doc)."""

    #: the model's per-layer K and V caches the calls read and write
    caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]]
    #: the slots each cache holds (the step's are checked against it)
    num_slots: int
    #: (rows, hidden): the embeddings in, the residual stream out
    residual: Buffer
    #: (rows, hidden): the final norm of the residual stream
    final: Buffer
    #: (rows,) int64 each: the step's positions, slots and key counts
    positions: np.ndarray
    slots: np.ndarray
    lens: np.ndarray
    #: (rows, blocks) int64: the rows' block tables, as wide as the longest
    #: sequence the model takes needs
    tables: np.ndarray
    #: writes the embeddings of the step's ``(rows,)`` ids into its second
    #: argument, ``residual``'s view
    embed: Callable[[np.ndarray, np.ndarray], object]
    #: ``residual``'s final norm into ``final``, where a step asks for it
    final_norm: kernels.Call
    #: what the step runs, in order
    calls: list[kernels.Call] = attrs.field(factory=list)

    @classmethod
    def empty(
        cls,
        caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        num_slots: int,
        rows: int,
        blocks: int,
        embed: Callable[[np.ndarray, np.ndarray], object],
        norm: np.ndarray,  # (hidden,) the final norm's weight
        eps: float,
    ) -> DecodePlan:
        """A plan with its buffers, inputs, embedding and final norm, and no
        calls yet."""
        residual = host_buffer((rows, len(norm)))
        final = host_buffer((rows, len(norm)))
        return cls(
            caches=caches,
            num_slots=num_slots,
            residual=residual,
            final=final,
            positions=np.zeros(rows, np.int64),
            slots=np.zeros(rows, np.int64),
            lens=np.ones(rows, np.int64),
            tables=np.zeros((rows, blocks), np.int64),
            embed=embed,
            final_norm=kernels.add_rms_norm_call(residual[1], norm, eps, final[1]),
        )

    @property
    def step(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Positions, slots, block tables and key counts, as the attention's
        call takes them (``PortableAttention.decode_call``)."""
        return self.positions, self.slots, self.tables, self.lens

    def serves(self, caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]]) -> bool:
        """Whether the calls are bound to these caches."""
        return self.caches is caches or (
            len(self.caches) == len(caches)
            and all(
                a[0] is b[0] and a[1] is b[1]
                for a, b in zip(self.caches, caches, strict=True)
            )
        )

    def run(
        self,
        ids: np.ndarray,  # (rows,) int64 token ids
        positions: np.ndarray,  # (rows,) checked against the RoPE tables
        meta: AttentionMetadata,
        final: bool = False,
    ) -> paddle.Tensor:  # (rows, hidden)
        """The step: its inputs copied in, then every call. The result is
        the residual stream, or its final norm with ``final``: a buffer of
        this plan, which the next run overwrites."""
        assert meta.decode_tables is not None and meta.decode_lens is not None
        PortableAttention.check_slots(self.num_slots, meta)
        self.embed(ids, self.residual[1])
        self.positions[...] = positions
        self.slots[...] = meta.slot_mapping
        self.lens[...] = meta.decode_lens
        # the columns past the plan's are past any position the model takes:
        # the kernels read a row's blocks below its key count only
        width = min(meta.decode_tables.shape[1], self.tables.shape[1])
        self.tables[:, :width] = meta.decode_tables[:, :width]
        for fn, args in self.calls:
            fn(*args)
        if not final:
            return self.residual[0]
        fn, args = self.final_norm
        fn(*args)
        return self.final[0]


class DecodePlans:
    """The plans of the last ``keep`` keys (batch size, threading) made."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._plans: collections.OrderedDict[Hashable, DecodePlan] = (
            collections.OrderedDict()
        )

    def get(
        self,
        key: Hashable,
        caches: Sequence[tuple[paddle.Tensor, paddle.Tensor]],
        make: Callable[[], DecodePlan],
    ) -> DecodePlan:
        """The plan of ``key`` over ``caches``, made by ``make`` when there is
        none. Plans of other caches are dropped (they hold their views)."""
        plan = self._plans.get(key)
        if plan is not None and not plan.serves(caches):
            self._plans.clear()
            plan = None
        if plan is None:
            plan = self._plans[key] = make()
            while len(self._plans) > self._keep:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan
