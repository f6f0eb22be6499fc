"""Fill-in-the-middle: a code model's prefix, suffix and middle tokens (Qwen2.5-Coder's ``<|fim_prefix|>`` ...,
CodeLlama's ``<PRE>`` ..., StarCoder's ``<fim_prefix>`` ...), from the file's ``tokenizer.ggml.fim_*_token_id`` keys
or, for files older than them, by the tokens' text as llama.cpp finds them; the prompt in PSM order:
``[FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]``, the model writing the middle."""

from __future__ import annotations

from collections.abc import Sequence

from .gguf_loader import field_value

_KEYS = {"pre": ("fim_pre_token_id", "prefix_token_id"), "suf": ("fim_suf_token_id", "suffix_token_id"),
         "mid": ("fim_mid_token_id", "middle_token_id"), "sep": ("fim_sep_token_id",)}
_TEXTS = {"pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>"),
          "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>"),
          "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>"),
         "sep": ("<|file_sep|>", "<file_sep>")}


class FimTokens:
    def __init__(self, reader, tokenizer) -> None:
        self.tokenizer = tokenizer
        tokens = field_value(reader, "tokenizer.ggml.tokens") or []
        index = {t: i for i, t in enumerate(tokens) if t.startswith(("<", "▁<"))}
        self.ids: dict[str, int] = {}
        for part in ("pre", "suf", "mid", "sep"):
            found = next((field_value(reader, f"tokenizer.ggml.{k}") for k in _KEYS[part]
                          if field_value(reader, f"tokenizer.ggml.{k}") is not None), None)
            if found is None:
                found = next((index[t] for t in _TEXTS[part] if t in index), None)
            if found is not None:
                self.ids[part] = int(found)

    @property
    def available(self) -> bool:
        return all(part in self.ids for part in ("pre", "suf", "mid"))

    def prompt(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = (), middle: str = "") -> list[int]:
        """The PSM prompt's token ids: ``extra`` (other files, (name, text): llama.cpp's input_extra) each after a
        file separator first, ``middle`` the start of the answer (ValueError for a model without the tokens;
        TextError for text that is not Unicode)."""
        if not self.available:
            raise ValueError("this model has no fill-in-the-middle tokens (prefix, suffix and middle)")
        if extra and "sep" not in self.ids:
            raise ValueError("this model has no file separator token for input_extra")
        tok = self.tokenizer
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        ids = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
        for name, text in extra:
            ids += [self.ids["sep"]] + encode(f"{name}\n{text}")
        ids += [self.ids["pre"]] + encode(prefix) + [self.ids["suf"]] + encode(suffix) + [self.ids["mid"]]
        return ids + (encode(middle) if middle else [])
