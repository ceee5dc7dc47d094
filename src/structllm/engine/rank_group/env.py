"""The ``paddle.distributed`` variables each rank of a tensor-parallel
group runs with.

``paddle.distributed.init_parallel_env`` reads the group from the
environment. Rank 0 (:mod:`structllm.engine.rank_group`) chooses every
rank's variables: a spawned follower inherits them (:func:`spawn_env`, the
ones ``paddle.distributed.spawn`` sets); a ``--connect`` follower gets them
in its :class:`~structllm.engine.rank_group.protocol.RankSetup`
(:func:`connect_env`). Each rank, rank 0 included, then applies its own
(:func:`apply_env`).
"""

from __future__ import annotations

import os
import socket

__all__ = [
    "apply_env",
    "connect_env",
    "endpoint",
    "family",
    "free_ports",
    "pick_backend",
    "spawn_env",
]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports free on ``host`` now: the group's endpoints."""
    socks = [socket.socket(family(host)) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pick_backend(size: int) -> str:
    """NCCL when this Paddle has CUDA and a GPU for every rank, else gloo."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() >= size:
        return "nccl"
    return "gloo"


def spawn_env(rank: int, endpoints: list[str], backend: str) -> dict[str, str]:
    """``paddle.distributed.init_parallel_env``'s variables for ``rank``
    (those ``paddle.distributed.spawn`` sets; rank 0's endpoint is the store)."""
    env = {
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
        "PADDLE_DISTRI_BACKEND": backend,
    }
    if backend == "nccl":
        env["FLAGS_selected_gpus"] = str(rank)
    return env


def family(host: str) -> socket.AddressFamily:
    """``host``'s address family: IPv6 when it has a colon."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def endpoint(host: str, port: int) -> str:
    """``host:port`` for an endpoint list (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_env(
    rank: int, endpoints: list[str], backend: str, store: tuple[str, int]
) -> dict[str, str]:
    """A connected group's variables for ``rank``: as :func:`spawn_env`, with
    the store named outright (``MASTER_ADDR`` / ``MASTER_PORT`` win over a
    ``PADDLE_MASTER`` that ``paddle.distributed.launch`` set). No GPU
    choice: each machine numbers its own (:func:`apply_env`)."""
    env = spawn_env(rank, endpoints, backend)
    env.pop("FLAGS_selected_gpus", None)
    env["MASTER_ADDR"], env["MASTER_PORT"] = store[0], str(store[1])
    return env


def apply_env(env: dict[str, str]) -> None:
    """Run this process as the rank ``env`` describes.

    A connected rank drops ``launch``'s own store address and, on GPUs,
    keeps the GPU its machine chose (``FLAGS_selected_gpus``, else its
    ``PADDLE_LOCAL_RANK``, else 0).
    """
    os.environ.update(env)
    if "MASTER_ADDR" not in env:
        return  # spawned: the variables are the whole story
    os.environ.pop("PADDLE_MASTER", None)
    if env["PADDLE_DISTRI_BACKEND"] == "nccl":
        os.environ.setdefault(
            "FLAGS_selected_gpus", os.environ.get("PADDLE_LOCAL_RANK", "0")
        )
