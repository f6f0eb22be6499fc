"""The tokenizer stored in a GGUF file (GPT-2 BPE or SentencePiece), built by transformers' GGUF converter."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile

from ..config import cache_dir
from .gguf_loader import ModelLoadError, field_value

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(abspath: str, mtime_ns: int, size: int, path: str):
    """transformers' tokenizer for the file, kept while the file is unchanged; it is only ever read, so engines in
    one process may share it. The fast-tokenizer class is named rather than found by AutoTokenizer, which would parse
    the whole file with gguf's slow reader to learn the model's type (6 s of a 0.5 s conversion for SmolLM2). The result
    is also saved under the cache directory and later starts load that (a large SentencePiece vocabulary's merges are
    rebuilt on conversion)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    key = hashlib.sha256(f"{abspath}:{size}:{mtime_ns}:{transformers.__version__}".encode()).hexdigest()[:32]
    cached = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except Exception as e:  # a damaged cache entry: build it again
            log.warning("cached tokenizer %s unreadable (%s); rebuilding it", cached, e)
    try:
        tok = _convert(abspath)
    except Exception as e:
        raise ModelLoadError(f"{path}: the tokenizer cannot be built ({type(e).__name__}: {e})") from None
    _save(tok, cached)
    return tok


@functools.lru_cache(maxsize=4)
def _wordpiece_tokenizer(abspath: str, mtime_ns: int, size: int, path: str):
    """A BERT file's WordPiece tokenizer (transformers has no GGUF converter for it), rebuilt from the vocabulary
    llama.cpp's converter rewrote: a word-initial piece carries a leading U+2581 where WordPiece has none, a
    continuation lacks the ``##`` WordPiece gives it, control tokens stay as they are. Text is lowercased and its
    accents stripped where the file says (tokenizer.ggml.normalizer.*), else as every file before those keys was."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .gguf_loader import open_gguf

    reader = open_gguf(path)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, kind in zip(tokens, types) if kind == 3]
    pieces = [t if kind == 3 else t[1:] if t.startswith("\u2581") else "##" + t for t, kind in zip(tokens, types)]
    unk_id = field_value(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "[UNK]"
    lowercase = bool(field_value(reader, "tokenizer.ggml.normalizer.lowercase", True))
    strip = bool(field_value(reader, "tokenizer.ggml.normalizer.strip_accents", lowercase))
    raw = RawTokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token=unk))
    raw.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=strip)
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token=unk)
    tok.add_special_tokens({"additional_special_tokens": control})
    return tok


def _convert(abspath: str):
    """transformers' GGUF converter on the file's vocabulary."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        os.path.dirname(abspath), gguf_file=os.path.basename(abspath), local_files_only=True
    )


def _save(tok, target: str) -> None:
    """Save ``tok`` to ``target`` whole or not at all (written beside it, then renamed); a failure only logs."""
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent)
    except OSError as e:  # a read-only cache
        log.debug("tokenizer not cached at %s: %s", target, e)
        return
    try:
        tok.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError as e:  # another process saved it first
        log.debug("tokenizer not cached at %s: %s", target, e)
        shutil.rmtree(tmp, ignore_errors=True)


class TextError(ValueError):
    """Text a client sent that cannot be tokenized."""


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte pieces


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


class Tokenizer:
    """Encode/decode with the file's vocabulary; BOS and EOS as the file says."""

    def __init__(self, path: str, reader) -> None:
        model = field_value(reader, "tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError(f"{path}: the file has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama", "bert"):
            raise ModelLoadError(f"{path}: unsupported tokenizer model {model!r}; supported: gpt2 (BPE), llama "
                                 "(SentencePiece), bert (WordPiece)")
        st = os.stat(path)
        build = _wordpiece_tokenizer if model == "bert" else _hf_tokenizer
        self._hf = build(os.path.abspath(path), st.st_mtime_ns, st.st_size, path)
        self.vocab_size = len(field_value(reader, "tokenizer.ggml.tokens") or [])
        self.bos_token_id = field_value(reader, "tokenizer.ggml.bos_token_id")
        self.eos_token_id = field_value(reader, "tokenizer.ggml.eos_token_id")
        # llama.cpp's defaults: SentencePiece and WordPiece files begin with BOS ([CLS]); WordPiece ends with SEP
        self.add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", model in ("llama", "bert")))
        self.add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False))  # embedding models' files
        if model == "bert":
            self._wordpiece_specials(reader)
        eos = {self.eos_token_id}
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            value = field_value(reader, key)
            if value is not None:
                eos.add(value)
        self.eos_token_ids = frozenset(t for t in eos if t is not None)
        self.chat_template: str | None = field_value(reader, "tokenizer.chat_template")
        self.bos_token = self._token_str(self.bos_token_id)
        self.eos_token = self._token_str(self.eos_token_id)

    def _wordpiece_specials(self, reader) -> None:
        """A BERT file's [CLS] and [SEP], where older converters wrote them only as cls_token_id and
        seperator_token_id (no BOS or EOS keys: bge-small-en-v1.5's file): every text opens with [CLS] and closes
        with [SEP], as llama.cpp reads such files."""
        if self.bos_token_id is None:
            self.bos_token_id = field_value(reader, "tokenizer.ggml.cls_token_id")
        if self.eos_token_id is None:  # [SEP] closes a WordPiece text
            self.eos_token_id = field_value(reader, "tokenizer.ggml.seperator_token_id")
            self.add_eos = bool(field_value(reader, "tokenizer.ggml.add_sep_token", True))

    @property
    def hf(self):
        """The transformers tokenizer underneath (for libraries that take one, such as the grammar compiler)."""
        return self._hf

    def _token_str(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._hf.convert_ids_to_tokens(int(token_id)) or ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it are parsed; BOS is prepended and EOS appended when the
        file asks (an embedding model pools its last token, EOS, as llama.cpp does). TextError for text that is not
        Unicode (a lone surrogate, which JSON's escapes can carry)."""
        try:
            ids = self._hf.encode(text, add_special_tokens=False)
        except TypeError:  # the tokenizers library takes only Unicode: the text is checked on this rare path only
            bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
            if bad is None:
                raise
            raise TextError(f"the text holds a lone surrogate (U+{ord(text[bad]):04X} at character {bad}), "
                            "which is not Unicode") from None
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            if not ids or ids[-1] != self.eos_token_id:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: part of a UTF-8 character where a character spans tokens (logprobs'
        ``bytes``; decoding the token alone would give U+FFFD there)."""
        piece = self._token_str(token_id)
        if self._byte_level:
            table = _unicode_to_byte()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """GPT-2-style byte-level BPE (each byte a printable character), as against SentencePiece's pieces."""
        decoder = json.loads(self._hf.backend_tokenizer.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        return "ByteLevel" in kinds

    @property
    def special_ids(self) -> set[int]:
        """Ids of control tokens (BOS, EOS, chat markers), which text-making code avoids."""
        return set(self._hf.all_special_ids)


class IncrementalDetokenizer:
    """Text of a growing token sequence, released only when it no longer ends inside a UTF-8 character.

    Decodes a short window (a few tokens of context, then the unreleased ones) each time, so the cost per token
    stays constant and SentencePiece's leading-space rules see the token before. Bytes that will never make a
    character (a model emitting stray byte tokens) are released as replacement characters once HOLD_TOKENS tokens
    follow them, as llama.cpp's server does, instead of holding the whole stream until the end.
    """

    CONTEXT_TOKENS = 5
    HOLD_TOKENS = 4  # an unfinished UTF-8 character has at most 3 bytes: 4 tokens later it is finished or invalid

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly complete text (everything left when ``final``)."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            return self._release(full[len(prefix) :], len(self.ids))
        cut = len(self.ids) - self.HOLD_TOKENS
        if cut > self.read_offset:  # what lies before the last HOLD_TOKENS tokens can no longer change
            head = self.tokenizer.decode(self.ids[self.prefix_offset : cut], self.skip)
            if len(head) > len(prefix) and full.startswith(head):
                return self._release(head[len(prefix) :], cut)
        return ""

    def _release(self, delta: str, read_offset: int) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, read_offset
        self.text += delta
        return delta
