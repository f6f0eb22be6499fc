"""Grammars compiled for a model's vocabulary (xgrammar), and the per-request matchers that mask logits.

xgrammar is the structured-output engine vLLM and SGLang default to: a schema, regex or EBNF grammar is compiled
once per vocabulary into a token-level automaton (cached by content here), and a matcher per request gives each
step's allowed tokens as a bitmask over the vocabulary, filled on the CPU in microseconds for most states.

One ``Grammars`` per process and model file (``for_model``): the engine process compiles requests' grammars off
the step loop (``compile_async``) before they are scheduled; a runner in another process (a tensor-parallel
rank, a disaggregated worker) compiles on its first sight of a spec, from the same cache key.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import weakref
from collections import OrderedDict

import torch

from .compile import GrammarError, compile_spec
from .compile_workers import CompileError, CompileWorkers
from .spec import StructuredOutput

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer is refused, its compile ended (compile_workers)
CACHE_ENTRIES = 256
COMPILE_WORKERS = 2  # processes compiling at once: one slow grammar leaves the other free


class Grammars:
    """The vocabulary's xgrammar compiler, a cache of compiled grammars by spec, and matchers over them."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                         stop_token_ids=sorted(stop_token_ids))
        self._workers: CompileWorkers | None = None  # started on the first client's spec
        self._compiler = None  # this process's own, for specs the front already compiled
        self._cache: OrderedDict[StructuredOutput, _Compiled] = OrderedDict()
        # every grammar a live matcher holds, evicted from the cache or not: a resumed request finds its own
        self._live: weakref.WeakValueDictionary[StructuredOutput, _Compiled] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="justapi-grammar")
        self._pending: dict[StructuredOutput, concurrent.futures.Future] = {}

    # --- compiling ------------------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutput, untrusted: bool = False) -> _Compiled:
        """The compiled grammar of ``spec`` (cached, and kept while a matcher holds it); GrammarError if it cannot be
        compiled. ``untrusted``: a client's spec never compiled before, compiled by a worker process within the time
        limit; otherwise (a spec the server's front already compiled: a runner replaying it, in this process or in a
        tensor-parallel or disaggregated worker) compiled here, with no processes of its own."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            hit = self._live.get(spec)
        compiled = hit if hit is not None else self._compile(spec) if untrusted else self._compile_here(spec)
        with self._lock:
            self._cache[spec] = self._live[spec] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def compile_async(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """Compile in this object's thread (never on the caller's); concurrent requests for one spec share it."""
        with self._lock:
            if spec in self._cache:
                done = concurrent.futures.Future()
                done.set_result(self._cache[spec])
                return done
            fut = self._pending.get(spec)
            if fut is None:
                fut = self._pool.submit(self.compile, spec, True)
                self._pending[spec] = fut
                fut.add_done_callback(lambda _: self._forget(spec))
            return fut

    def _forget(self, spec: StructuredOutput) -> None:
        with self._lock:
            self._pending.pop(spec, None)

    def check(self, spec: StructuredOutput) -> None:
        """Compile a client's ``spec`` or raise GrammarError naming the problem (also past COMPILE_TIMEOUT_S)."""
        self.compile_async(spec).result()

    def _compile(self, spec: StructuredOutput) -> _Compiled:
        """``spec`` compiled by a worker process within COMPILE_TIMEOUT_S (compile_workers), read back here."""
        if self._workers is None:  # started outside the lock, which the engine thread takes for every matcher
            started = CompileWorkers(self._info.serialize_json(), COMPILE_WORKERS)
            with self._lock:
                if self._workers is None:
                    self._workers, started = started, None
            if started is not None:  # another thread's came first
                started.close()
        try:
            serialized = self._workers.compile(spec, COMPILE_TIMEOUT_S)
        except CompileError as e:
            raise GrammarError(str(e)) from None
        return _Compiled(self._xgr.CompiledGrammar.deserialize_json(serialized, self._info))

    def _compile_here(self, spec: StructuredOutput) -> _Compiled:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return _Compiled(compile_spec(self._xgr, self._compiler, spec))

    # --- matching -------------------------------------------------------------------------------------------
    def matcher(self, spec: StructuredOutput, output_token_ids: list[int]) -> Matcher:
        """A matcher for ``spec`` that has accepted ``output_token_ids`` (a resumed or handed-over request)."""
        compiled = self.compile(spec)
        m = Matcher(self._xgr.GrammarMatcher(compiled.grammar), compiled)
        for tok in output_token_ids:
            if not m.accept(tok):
                break
        return m

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher], kernels=None) -> None:
        """Set to -inf, in place, the logits of tokens each matcher does not allow next (``logits[rows[i]]`` for
        ``matchers[i]``). ``kernels``: the engine's C++ kernels, whose ``mask_logits`` applies the masks."""
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, m in enumerate(matchers):
            m.fill(bitmask, i)
        self._apply(logits, bitmask, rows, kernels)

    def mask_tree(self, logits: torch.Tensor, matcher: Matcher, parents: list[int], tokens: list[int],
                  kernels=None, tops: tuple[int, ...] = (-1,)) -> None:
        """Mask, in place, the verification rows of a draft tree (spec.tree: row 0 follows the request's tokens,
        row 1 + i follows node i's path) by what the grammar allows after each row's path; with ``tops``, only the
        subtrees of those nodes (rows elsewhere keep every token: a new bitmask allows all)."""
        bitmask = self._xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for top in tops:
            matcher.fill_tree(bitmask, parents, tokens, top)
        self._apply(logits, bitmask, list(range(logits.shape[0])), kernels)

    def _apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], kernels) -> None:
        if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 \
                and logits.is_contiguous():
            kernels.mask_logits(logits, bitmask, torch.tensor(rows, dtype=torch.long))
            return
        view = logits[rows] if len(rows) != logits.shape[0] else logits  # xgrammar's rows index both tensors
        self._xgr.apply_token_bitmask_inplace(view, bitmask.to(logits.device), vocab_size=self.vocab_size)
        if view is not logits:
            logits[rows] = view


class _Compiled:
    """A compiled grammar, held by the cache and by each matcher over it (what keeps it in ``Grammars._live``)."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher, compiled: _Compiled | None = None) -> None:
        self._m = matcher
        self._compiled = compiled  # keeps its grammar findable while the request lives

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (or has ended)."""
        return self._m.accept_token(int(token_id))

    def advance(self, token_ids: list[int]) -> None:
        """Accept tokens the runner sampled under this matcher's masks. A refusal before the grammar has ended means
        the mask and the matcher disagree (a bug, or NaN logits whose argmax the mask could not steer): it is logged
        loudly, and the matcher stays where it was, so that one request's fault never stops the engine."""
        for tok in token_ids:
            if not self.accept(tok) and not self._m.is_terminated():
                log.error("the grammar refused token %d, sampled under its own mask; the output breaks its "
                          "constraint here", tok)
                return

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():
            bitmask[row].fill_(-1)  # past the stop token: anything sampled here is cut off (Scheduler.update)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def fill_tree(self, bitmask: torch.Tensor, parents: list[int], tokens: list[int], top: int = -1) -> None:
        """Row 0: what may follow now; row 1 + i: what may follow draft node i's path, walked depth first and
        rolled back. Below a node the grammar refuses, rows stay all-allowed: its parent's row gives that node no
        mass, so verification never reaches them. With ``top`` a node: its subtree only, the grammar starting at
        that node's row (where a reasoning request's thinking closes in the tree)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)

        def visit(node: int) -> None:
            self.fill(bitmask, node + 1)
            for child in children.get(node, ()):
                if self._m.accept_token(int(tokens[child])):
                    try:
                        visit(child)
                    finally:  # the matcher leaves the walk where it entered it, whatever happens below
                        self._m.rollback(1)

        visit(top)


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=4)
def _for_model(path: str, mtime_ns: int, size: int) -> Grammars:
    from ..model.gguf_loader import open_gguf, read_model_config
    from ..model.tokenizer import Tokenizer

    reader = open_gguf(path)
    tokenizer = Tokenizer(path, reader)
    return Grammars(tokenizer.hf, read_model_config(reader, path).vocab_size, sorted(tokenizer.eos_token_ids))


def for_model(path: str) -> Grammars:
    """The process's Grammars for a model file (built on first use: it reads the tokenizer)."""
    import os

    st = os.stat(path)
    with _LOCK:
        return _for_model(os.path.abspath(path), st.st_mtime_ns, st.st_size)
