"""Any local Hugging Face folder of a supported architecture loads, and computes what
transformers computes (tiny random models built and saved by the test)."""

import pytest
import torch

from app.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from app.engine.engine import LLMEngine
from app.engine.engine_request import EngineRequest
from app.engine.request import SamplingParams
from app.model.loader import load_model
from tests.engine.util import run

transformers = pytest.importorskip("transformers")

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,  # well-spread logits: greedy has no near-ties
)


def llama3_config(vocab):
    return transformers.LlamaConfig(
        vocab_size=vocab,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        **COMMON,
    )


def mistral_config(vocab):
    return transformers.MistralConfig(
        vocab_size=vocab, tie_word_embeddings=False, sliding_window=None, **COMMON
    )


def qwen2_config(vocab):
    return transformers.Qwen2Config(
        vocab_size=vocab, tie_word_embeddings=False, use_sliding_window=False, **COMMON
    )


@pytest.fixture(params=[llama3_config, mistral_config, qwen2_config], ids=lambda f: f.__name__)
def hf_folder(request, tmp_path, tokenizer):
    torch.manual_seed(0)
    config = request.param(len(tokenizer))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if getattr(config, "model_type", "") == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, model


def test_logits_and_greedy_equal_transformers(hf_folder):
    path, hf = hf_folder
    loaded = load_model(ModelConfig(model=str(path)))
    assert loaded.arch.architecture == hf.config.model_type
    # Small steps: prompts are chunked and later chunks attend through block tables.
    engine = LLMEngine(
        EngineConfig(
            cache=CacheConfig(kv_cache_bytes=16 << 20),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            debug_checks=True,
        ),
        loaded,
    )
    prompt = list(range(1000, 1040))
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
        ref_tokens = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()

    engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "g")
    )
    got = run(engine)["g"].token_ids
    assert got == ref_tokens

    # Logits of the whole prompt in one step, straight from the model.
    whole = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_bytes=16 << 20)), loaded)
    whole.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=1), "l"))
    inp = whole.runner.prepare(whole.scheduler.schedule())
    assert inp.input_ids.numel() == len(prompt)
    with torch.no_grad():
        ours = whole.model(
            inp.input_ids, inp.positions, whole.kv_cache.layers, inp.meta, inp.logits_indices
        )[0]
    assert (ours - ref_logits).abs().max().item() < 1e-4


def test_missing_pieces_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(ModelConfig(model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(ModelConfig(model=str(tmp_path)))
