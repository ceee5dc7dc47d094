"""The public names of ``structllm``: a deliberate, tested list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import structllm

PUBLIC = {
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineConfigError",
    "EngineCoreError",
    "EngineDeadError",
    "EngineLoadingError",
    "EngineOverloadedError",
    "EngineStatistics",
    "FrontendConfig",
    "InvalidRequestError",
    "LLM",
    "Logprob",
    "ModelLoadError",
    "NoFreeBlocksError",
    "OutputKind",
    "RequestError",
    "RequestFailedError",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "ServerConfig",
    "ShuttingDownError",
    "StructLLMError",
    "StructuredOutputs",
    "UnsupportedModelError",
}


def test_all_is_the_public_api() -> None:
    assert set(structllm.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(structllm, name).__module__.startswith("structllm.")


def test_every_error_is_exported() -> None:
    import structllm.errors as errors

    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, structllm.StructLLMError)
    }
    assert defined <= set(structllm.__all__)


def test_lazy_names_load_on_first_use_and_unknown_ones_raise() -> None:
    import structllm.structured

    assert structllm.EngineStatistics.__name__ == "EngineStatistics"
    assert structllm.structured.GrammarCompiler.__name__ == "GrammarCompiler"
    with pytest.raises(AttributeError, match="'structllm' has no attribute 'nope'"):
        structllm.nope  # noqa: B018
    with pytest.raises(AttributeError, match=r"'structllm\.structured' has no"):
        structllm.structured.nope  # noqa: B018


def test_the_front_end_never_imports_paddle() -> None:
    """``AsyncLLM``, the server and the command line (its parser included)
    import no Paddle and no numba: the model loads in the engine's process."""
    code = """
import sys
import structllm
from structllm import AsyncLLM, EngineStatistics, SamplingParams
import structllm.cli, structllm.server.run, structllm.bench.serve_compare
structllm.cli.build_parser().parse_args(["serve", "tiny"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"paddle", "numba"})
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_errors_tree() -> None:
    assert issubclass(structllm.InvalidRequestError, ValueError)
    assert issubclass(structllm.InvalidRequestError, structllm.RequestError)
    assert issubclass(structllm.EngineOverloadedError, structllm.RequestError)
    assert not issubclass(structllm.EngineDeadError, structllm.RequestError)


EXAMPLES = sorted((Path(__file__).parent.parent / "docs" / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_docs_examples_run(example: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason" in proc.stdout or "length" in proc.stdout


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from structllm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"structllm {structllm.__version__}"
