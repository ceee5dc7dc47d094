"""Stream two requests concurrently under trio, one with a deadline.

Run: python docs/examples/stream_trio.py
"""

import trio

from structllm import AsyncLLM, OutputKind, SamplingParams


async def main() -> None:
    params = SamplingParams(max_tokens=24, temperature=0, output_kind=OutputKind.DELTA)
    async with AsyncLLM.open("tiny", show_progress=False) as llm:

        async def one(prompt: str, deadline: float | None) -> None:
            with trio.move_on_after(deadline if deadline is not None else float("inf")):
                async with llm.stream(prompt, params) as stream:
                    async for out in stream:
                        print(f"[{stream.request_id[:6]}] +{len(out.token_ids)} tokens")
            print(f"{prompt!r}: finish_reason={stream.finish_reason}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "Hello", None)
            nursery.start_soon(one, "Deadline", 0.0)  # cancelled at once: "abort"


if __name__ == "__main__":
    trio.run(main)
