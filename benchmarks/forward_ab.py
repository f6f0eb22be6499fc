"""A/B of one decode step's forward pass: LlamaModel.forward (and model/layers.py) at a git revision vs the working
tree, on SmolLM2 with --dtype auto, in one process, interleaved, best of 30 × 5 calls each (3 × 5 for a prefill
chunk).

usage: python benchmarks/forward_ab.py [--base HEAD~1] [--reps 30] [--disable KERNEL]

--disable KERNEL (one of config.OPTIONAL_KERNELS, e.g. fused_silu or prefill_attention): instead of a revision, the
working tree's forward over a second copy of the model loaded with that kernel off (``--disable-kernels``; its
weights hold the forms their routes then read) as the base, against the default.

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
    ap.add_argument("--disable", default=None, help="a kernel to turn off in the base, instead of a revision")
    args = ap.parse_args()
    new_forward = L.LlamaModel.forward
    llm = LLM(default_model_path(), pool_blocks=512, show_progress=False)
    model = llm.engine.model
    new_rope, new_head, new_layers, new_policy = model.rope, model.lm_head, model.layers, model.policy
    old_policy = new_policy
    if args.disable:
        base_name = f"{args.disable} off"
        off = LLM(default_model_path(), pool_blocks=16, disabled_kernels=(args.disable,),
                  show_progress=False).engine.model
        old_forward, old_rope = new_forward, new_rope
        old_head, old_layers, old_policy = off.lm_head, off.layers, off.policy
    else:
        base_name = args.base
        old_forward, OldRope = old_version(args.base)
        # a weight wrapper the base revision may not know (quant.Int8RowWeight): the base multiplies its dense
        # tensor (a plain copy of it where it is prepacked for oneDNN); a head held without one (the units'
        # routes) goes to the base as the wrapper itself, which revisions since the kernel policy know
        old_head = new_head
        if not isinstance(new_head, torch.Tensor) and hasattr(new_head, "dense"):
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
            for name, f, rope, head, layers, policy in (
                    ("base", old_forward, old_rope, old_head, old_layers, old_policy),
                    ("new", new_forward, new_rope, new_head, new_layers, new_policy)):
                model.rope, model.lm_head, model.layers, model.policy = rope, head, layers, policy
                t = time.perf_counter()
                for _ in range(5):
                    f(model, *a, **k)
                best[name] = min(best[name], (time.perf_counter() - t) / 5)
        print(f"{n} rows: base {best['base'] * 1e3:.2f} ms, new {best['new'] * 1e3:.2f} ms, "
              f"new/base {best['new'] / best['base']:.3f}")


if __name__ == "__main__":
    main()
