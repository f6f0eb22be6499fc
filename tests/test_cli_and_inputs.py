"""Bad model files and flags fail fast with one clear line; templates from files are sandboxed; CLI works."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import gguf
from justapi.model.chat_template import ChatTemplate, ChatTemplateError
from justapi.model.gguf_loader import ModelLoadError, load_tensors, open_gguf, read_model_config
from tiny_gguf import write_tiny_model


def run_cli(*args, timeout=120):
    """``justapi ARGS`` in a new process: the command as a user runs it (the smoke test)."""
    return subprocess.run([sys.executable, "-m", "justapi.cli", *args], capture_output=True, text=True, timeout=timeout)


def cli_in_process(*args):
    """``justapi ARGS`` run by cli.main in this process (no interpreter to start, no torch to import again): exit
    status and output as a subprocess would give them, an escaping exception as status 1 and its traceback."""
    import contextlib
    import io
    import traceback

    import torch

    from justapi import cli

    class NoServer:  # these tests pass flags that must fail before a server starts; one that starts fails here
        def __init__(self, *args, **kw):
            raise AssertionError("justapi serve got as far as starting the HTTP server")

    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    real_server = cli._uvicorn_server_class
    cli._uvicorn_server_class = lambda: NoServer
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: --help, usage errors
            code = e.code if isinstance(e.code, int) else 2
        except Exception:  # noqa: BLE001 - what a user would see as a traceback
            traceback.print_exc()
            code = 1
        finally:
            cli._uvicorn_server_class = real_server
    torch.set_num_threads(threads)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def test_missing_not_gguf_truncated_and_unsupported_files(tmp_path, tiny_model):
    assert_clean_error(cli_in_process("serve", "--model", str(tmp_path / "nope.gguf")), "nope.gguf", "no such file")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    assert_clean_error(cli_in_process("serve", "--model", str(text)), "notes.gguf", "not a GGUF file")
    data = open(tiny_model, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert_clean_error(cli_in_process("serve", "--model", str(cut)), "cut.gguf", "truncated")
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    assert_clean_error(cli_in_process("generate", "--model", str(head), "--prompt", "x"), "head.gguf", "corrupt")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_clean_error(cli_in_process("serve", "--model", path), "unsupported architecture 'gpt2'",
                       "llama, qwen2, qwen3")


def rewrite_gguf(src: str, dst: str, drop_keys=(), drop_tensors=(), replace=None, extra_tensors=None,
                 replace_keys=None) -> str:
    """``src`` written again as ``dst`` without the metadata keys starting with any of ``drop_keys``, without the
    tensors ``drop_tensors``, with ``replace(tensor) -> (raw array, raw dtype)`` for the tensors it names, with
    ``extra_tensors`` (name -> fp32 array) added, and with ``replace_keys`` (key -> a str or int value) set (the
    architecture's keys keep their prefix)."""
    reader = open_gguf(src)
    keys = dict(replace_keys or {})
    w = gguf.GGUFWriter(dst, keys.pop("general.architecture", reader.fields["general.architecture"].contents()))
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    for key, field in reader.fields.items():
        if (key.startswith("GGUF.") or key == "general.architecture" or key.startswith(tuple(drop_keys))
                or key in keys):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        replaced = replace(t) if replace is not None else None
        if replaced is not None:
            w.add_tensor(t.name, replaced[0], raw_dtype=replaced[1])
        else:
            w.add_tensor(t.name, np.array(t.data),
                         raw_dtype=t.tensor_type if t.tensor_type != gguf.GGMLQuantizationType.F32 else None)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unsupported_tensor_type_is_named(tmp_path):
    import gguf.quants

    qtype = next(q for q in gguf.GGMLQuantizationType
                 if q not in gguf.quants._type_traits
                 and q not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
                 and q in gguf.GGML_QUANT_SIZES)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    path = write_tiny_model(str(tmp_path / "odd.gguf"), hidden=256, intermediate=256)
    odd = lambda t: ((np.zeros((256, 256 // block * nbytes), dtype=np.uint8), qtype)  # noqa: E731
                     if t.name == "blk.0.ffn_down.weight" else None)
    path2 = rewrite_gguf(path, str(tmp_path / "odd2.gguf"), replace=odd)
    reader = open_gguf(path2)
    read_model_config(reader, path2)
    with pytest.raises(ModelLoadError, match=f"blk.0.ffn_down.weight has type {qtype.name}"):
        load_tensors(reader, path2, __import__("torch").float32, False)


def test_a_file_missing_its_tokenizer_a_key_or_a_tensor_fails_in_one_line_naming_it(tmp_path):
    gemma = write_tiny_model(str(tmp_path / "gemma3.gguf"), "gemma3", tokenizer="llama", num_layers=6)
    cases = [
        (dict(drop_keys=["tokenizer."]), "the file has no tokenizer (tokenizer.ggml.model is missing)"),
        (dict(drop_keys=["gemma3.block_count"]), "metadata key gemma3.block_count is missing"),
        (dict(drop_tensors=["blk.3.post_ffw_norm.weight"]), "tensor blk.3.post_ffw_norm.weight is missing"),
    ]
    for i, (drop, message) in enumerate(cases):
        path = rewrite_gguf(gemma, str(tmp_path / f"broken{i}.gguf"), **drop)
        assert_clean_error(cli_in_process("generate", "--model", path, "--prompt", "x"), f"broken{i}.gguf", message)


def test_impossible_tp_and_disaggregation_settings_are_refused_naming_the_flag(tiny_model):
    assert_clean_error(cli_in_process("serve", "--model", tiny_model, "--tp", "5"), "--tp 5", "4 attention heads")
    assert_clean_error(cli_in_process("serve", "--model", tiny_model, "--disaggregate", "--prefill-workers", "0",
                               "--scheduled"), "--prefill-workers must be a positive integer")
    assert_clean_error(cli_in_process("serve", "--model", tiny_model, "--gamma", "4"), "--gamma needs a proposer")


def test_bad_speculation_settings_fail_at_start_up_naming_the_flag(tiny_model, tmp_path):
    """Through the CLI; every other refused combination is checked on EngineConfig in test_spec_draft.py."""
    def serve(*flags):
        return cli_in_process("serve", "--model", tiny_model, *flags)

    assert_clean_error(serve("--draft-model", tiny_model, "--branch", "3", "--gamma", "4"),
                       "120 nodes", "--spec-tree-nodes 64")
    assert_clean_error(serve("--draft-model", str(tmp_path / "missing.gguf")), "--draft-model", "no such file")
    other = write_tiny_model(str(tmp_path / "spm.gguf"), "llama", tokenizer="llama")
    assert_clean_error(serve("--draft-model", other), "--draft-model", "llama tokenizer", "gpt2 tokenizer")


def test_serve_help_documents_every_flag_with_defaults():
    from justapi import config as C
    from justapi.flags import cli_fields, flag_name
    from justapi.server_config import ServerConfig

    out = cli_in_process("serve", "--help").stdout
    for cls in (C.EngineConfig, ServerConfig):
        for f in cli_fields(cls):
            assert flag_name(f) in out, flag_name(f)
    for flag in ("--no-prefix-cache", "--static-batching", "--threads", "--disable-kernels", "--log-level"):
        assert flag in out, flag
    assert "default: 127.0.0.1" in out and "default: 8000" in out and "default: 32" in out and "default: 512" in out


def test_the_readme_flags_table_is_generated_from_the_config():
    """The README's flags table is flags.flags_table() verbatim: regenerate it with
    python -c 'from justapi.flags import flags_table; print(flags_table())'"""
    import pathlib

    from justapi.flags import flags_table

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    assert flags_table() in readme, "README.md's flags table is stale: paste flags.flags_table()'s output"


def test_the_architecture_page_names_every_module():
    """docs/architecture.md has a line for each module of the package (and only for modules that exist)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parent.parent
    page = (root / "docs" / "architecture.md").read_text()
    modules = {str(p.relative_to(root)) for p in (root / "justapi").rglob("*") if p.suffix in (".py", ".cpp", ".h")
               and p.name != "__init__.py" or p == root / "justapi" / "kernels" / "__init__.py"}
    named = set(re.findall(r"`(justapi/[^`]+)`", page))
    assert modules - named == set(), "modules without a line in docs/architecture.md"
    assert named - modules == set(), "docs/architecture.md names modules that do not exist"


def test_flags_become_the_config_continuous_batching_by_default():
    """Every flag lands in its config field; continuous batching unless --static-batching; --scheduled (the old
    way to ask for continuous batching) is still accepted."""
    from justapi.startup import build_parser, engine_config
    from justapi.server_config import ServerConfig
    from justapi.flags import config_from_args

    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--threads", "3", "--no-prefix-cache",
                                      "--disable-kernels", "amx,prepack", "--port", "9000"])
    cfg = engine_config(args)
    assert not cfg.static_batching and cfg.num_threads == 3 and not cfg.prefix_cache
    assert cfg.disabled_kernels == ("amx", "prepack") and cfg.model == "m.gguf"
    assert config_from_args(ServerConfig, args).port == 9000
    static = engine_config(build_parser().parse_args(["serve", "--model", "m.gguf", "--static-batching"]))
    assert static.static_batching


def test_threads_default_to_the_cores_this_process_may_use_not_the_hosts():
    """Under taskset or a container's cpuset, os.cpu_count() still counts the host's cores; threads are split over the
    cores the process may run on (one here), or --tp's ranks would each start the host's count on one core."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from justapi.config import usable_cores; print(usable_cores())")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "1\n"


def test_generate_streams_a_completion(tiny_model):
    proc = run_cli("generate", "--model", tiny_model, "--prompt", "the cat", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_gpu_flag_without_cuda_fails_clearly(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_clean_error(cli_in_process("generate", "--model", tiny_model, "--prompt", "x", "--gpu"), "CUDA")


def test_chat_template_sandbox_blocks_python_internals():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render([{"role": "user", "content": "hi"}])
    evil2 = ChatTemplate("{{ messages.__class__.__init__.__globals__['os'].system('echo pwned') }}")
    with pytest.raises(ChatTemplateError):
        evil2.render([{"role": "user", "content": "hi"}])
    ok = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert ok.render([{"role": "user", "content": "hi"}]) == "user: hi\n"
    raising = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(ChatTemplateError, match="only user and assistant roles"):
        raising.render([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate(None).render([])


def test_incremental_detokenizer_never_splits_a_character(tiny_llm):
    from justapi.model.tokenizer import IncrementalDetokenizer

    tok = tiny_llm.tokenizer
    text = "héllo wörld ✓ 日本"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], True)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # multi-byte characters waited for their last byte


def test_bytes_that_never_make_a_character_stream_as_they_come(tiny_llm):
    """A model emitting stray byte tokens (a lead byte over and over: SmolLM2 does so on some random prompts) gets
    replacement characters streamed a few tokens behind, not its whole output held back to the end."""
    from justapi.model.tokenizer import IncrementalDetokenizer

    tok = tiny_llm.tokenizer
    lead, _ = tok.encode("é")  # é is two byte tokens here; its first byte alone never completes
    ids = [lead] * 20 + tok.encode(" ok ✓ é")
    detok = IncrementalDetokenizer(tok, [], True)
    pieces = [detok.add([i]) for i in ids] + [detok.add([], final=True)]
    assert "".join(pieces) == tok.decode(ids, True) == "\ufffd" * 20 + " ok ✓ é"
    assert next(i for i, p in enumerate(pieces) if p) <= 4  # at most 4 tokens behind (HOLD_TOKENS)
    assert pieces[-1] == ""  # nothing was left for the end


def test_sentencepiece_vocabulary_from_gguf(tmp_path):
    from justapi import LLM, SamplingParams
    from justapi.model.tokenizer import IncrementalDetokenizer

    path = write_tiny_model(str(tmp_path / "spm.gguf"), tokenizer="llama")
    llm = LLM(path, pool_blocks=64, show_progress=False)
    tok = llm.tokenizer
    text = "hello world, the cat sat é"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 1  # SentencePiece files add BOS unless they say otherwise
    assert tok.decode(ids) == text
    assert ids[-2:] == [3 + 0xC3, 3 + 0xA9]  # é has no piece: it falls back to its two UTF-8 bytes
    detok = IncrementalDetokenizer(tok, ids[:1], True)
    assert "".join(detok.add([i]) for i in ids[1:]) == text
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.prompt_token_ids == ids


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_cached_tokenizer_encodes_and_decodes_as_the_one_converted_from_the_file(tmp_path, monkeypatch, kind):
    """The first start converts the file's vocabulary (transformers' GGUF converter, its tokenizer class named) and
    saves the result under the cache directory; later starts load it without converting. Both must tokenize exactly
    as AutoTokenizer does on the file."""
    from transformers import AutoTokenizer

    from justapi.model import tokenizer as T

    monkeypatch.setenv("JUSTAPI_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_model(str(tmp_path / f"{kind}.gguf"), tokenizer=kind)
    T._hf_tokenizer.cache_clear()
    built = T.Tokenizer(path, open_gguf(path))
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1
    T._hf_tokenizer.cache_clear()

    def no_conversion(*a, **k):
        raise AssertionError("the cached tokenizer was not used")

    monkeypatch.setattr(T, "_convert", no_conversion)
    cached = T.Tokenizer(path, open_gguf(path))
    T._hf_tokenizer.cache_clear()
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{kind}.gguf", local_files_only=True)
    texts = ["hello world, the cat sat é", "  two  spaces\nand a line", "über 42 ünïcode ✓", ""]
    for text in texts + [built.bos_token + "hello" + built.eos_token]:
        assert built.hf.encode(text) == reference.encode(text)
        assert cached.encode(text) == built.encode(text)
        ids = built.encode(text)
        assert cached.decode(ids) == built.decode(ids) and cached.decode(ids, False) == built.decode(ids, False)
    assert cached.special_ids == built.special_ids and cached.eos_token_ids == built.eos_token_ids


def test_metadata_arrays_read_in_one_pass_equal_ggufs_own_reading(tiny_model, tmp_path, real_model_path):
    """The loader's reader cuts a metadata array's parts from the file in one pass (SmolLM2's 49k-token vocabulary:
    0.12 s against gguf's 0.61 s; Gemma 3's 262k: 0.40 against 2.8): every field's parts, their dtypes and bytes, its
    data indices, types and contents equal gguf's own GGUFReader's, on a byte-level BPE file, a SentencePiece one
    with scores and token types, a file with an empty array, and SmolLM2's."""
    from justapi.model.gguf_reader import reader_class

    spm = write_tiny_model(str(tmp_path / "spm.gguf"), "llama", tokenizer="llama")
    empty = str(tmp_path / "empty.gguf")
    writer = gguf.GGUFWriter(empty, "llama")
    writer.add_array("test.empty", [])
    writer.add_array("test.floats", [1.5, -2.0])
    writer.add_array("test.strings", ["", "é", "a b"])
    writer.add_tensor("x", np.zeros((2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (tiny_model, spm, empty, real_model_path):
        ours, ref = reader_class()(path, "r"), gguf.GGUFReader(path, "r")
        assert list(ours.fields) == list(ref.fields), path
        for name, f in ref.fields.items():
            g = ours.fields[name]
            assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types), name
            assert [(p.dtype, p.shape, p.tobytes()) for p in g.parts] == [(p.dtype, p.shape, p.tobytes())
                                                                           for p in f.parts], name
            assert g.contents() == f.contents(), name


def test_several_model_mistakes_fail_at_start_up_in_one_line(tiny_model, tmp_path):
    """--model repeated and --models-dir (engine.model_catalog), --models-memory, keep_alive and hub references:
    each mistake one line naming it, before anything loads."""
    from justapi.hub import HubError, choose_file, parse_ref
    from justapi.server.errors import ApiError
    from justapi.server.models_app import keep_alive_seconds

    serve = lambda *flags: cli_in_process("serve", *flags)  # noqa: E731
    assert_clean_error(serve("--model", f"a={tiny_model}", "--model", f"a={tiny_model}"), "two models are named 'a'")
    assert_clean_error(serve("--model", tiny_model, "--model", str(tmp_path / "nope.gguf")), "nope.gguf: no such file")
    assert_clean_error(serve("--models-dir", str(tmp_path / "none")), "--models-dir", "no such folder")
    assert_clean_error(serve("--models-dir", str(tmp_path)), "no .gguf file in it")
    (tmp_path / "m.gguf").write_bytes(open(tiny_model, "rb").read())
    for toml, needle in (('aliases = "x"', "must be tables"), ('[aliases]\nc = "gone"', "alias 'c' names 'gone'"),
                         ('[flags]\nm = ["--port", "1"]', "--port is set by the server"),
                         ('[models]\n', "unknown table 'models'"), ("[aliases", "models.toml")):
        (tmp_path / "models.toml").write_text(toml)
        assert_clean_error(serve("--models-dir", str(tmp_path)), needle)
    (tmp_path / "models.toml").unlink()
    assert_clean_error(serve("--models-dir", str(tmp_path), "--models-memory", "lots"), "--models-memory must be")
    assert_clean_error(cli_in_process("generate", "--model", tiny_model, "--model", tiny_model, "--prompt", "x"),
                       "one --model at a time here")
    assert [keep_alive_seconds(v) for v in (None, 0, "5m", "1h30m", "-1", -5, "90", 10**400, "9999999h")] == [
        None, 0.0, 300.0, 5400.0, -1.0, -1.0, 90.0, -1.0, -1.0]
    for bad in ("soon", "5 m", True, [1]):
        with pytest.raises(ApiError, match="keep_alive must be"):
            keep_alive_seconds(bad)
    assert parse_ref("hf:org/repo:Q8_0") == ("org/repo", "Q8_0") and parse_ref("org/repo") == ("org/repo", None)
    with pytest.raises(HubError, match="not ORG/REPO"):
        parse_ref("repo-only")
    files = ["a-Q4_K_M.gguf", "a-Q8_0.gguf", "mmproj-a-f16.gguf", "README.md"]
    assert choose_file("o/a", files, None) == "a-Q4_K_M.gguf" and choose_file("o/a", files, "q8_0") == "a-Q8_0.gguf"
    with pytest.raises(HubError, match="one part of a split GGUF"):
        choose_file("o/b", ["b-Q4_K_M-00001-of-00002.gguf", "b-Q4_K_M-00002-of-00002.gguf"], None)
