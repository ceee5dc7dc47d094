"""Record transformers' greedy tokens and first-step logits for SmolLM2-135M-Instruct (Q4_1 GGUF).

The real-model tier (tests/test_real_model.py) compares structllm against
this file. transformers dequantizes the GGUF to float32 (through the `gguf`
package) and runs it in float32 on the CPU; it is an oracle that shares no
code with structllm. Run it in a venv with torch, transformers, gguf and
accelerate (`nox -s real -- --record` does):

    python tools/record_smollm2_oracle.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf \
        tests/data/smollm2_oracle.json

For every prompt it records the chat prompt's ids (the file's own ChatML
template, add_generation_prompt), 64 greedy tokens, the margin between the
best and second-best logit at each step (so a test can tell a near-tie from
a real difference), and at the first step the logits of the 32 best ids and
of 32 fixed random ids.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for learning to code.",
    "Who wrote Romeo and Juliet?",
]
NEW_TOKENS = 64


def main() -> None:
    gguf_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, torch_dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(0)
    probe_ids = sorted(
        rng.choice(model.config.vocab_size, size=32, replace=False).tolist()
    )
    records = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = [int(i) for i in ids]
        started = time.perf_counter()
        input_ids = torch.tensor([ids])
        # token 2 is both <|im_end|>-ish content in the prompt and the pad
        # token: an explicit mask keeps transformers from masking it out
        mask = torch.ones_like(input_ids)
        tokens, margins = [], []
        first_logits = None
        with torch.no_grad():
            past = None
            step_ids, step_mask = input_ids, mask
            for step in range(NEW_TOKENS):
                result = model(
                    input_ids=step_ids,
                    attention_mask=step_mask,
                    past_key_values=past,
                    use_cache=True,
                )
                past = result.past_key_values
                logits = result.logits[0, -1].double()
                if step == 0:
                    first_logits = logits
                top = torch.topk(logits, 2)
                token = int(top.indices[0])
                tokens.append(token)
                margins.append(float(top.values[0] - top.values[1]))
                step_ids = torch.tensor([[token]])
                step_mask = torch.cat(
                    [step_mask, torch.ones((1, 1), dtype=mask.dtype)], 1
                )
                if token in (tokenizer.eos_token_id,):
                    break
        assert first_logits is not None
        best = torch.topk(first_logits, 32)
        records.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "tokens": tokens,
                "margins": margins,
                "text": tokenizer.decode(tokens, skip_special_tokens=True),
                "top_ids": [int(i) for i in best.indices],
                "top_logits": [float(v) for v in best.values],
                "probe_ids": probe_ids,
                "probe_logits": [float(first_logits[i]) for i in probe_ids],
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        print(prompt, "->", records[-1]["text"][:80].replace("\n", " "), flush=True)
    out.write_text(
        json.dumps(
            {
                "command": "python tools/record_smollm2_oracle.py "
                "SmolLM2-135M-Instruct.Q4_1.gguf tests/data/smollm2_oracle.json",
                "file": gguf_path.name,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "eos_token_id": tokenizer.eos_token_id,
                "records": records,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
