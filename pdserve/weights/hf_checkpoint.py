"""Load a local Hugging Face checkpoint directory: config.json + single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.tokenizer import load_hf_tokenizer
from pdserve.weights.hf_config import model_config_from_hf
from pdserve.weights.source import ModelSource, Weights


def _read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json (not a checkpoint directory)")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {str(config_file)!r} is not valid JSON ({e})") from None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"model: corrupt {str(index)!r} ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: shards listed in the index are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {str(path)!r} has no *.safetensors weights")
    return files


def _iter_safetensors(files: list[Path]) -> Weights:
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"model: corrupt safetensors file {str(file)!r} ({e})") from None


def load_hf_checkpoint(path: Path) -> ModelSource:
    cfg = _read_config(path)
    config = model_config_from_hf(cfg)
    files = _safetensors_files(path)
    return ModelSource(
        name=str(path),
        config=config,
        weights=lambda: _iter_safetensors(files),
        tokenizer=load_hf_tokenizer(path, config),
        hf_model_type=cfg["model_type"],
    )
