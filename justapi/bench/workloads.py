"""Benchmark workloads: seeded, reproducible lists of jobs, with lengths in tokens of the served model's tokenizer.

A *job* is what arrives at one moment: one request, or (multi-turn) a conversation whose turns are sent one after
another, each turn's messages extending the previous turn's with the answer the server gave.

    random         input/output lengths drawn from ranges
    shared-prefix  N prefixes x M suffixes: requests sharing a prefix differ only in their tail
    multi-turn     conversations of T turns
    burst          steady decodes (short prompt, long output) plus bursts of long prompts at fixed times
    jsonl          the user's prompts, one JSON object a line: {"prompt": ..., "max_tokens": ...} or {"messages": [...]}

Traffic classes (``--class``, any number) replace the workload's single stream by several, each with its own
Poisson arrivals, lengths and request fields: a heavy and a light tenant (``user``), an interactive and a batch
class (``priority``), clients with a ``timeout``. Reports then split every figure by class.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn", "burst", "jsonl")


class WorkloadError(ValueError):
    """A workload that cannot be built; the message says which option is wrong."""


@dataclass
class Turn:
    """One request: a completion prompt, or the user message of a chat turn."""

    max_tokens: int
    prompt: str | None = None  # /v1/completions
    user: str | None = None  # /v1/chat/completions: appended to the conversation so far
    messages: list[dict] | None = None  # a fixed chat (jsonl), sent as is


@dataclass
class Job:
    turns: list[Turn]
    at: float | None = None  # seconds after the start; None: set by the arrival process
    kind: str = ""  # e.g. "steady" / "burst" or a traffic class's name, for reports that split them
    fields: dict = field(default_factory=dict)  # merged into each request's body (a class's user, priority, ...)


CLASS_KEYS = ("name", "rate", "requests", "input", "output")  # the rest of a --class goes into the request body


@dataclass
class TrafficClass:
    """``--class name=heavy,rate=2,requests=100,user=heavy,priority=0,input=64:256,output=32:128``: ``requests``
    requests arriving as a Poisson process of ``rate`` per second; lengths default to the workload's."""

    name: str
    rate: float
    requests: int
    input_len: tuple[int, int] | None = None
    output_len: tuple[int, int] | None = None
    fields: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TrafficClass:
        items = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key or not value:
                raise WorkloadError(f"--class {text!r}: {part!r} is not KEY=VALUE")
            items[key.strip()] = value.strip()
        for key in ("name", "rate", "requests"):
            if key not in items:
                raise WorkloadError(f"--class {text!r} needs {key}=...")
        try:
            rate, requests = float(items.pop("rate")), int(items.pop("requests"))
            lengths = {k: _bounds(items.pop(k)) for k in ("input", "output") if k in items}
        except ValueError as e:
            raise WorkloadError(f"--class {text!r}: {e}") from None
        if not rate > 0 or requests < 1:
            raise WorkloadError(f"--class {text!r}: rate must be positive and requests at least 1")
        name = items.pop("name")
        fields = {k: _json_value(v) for k, v in items.items()}
        return cls(name, rate, requests, lengths.get("input"), lengths.get("output"), fields)


def _bounds(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    bounds = int(lo), int(hi or lo)
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"lengths must be MIN:MAX with 1 <= MIN <= MAX, not {text}")
    return bounds


def _json_value(text: str):
    """A class's body field: a number or true/false/null where it reads as one, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


@dataclass
class WorkloadSpec:
    name: str = "random"
    num_requests: int = 32  # random, jsonl (at most), burst: steady requests; multi-turn: conversations
    input_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (16, 256)
    num_prefixes: int = 4
    prefix_len: int = 256
    suffixes_per_prefix: int = 8
    turns: int = 3
    burst_every: float = 10.0  # seconds between bursts
    burst_size: int = 4  # long prompts per burst
    burst_input_len: int = 1024
    burst_output_len: int = 16
    steady_rate: float = 2.0  # steady requests per second
    path: str | None = None  # jsonl
    seed: int = 0
    classes: tuple[TrafficClass, ...] = ()  # traffic classes instead of the workload's one stream (random only)


class TextMaker:
    """Random text of a given length in tokens of ``tokenizer`` (a justapi Tokenizer or anything with encode/decode)."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        special = set(getattr(tokenizer, "special_ids", ()) or ())
        vocab = tokenizer.vocab_size
        # ordinary word pieces: skip the first ids (bytes, specials in most vocabularies) and any special id
        self.ids = [i for i in range(min(256, vocab // 2), vocab) if i not in special]

    def text(self, num_tokens: int) -> str:
        """Text that re-tokenizes to ``num_tokens`` tokens, or within a token or two where pieces merge."""
        ids = [self.rng.choice(self.ids) for _ in range(num_tokens)]
        text = self.tok.decode(ids)
        for _ in range(3):  # decoding then encoding can merge or split pieces: trim or pad towards the target
            got = self.tok.encode(text, add_special_tokens=False)
            if len(got) == num_tokens:
                break
            if len(got) > num_tokens:
                text = self.tok.decode(got[:num_tokens])
            else:
                text += self.tok.decode([self.rng.choice(self.ids) for _ in range(num_tokens - len(got))])
        return text


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def build(spec: WorkloadSpec, tokenizer) -> list[Job]:
    """The jobs of ``spec``, the same for the same seed."""
    if spec.name not in WORKLOADS:
        raise WorkloadError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}")
    if spec.num_requests < 1:
        raise WorkloadError(f"--num-requests must be at least 1, not {spec.num_requests}")
    for label, (lo, hi) in (("input", spec.input_len), ("output", spec.output_len)):
        if lo < 1 or hi < lo:
            raise WorkloadError(f"--{label}-len must be MIN:MAX with 1 <= MIN <= MAX, not {lo}:{hi}")
    rng = random.Random(spec.seed)
    text = TextMaker(tokenizer, rng)
    if spec.classes:
        if spec.name != "random":
            raise WorkloadError("--class builds random prompts for each class: use it with --workload random")
        return _classes(spec, text, rng)
    if spec.name == "random":
        return [Job([Turn(_length(rng, spec.output_len), prompt=text.text(_length(rng, spec.input_len)))])
                for _ in range(spec.num_requests)]
    if spec.name == "shared-prefix":
        jobs = []
        for _ in range(spec.num_prefixes):
            prefix = text.text(spec.prefix_len)
            for _ in range(spec.suffixes_per_prefix):
                suffix = text.text(_length(rng, spec.input_len))
                jobs.append(Job([Turn(_length(rng, spec.output_len), prompt=prefix + " " + suffix)]))
        rng.shuffle(jobs)
        return jobs
    if spec.name == "multi-turn":
        if spec.turns < 1:
            raise WorkloadError(f"--turns must be at least 1, not {spec.turns}")
        return [Job([Turn(_length(rng, spec.output_len), user=text.text(_length(rng, spec.input_len)))
                     for _ in range(spec.turns)]) for _ in range(spec.num_requests)]
    if spec.name == "burst":
        if spec.steady_rate <= 0 or spec.burst_every <= 0:
            raise WorkloadError("--steady-rate and --burst-every must be positive")
        jobs = [Job([Turn(_length(rng, spec.output_len), prompt=text.text(_length(rng, (16, 64))))],
                    at=i / spec.steady_rate, kind="steady") for i in range(spec.num_requests)]
        span = spec.num_requests / spec.steady_rate
        t = spec.burst_every / 2
        while t < span:
            jobs += [Job([Turn(spec.burst_output_len, prompt=text.text(spec.burst_input_len))], at=t, kind="burst")
                     for _ in range(spec.burst_size)]
            t += spec.burst_every
        return sorted(jobs, key=lambda j: j.at)
    return _jsonl(spec)


def _classes(spec: WorkloadSpec, text: TextMaker, rng: random.Random) -> list[Job]:
    """Each class's requests at its own Poisson arrival times (seeded), all classes merged in time order."""
    if len({c.name for c in spec.classes}) != len(spec.classes):
        raise WorkloadError("--class names must differ")
    jobs = []
    for c in spec.classes:
        t = 0.0
        for _ in range(c.requests):
            prompt = text.text(_length(rng, c.input_len or spec.input_len))
            jobs.append(Job([Turn(_length(rng, c.output_len or spec.output_len), prompt=prompt)], at=t, kind=c.name,
                            fields=dict(c.fields)))
            t += rng.expovariate(c.rate)
    return sorted(jobs, key=lambda j: j.at)


def _jsonl(spec: WorkloadSpec) -> list[Job]:
    if not spec.path:
        raise WorkloadError("the jsonl workload needs --dataset PATH")
    jobs = []
    try:
        with open(spec.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{spec.path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) or
                                                     isinstance(obj.get("messages"), list)):
                    raise WorkloadError(f"{spec.path}:{n}: each line needs a string 'prompt' or a list 'messages'")
                max_tokens = obj.get("max_tokens", spec.output_len[1])
                if not isinstance(max_tokens, int) or max_tokens < 1:
                    raise WorkloadError(f"{spec.path}:{n}: max_tokens must be a positive integer")
                if "messages" in obj:
                    jobs.append(Job([Turn(max_tokens, messages=obj["messages"])]))
                else:
                    jobs.append(Job([Turn(max_tokens, prompt=obj["prompt"])]))
                if len(jobs) >= spec.num_requests:
                    break
    except OSError as e:
        raise WorkloadError(f"{spec.path}: cannot read ({e.strerror})") from None
    if not jobs:
        raise WorkloadError(f"{spec.path}: no prompts in the file")
    return jobs


def arrival_times(jobs: list[Job], rate: float, process: str, seed: int) -> list[float]:
    """Start offsets in seconds: all at once (rate inf), evenly spaced (fixed) or Poisson; fixed times kept."""
    if rate <= 0:
        raise WorkloadError(f"--request-rate must be positive (or inf), not {rate}")
    if process not in ("poisson", "fixed"):
        raise WorkloadError(f"--arrival must be poisson or fixed, not {process!r}")
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for job in jobs:
        if job.at is not None:
            out.append(job.at)
            continue
        out.append(t)
        if rate != float("inf"):
            t += rng.expovariate(rate) if process == "poisson" else 1.0 / rate
    return out
