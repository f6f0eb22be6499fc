"""A/B of one decode step's forward pass: LlamaModel.forward (and model/layers.py) at a git revision vs the working
tree, on SmolLM2 with --dtype auto, in one process, interleaved, best of 30 × 5 calls each (3 × 5 for a prefill
chunk).

usage: python benchmarks/forward_ab.py [--base HEAD~1] [--reps 30] [--prepack-ab | --amx-ab]

--prepack-ab: instead of a revision, the working tree's forward with the bf16 weights multiplied plain (a second
copy of the model loaded with quant.ONEDNN_PREPACK off) as the base, against the prepacked weights.
--amx-ab: the working tree's forward with the 4-bit AMX kernel off (quant.AMX_MAX_ROWS = 0: batches take the bf16
copy) as the base, against it on.

This VM's speed drifts by up to 3× within minutes, so end-to-end tok/s of two separate runs cannot resolve a 10%
change; the minimum over many interleaved repetitions of the same inputs can. The inputs are captured from a real
decode step of 1 and of 8 sequences.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import textwrap
import time

import torch

import justapi.model.llama as L
from justapi.model import quant
from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_version(rev: str):
    """(forward, RotaryEmbedding) as they were at ``rev``, bound to the current module's other names."""
    show = lambda path: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout
    src = show("justapi/model/llama.py")
    start = src.index("    @torch.inference_mode()\n    def forward(")
    end = src.find("\ndef ", start)
    ns = dict(vars(L))
    exec(show("justapi/model/layers.py"), ns)  # noqa: S102 - our own source at another revision
    exec(textwrap.dedent(src[start : end if end >= 0 else len(src)]), ns)  # noqa: S102
    return ns["forward"], ns["RotaryEmbedding"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prepack-ab", action="store_true")
    ap.add_argument("--amx-ab", action="store_true")
    args = ap.parse_args()
    new_forward = L.LlamaModel.forward
    llm = LLM(default_model_path(), scheduled=True, pool_blocks=512, show_progress=False)
    model = llm.engine.model
    new_rope, new_head, new_layers = model.rope, model.lm_head, model.layers
    amx_rows = quant.AMX_MAX_ROWS
    if args.amx_ab:
        base_name = "4-bit AMX kernel off"
        old_forward, old_rope, old_head, old_layers = new_forward, new_rope, new_head, new_layers
    elif args.prepack_ab:
        base_name = "plain bf16 weights"
        quant.ONEDNN_PREPACK = False
        plain = LLM(default_model_path(), scheduled=True, pool_blocks=16, show_progress=False).engine.model
        quant.ONEDNN_PREPACK = True
        old_forward, old_rope, old_head, old_layers = new_forward, new_rope, plain.lm_head, plain.layers
    else:
        base_name = args.base
        old_forward, OldRope = old_version(args.base)
        # a weight wrapper the base revision may not know (quant.Int8RowWeight): the base multiplies its dense
        # tensor (a plain copy of it where it is prepacked for oneDNN)
        old_head = new_head
        if not isinstance(new_head, torch.Tensor):
            old_head = new_head.dense.to_dense() if new_head.dense.is_mkldnn else new_head.dense
        old_rope = OldRope.__new__(OldRope)
        old_rope.__dict__.update(new_rope.__dict__)
        old_layers = new_layers

    captured = {}

    def spy(self, *a, **k):
        captured.setdefault(a[0].shape[0], (a, k))
        return new_forward(self, *a, **k)

    L.LlamaModel.forward = spy
    llm.generate([[400 + i for i in range(20)]], SamplingParams(max_tokens=3, temperature=0))
    for n in (8, 32):
        llm.generate([[400 + i + j for i in range(20)] for j in range(n)], SamplingParams(max_tokens=30, temperature=0))
    llm.generate([[5000 + i * 7 for i in range(512)]], SamplingParams(max_tokens=1, temperature=0))  # one chunk
    L.LlamaModel.forward = new_forward
    print(f"forward pass of one step (decode rows, or a 512-token prefill chunk), {base_name} vs working tree, "
          f"best of {args.reps} x 5")
    for n in (1, 8, 32, 512):
        a, k = captured[n]
        best = {"base": 1e9, "new": 1e9}
        for _ in range(args.reps if n < 512 else max(2, args.reps // 10)):
            for name, f, rope, head, layers in (("base", old_forward, old_rope, old_head, old_layers),
                                                ("new", new_forward, new_rope, new_head, new_layers)):
                model.rope, model.lm_head, model.layers = rope, head, layers
                quant.AMX_MAX_ROWS = 0 if args.amx_ab and name == "base" else amx_rows
                t = time.perf_counter()
                for _ in range(5):
                    f(model, *a, **k)
                best[name] = min(best[name], (time.perf_counter() - t) / 5)
        print(f"{n} rows: base {best['base'] * 1e3:.2f} ms, new {best['new'] * 1e3:.2f} ms, "
              f"new/base {best['new'] / best['base']:.3f}")


if __name__ == "__main__":
    main()
