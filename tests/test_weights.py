"""Loading models: presets, checkpoint directories, GGUF, and the errors for bad sources."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.weights.gguf_file import unpermute_rope

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="neither a preset .*smollm2-135m.*tiny-llama"):
        LLM("no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


def test_corrupt_config_json(tmp_path, hf_checkpoints):
    source, _ = hf_checkpoints("llama")
    shutil.copytree(source, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        LLM(str(tmp_path / "ckpt"))


def test_unsupported_architecture(tmp_path, hf_checkpoints):
    source, _ = hf_checkpoints("llama")
    shutil.copytree(source, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type: 'gpt_neox' is not supported"):
        LLM(str(tmp_path / "ckpt"))


def test_corrupt_safetensors(tmp_path, hf_checkpoints):
    source, _ = hf_checkpoints("llama")
    shutil.copytree(source, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        LLM(str(tmp_path / "ckpt"))


def test_missing_tensor_is_named(tmp_path, hf_checkpoints):
    source, _ = hf_checkpoints("llama")
    shutil.copytree(source, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(
        ValueError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.qkv_proj"
    ):
        LLM(str(tmp_path / "ckpt"))


def test_sharded_checkpoint_loads_like_single_file(tmp_path, hf_checkpoints):
    source, _ = hf_checkpoints("llama")
    ckpt = tmp_path / "sharded"
    shutil.copytree(source, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (
        ("model-00001-of-00002.safetensors", names[:half]),
        ("model-00002-of-00002.safetensors", names[half:]),
    ):
        save_file({n: tensors[n] for n in part}, ckpt / shard)
        weight_map.update({n: shard for n in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompt = [[5, 6, 7, 8]]
    assert LLM(str(ckpt)).generate(prompt, GREEDY)[0].token_ids == (
        LLM(str(source)).generate(prompt, GREEDY)[0].token_ids
    )


def test_fused_expert_tensors_are_accepted(tmp_path, hf_checkpoints):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H]) loads too."""
    source, _ = hf_checkpoints("deepseek_v2")
    ckpt = tmp_path / "fused"
    shutil.copytree(source, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    prefix = "model.layers.1.mlp.experts."
    n = 8
    gate_up = torch.stack(
        [
            torch.cat(
                [
                    tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                    tensors.pop(f"{prefix}{e}.up_proj.weight"),
                ]
            )
            for e in range(n)
        ]
    )
    down = torch.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])
    tensors[f"{prefix}gate_up_proj"] = gate_up
    tensors[f"{prefix}down_proj"] = down
    save_file(tensors, ckpt / "model.safetensors")
    prompt = [[9, 10, 11]]
    assert LLM(str(ckpt)).generate(prompt, GREEDY)[0].token_ids == (
        LLM(str(source)).generate(prompt, GREEDY)[0].token_ids
    )


def test_gguf_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        LLM(str(bad))


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's convert script: reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope(permuted, heads), w)


def test_mistral_sliding_window_caps_the_model_length(hf_checkpoints):
    directory, _ = hf_checkpoints("mistral")
    # full attention equals sliding-window attention within one window
    assert LLM(str(directory)).model_config.max_position == 512


def test_a_random_model_of_a_config_file_is_the_preset_of_that_shape(tmp_path):
    """random:CONFIG.json builds that architecture with the presets' seeded weights: for
    tiny-llama's own shape, the same weights and so the same greedy tokens."""
    import json

    from pdserve import LLM, SamplingParams
    from pdserve.weights import model_config, resolve
    from pdserve.weights.presets import TINY_CONFIGS

    c = TINY_CONFIGS["tiny-llama"]
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "vocab_size": c.vocab_size,
                "max_position_embeddings": c.max_position,
                "rope_theta": c.rope.theta,
                "rms_norm_eps": c.rms_norm_eps,
                "tie_word_embeddings": c.tie_word_embeddings,
            }
        )
    )
    source = resolve(f"random:{config}")
    assert source.config.num_kv_heads == c.num_kv_heads and source.name.startswith("random:")
    # what the simulator and sim-vs-real read: the architecture alone, from the same name
    assert model_config(f"random:{config}") == source.config
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = [[5, 6, 7, 8, 9]]
    got = LLM(f"random:{config}").generate(prompt, params)[0].token_ids
    assert got == LLM("tiny-llama").generate(prompt, params)[0].token_ids
    with pytest.raises(ValueError, match="does not exist"):
        resolve(f"random:{tmp_path / 'missing.json'}")


def test_random_weights_are_drawn_on_the_engines_device_and_the_same_on_any_cpu():
    """A random model's source makes its weights where the model is built (a GPU draws its
    own); for a CPU engine they come from the host generator, whatever the machine has."""
    from pdserve.weights import resolve

    source = resolve("tiny-llama")
    assert source.draws_on_device
    on_cpu = dict(source.weights_on(torch.device("cpu")))
    plain = dict(source.weights())
    assert on_cpu.keys() == plain.keys()
    assert all(torch.equal(on_cpu[k], plain[k]) and on_cpu[k].device.type == "cpu" for k in plain)
