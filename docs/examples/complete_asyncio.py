"""Complete a batch of prompts concurrently under asyncio.

Run: python docs/examples/complete_asyncio.py
"""

import asyncio

from structllm import AsyncLLM, SamplingParams


async def main() -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=1)
    async with AsyncLLM.open("tiny", show_progress=False) as llm:
        prompts = ["Once upon a time", "The capital of France", "def fib(n):"]
        outputs = await asyncio.gather(*(llm.complete(p, params) for p in prompts))
        for prompt, out in zip(prompts, outputs, strict=True):
            print(f"{prompt!r}: {len(out.token_ids)} tokens, {out.finish_reason}")
        print(llm.statistics())


if __name__ == "__main__":
    asyncio.run(main())
