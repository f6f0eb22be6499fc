"""How often greedy text changes in bf16 (--dtype auto) when only the order of fp32 sums changes: 32 chat prompts
decoded together (32 greedy tokens each, EOS ignored) on SmolLM2, with the defaults and with one arithmetic choice
switched at a time. Prints, per variant, how many of the 32 texts differ from the defaults' and where they first
differ (token index).

usage: python benchmarks/bf16_text_drift.py

Variants: the same run repeated (a control: must give 0); the 4-bit AMX kernel only up to 64 rows (prefill chunks
on oneDNN's bf16 product, as before it took them); no AMX kernel at all (oneDNN for every batch of 6+ rows); prefill
keys not padded (attention.KEY_PAD = 1). The prefix cache is off, so every run prefills the same chunks.
"""

from __future__ import annotations

from justapi import LLM, SamplingParams
from justapi.model import attention, quant
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    llm = LLM(default_model_path(), scheduled=True, pool_blocks=1024, max_seqs=32, prefix_cache=False,
              show_progress=False)
    topics = ["rivers", "mountains", "birds", "planets", "cities", "metals", "trees", "languages"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Question {i}: tell me about {i % 7 + 2} "
                                         f"{topics[i % 8]} and why they matter."}]) for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def texts() -> list[list[int]]:
        return [r.token_ids for r in llm.generate(prompts, params)]

    base = texts()

    def report(name: str) -> None:
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(base, texts())]
        changed = [i for i in firsts if i is not None]
        print(f"{name:38s} {len(changed):2d} of {len(base)} texts differ; first differing token: {sorted(changed)}")

    report("defaults again")
    amx_rows = quant.AMX_MAX_ROWS
    quant.AMX_MAX_ROWS = 64
    report("AMX kernel up to 64 rows only")
    quant.AMX_MAX_ROWS = 0
    report("no AMX kernel (oneDNN bf16)")
    quant.AMX_MAX_ROWS = amx_rows
    pad = attention.KEY_PAD
    attention.KEY_PAD = 1
    report("prefill keys not padded")
    attention.KEY_PAD = pad


if __name__ == "__main__":
    main()
