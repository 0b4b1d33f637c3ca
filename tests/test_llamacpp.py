"""Our logits against llama.cpp's (llama-cpp-python) on the same GGUF files.

transformers cannot load a llama GGUF with experts, so for llama's Mixtral-style MoE llama.cpp is
the oracle: a made model with a random router (4 experts, top-2) must give llama.cpp's logits. So
must the dense SmolLM2, a real model.

Which weight types give a tight check, and the tolerances. llama.cpp on a CPU multiplies F32 weights
by float32 activations, but converts the activations to F16 for F16 weights and quantizes them to 8
bits a value (Q8_0 / Q8_1 blocks) for Q8_0 and Q4 weights; its KV cache is F16 unless told
otherwise. We dequantize weights to float32 and keep activations and KV in float32. So:

- F32 weights, F32 KV cache: both sides compute the same float32 sums in another order. Measured:
  max 5.2e-6 on logits of size 4 (1.3e-6 relative). Tolerance 1e-4 relative to the largest logit:
  75x the measured error, and far below what a real mistake does (a top-1 instead of top-2 router
  moves logits by O(0.1): `test_tolerance_catches_a_real_mistake`).
- F16 weights: llama.cpp rounds each activation to F16 (2^-11 relative) before every matmul.
  Measured 1.0e-3 relative; tolerance 5e-3.
- Q8_0 weights (through our block kernels): llama.cpp's 8-bit activations move logits by 1.6%
  relative (measured) and flip an argmax now and then; tolerance 5e-2. A loose check, but a wrong
  block layout or scale moves logits by O(1).
- SmolLM2 (Q4_1): llama.cpp's 8-bit activations move its logits by up to 1.2 (of 30). That gap is
  all llama.cpp's own: SmolLM2's weights written out as F32 give llama.cpp logits within 1.2e-4
  (4e-6 relative) of ours, and ours sit as far from llama.cpp's Q4_1 logits as llama.cpp's F32 ones
  do.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (docs/TESTING.md: how it is built)",
                allow_module_level=True)

from gguf import GGMLQuantizationType, GGUFWriter

from strata_jax import Engine, EngineConfig
from strata_jax.gguf import GGUFModel
from strata_jax.gguf.writer import add_key

MOE = {"arch": "llama", "experts": 4, "experts_used": 2, "layers": 2, "hidden": 256, "heads": 4,
       "kv_heads": 2, "ffn": 256, "expert_ffn": 256}
TOLERANCE = {"F32": 1e-4, "F16": 5e-3, "Q8_0": 5e-2}

# llama.cpp runs in a child process: in this one torch (the transformers oracle) has loaded its own
# OpenMP runtime, and llama.cpp's threads on a second one can crash the process (two OpenMP runtimes
# in one process are a known cause of SIGSEGV; a CI run of this suite died by SIGSEGV right after
# llama.cpp ran).
_CHILD = """
import json, sys
import numpy as np
import llama_cpp
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
F32 = llama_cpp.GGML_TYPE_F32
llm = llama_cpp.Llama(path, logits_all=True, n_ctx=max(64, len(ids)), n_threads=2, verbose=False, type_k=F32, type_v=F32)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
llm.close()
"""  # noqa: E501


def llamacpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """float32 [T, vocab]: llama.cpp's logits for every token, F32 KV cache (see the module
    docstring)."""
    out = Path(path).with_name(f"llamacpp-logits-{len(ids)}.npy")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(ids), str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (f"llama.cpp failed on {path} (exit code "
                                  f"{done.returncode}):\n{done.stderr[-3000:]}")
    try:
        return np.load(out)
    finally:
        out.unlink()


_GREEDY_CHILD = """
import json, sys
import numpy as np
import llama_cpp
path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
F32 = llama_cpp.GGML_TYPE_F32
llm = llama_cpp.Llama(path, logits_all=True, n_ctx=max(64, len(ids) + n), n_threads=2, verbose=False, type_k=F32,
                      type_v=F32)
llm.eval(ids)
out = []
for _ in range(n):
    out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval(out[-1:])
print(json.dumps(out))
llm.close()
"""  # noqa: E501


def llamacpp_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    """llama.cpp's n greedy tokens after `ids` (the argmax of its logits, a token at a time; F32 KV
    cache)."""
    done = subprocess.run([sys.executable, "-c", _GREEDY_CHILD, str(path), json.dumps(ids), str(n)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (f"llama.cpp failed on {path} (exit code "
                                  f"{done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def our_logits(path: Path, ids: list[int], weights: str = "dequantized") -> np.ndarray:
    with Engine.from_gguf(path, EngineConfig(max_context=64, weights=weights, warmup=False)) as eng:
        return eng.logits(ids)


def random_ids(vocab: int, n: int = 32, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def max_rel_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("quant", ["F32", "F16", "Q8_0"])
def test_llama_moe_logits_match_llamacpp(tiny_model, quant):
    path = tiny_model(**MOE, quant=quant)
    assert GGUFModel.open(path).spec.n_experts == 4
    ids = random_ids(512)
    ref = llamacpp_logits(path, ids)
    ours = our_logits(path, ids, weights="blocks" if quant == "Q8_0" else "dequantized")
    assert ours.shape == ref.shape == (32, 512)
    err = max_rel_error(ours, ref)
    assert err <= TOLERANCE[quant], f"{quant}: max error {err:.2e} of the largest logit"
    if quant != "Q8_0":          # 8-bit activations may flip a near tie
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_tolerance_catches_a_real_mistake(tiny_model, monkeypatch):
    """Routing each token to one expert instead of two is far outside the F32 tolerance."""
    import dataclasses

    from strata_jax.gguf import ModelSpec

    path = tiny_model(**MOE, quant="F32")
    ids = random_ids(512)
    ref = llamacpp_logits(path, ids)
    real = ModelSpec.from_metadata.__func__
    monkeypatch.setattr(ModelSpec, "from_metadata",
                        classmethod(lambda cls, *a, **k: dataclasses.replace(real(cls, *a, **k),
                                                                             n_experts_used=1)))
    assert max_rel_error(our_logits(path, ids), ref) > 100 * TOLERANCE["F32"]


def write_f32_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized to F32 (the gguf package's reference dequantization,
    which our kernels match bit for bit): llama.cpp then multiplies float32 activations, as we
    do."""
    model = GGUFModel.open(src)
    writer = GGUFWriter(dst, model.metadata["general.architecture"])
    for key, value in model.metadata.items():
        if key not in ("general.architecture", "general.file_type"):
            add_key(writer, key, value, *model.metadata_types[key])
    for name, t in model.tensors.items():
        writer.add_tensor(name, t.dequantize(), raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def smollm2():
    from strata_jax.fetch import smollm2_path

    return smollm2_path()


def test_smollm2_logits_match_llamacpp(smollm2, tmp_path):
    text = ("The capital of France is Paris. The capital of Germany is Berlin. The capital of "
            "Italy is Rome, the capital of Spain is Madrid, and the capital of Portugal is")
    with Engine.from_gguf(smollm2,
                          EngineConfig(max_context=64, warmup=False, cpu_math="exact")) as eng:
        # GGUF blocks read by the C++ kernels, the exact math (dequantized in registers, float32
        # sums)
        assert eng.stats()["weights"] == "blocks" and eng.stats()["backend"] == "cpu-exact"
        ids = eng.tokenizer.encode(text, add_special=True)[:32]
        assert len(ids) == 32
        ours = eng.logits(ids)
    with Engine.from_gguf(smollm2, EngineConfig(max_context=64, warmup=False)) as eng:
        # the default: 8-bit activations, as llama.cpp's
        assert eng.stats()["backend"] == "cpu"
        ours8 = eng.logits(ids)
    ref_q4 = llamacpp_logits(smollm2, ids)
    ref_f32 = llamacpp_logits(write_f32_copy(smollm2, tmp_path / "smollm2-f32.gguf"), ids)

    # Tight: the same float32 weights on both sides.
    assert max_rel_error(ours, ref_f32) <= TOLERANCE["F32"]
    assert (ours.argmax(-1) == ref_f32.argmax(-1)).all()
    # On the Q4_1 file itself we differ from llama.cpp by what its 8-bit activations cost it, no
    # more.
    gap = np.abs(ref_q4 - ref_f32).max()
    assert np.abs(ours - ref_q4).max() <= gap + TOLERANCE["F32"] * np.abs(ref_q4).max()
    assert max_rel_error(ours, ref_q4) <= 0.1
    assert (ours.argmax(-1) == ref_q4.argmax(-1)).mean() >= 0.9
    # The int8 math quantizes activations as llama.cpp does: about as far from the float32 logits as
    # llama.cpp's Q4_1 logits are (measured: 1.16 against their 1.19, of logits ~30), with its top-1
    # tokens.
    assert np.abs(ours8 - ref_f32).max() <= 1.5 * gap
    assert (ours8.argmax(-1) == ref_q4.argmax(-1)).mean() >= 0.9
    assert np.abs(ours8 - ours).max() > 0


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_llamacpp_loads_and_runs_our_hybrid_files(tiny_model, arch):
    """The format oracle of issue 34's item 1: llama.cpp loads make-model's qwen3next / qwen35moe
    files (every tensor's name and shape, the ssm.* keys, the layer pattern, qwen35moe's rope
    sections) and runs them to finite logits; strata-jax reads the same file
    (tests/test_hybrid_read.py)."""
    from llama_cpp import Llama

    path = tiny_model(arch=arch, layers=4, hidden=64, heads=4, kv_heads=2, experts=8,
                      experts_used=2, expert_ffn=32, shared_ffn=64)
    llm = Llama(str(path), n_ctx=64, verbose=False, logits_all=True)
    tokens = llm.tokenize(b"hello world, again")
    llm.eval(tokens)
    scores = np.asarray(llm.scores[:len(tokens)])
    assert scores.shape == (len(tokens), 512) and np.isfinite(scores).all() and scores.std() > 0


def test_mxfp4_experts_match_llamacpp(tiny_model):
    """make-model --expert-quant MXFP4 (gpt-oss's expert type), F32 elsewhere
    (tests/test_mxfp4_model.py's model): llama.cpp reads our file; its logits (8-bit activations
    for MXFP4, its Q8_0 vec_dot) are within the Q8_0 tolerance of ours on both maths, and its 8
    greedy tokens are ours."""
    from test_mxfp4_model import MXFP4_MOE

    path = tiny_model(**MXFP4_MOE)
    ids = random_ids(512)
    ref, greedy = llamacpp_logits(path, ids), llamacpp_greedy(path, ids, 8)
    for math in ("exact", "int8"):
        with Engine.from_gguf(path, EngineConfig(max_context=64, cpu_math=math,
                                                 warmup=False)) as eng:
            ours = eng.logits(ids)
            tokens = eng.generate(ids, max_tokens=8, ignore_eos=True).tokens
        err = max_rel_error(ours, ref)
        assert err <= TOLERANCE["Q8_0"], f"MXFP4 {math}: max error {err:.2e} of the largest logit"
        assert tokens == greedy, math
