"""cProfile of single-stream decode in process: a 128-token prompt, 128 greedy tokens, --dtype auto.

usage: python benchmarks/profile_single_stream.py   (prints tok/s and the 14 costliest functions)
"""
import cProfile, pstats, random, time
from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path
llm = LLM(default_model_path(), scheduled=True, pool_blocks=512, show_progress=False)
rng = random.Random(0)
p = [rng.randrange(300, 40000) for _ in range(128)]
llm.generate([p[:16]], SamplingParams(max_tokens=4))
prof = cProfile.Profile()
prof.enable(); t = time.perf_counter()
llm.generate([p], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
el = time.perf_counter() - t; prof.disable()
print(f"128 tokens in {el:.2f} s = {128/el:.1f} tok/s")
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
