"""Load the exported model with plain transformers (no GreenFlow) and continue a prompt.

python generate.py EXPORT_DIR "the cat "
"""

from __future__ import annotations

import sys

import torch
from lm_job import decode, encode
from transformers import LlamaForCausalLM


def continue_text(export_dir: str, prompt: str, tokens: int = 40) -> str:
    """Greedy continuation of `prompt` by the model exported to `export_dir`."""
    model = LlamaForCausalLM.from_pretrained(export_dir)
    model.eval()
    ids = encode(prompt).unsqueeze(0)
    with torch.no_grad():
        for _ in range(tokens):
            next_id = (
                model(input_ids=ids[:, -model.config.max_position_embeddings + 1 :])
                .logits[0, -1]
                .argmax()
            )
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return decode(ids[0].tolist())


if __name__ == "__main__":
    print(continue_text(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "the cat "))
