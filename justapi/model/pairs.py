"""How a reranker reads a (query, document) pair as one prompt, as llama.cpp builds it: the file's rerank template
where it has one (Qwen3-Reranker's ``tokenizer.chat_template.rerank``, ``{query}`` and ``{document}`` filled in, a
plain substitution, not Jinja), else the encoder pair layout ``[BOS] query [EOS] [SEP] document [EOS]`` with each
special token where the file's add_* flags ask (BERT: ``[CLS] q [SEP] d [SEP]``; XLM-R: ``<s> q </s></s> d </s>``)."""

from __future__ import annotations

import re

from .gguf_loader import field_value
from .tokenizer import Tokenizer

_SLOT = re.compile(r"\{(query|document)\}")


class PairFormat:
    def __init__(self, reader, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template: str | None = field_value(reader, "tokenizer.chat_template.rerank")
        self.sep_token_id = field_value(reader, "tokenizer.ggml.seperator_token_id")  # (sic: gguf's spelling)
        self.add_sep = bool(field_value(reader, "tokenizer.ggml.add_sep_token", False))

    def ids(self, query: str, document: str) -> list[int]:
        """The pair's token ids (TextError for text that is not Unicode)."""
        tok = self.tokenizer
        if self.template is not None:  # one pass: a query holding "{document}" stays as it is
            text = _SLOT.sub(lambda m: query if m.group(1) == "query" else document, self.template)
            return tok.encode(text, add_special_tokens=False)
        eos = tok.eos_token_id if tok.eos_token_id is not None else self.sep_token_id
        ids = [tok.bos_token_id] if tok.add_bos and tok.bos_token_id is not None else []
        ids += tok.encode(query, add_special_tokens=False)
        closed = tok.add_eos and eos is not None
        ids += [eos] if closed else []
        if self.add_sep and self.sep_token_id is not None and not (closed and eos == self.sep_token_id):
            ids.append(self.sep_token_id)  # (once: a file whose EOS is its SEP already closed the query)
        ids += tok.encode(document, add_special_tokens=False)
        return ids + ([eos] if tok.add_eos and eos is not None else [])
