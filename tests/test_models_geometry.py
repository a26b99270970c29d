"""shadowkv_core/models/geometry.py: model directories of a named geometry for random-weight runs."""
import torch
from transformers import AutoTokenizer

from serve_app.app import AppArgs, resolve_model
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams
from shadowkv_core.models.geometry import TINY, TINY_SHADOWKV, model_spec, write_config, write_geometry


def test_a_config_directory_loads_with_random_weights_at_its_geometry():
    model = write_config({**TINY, "max_position_embeddings": 2048})
    spec = model_spec(model)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == \
        (TINY["num_hidden_layers"], TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"],
         TINY["vocab_size"])
    engine = LLMEngine(EngineConfig(model=model, load_format="dummy", shadowkv=TINY_SHADOWKV, max_model_len=1024,
                                    gpu_cache_gib=0.05, host_cache_gib=0.05))
    prompt = torch.randint(0, TINY["vocab_size"], (300,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))  # past min_context: ShadowKV
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.close()
    assert [len(o.token_ids) for o in outputs if o.finished] == [4]


def test_geometry_directory_streams_every_token_as_one_word():
    model = write_geometry(TINY)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.decode([5, TINY["vocab_size"] - 1, 0], skip_special_tokens=True) == "t5 t511 t0"
    assert resolve_model(AppArgs(model=model, engine={"load_format": "dummy"})) == model  # a checkpoint, weightless
