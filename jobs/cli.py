"""The client side of the ``prefillq`` command line: ``submit``, ``status``, ``cancel``,
``result`` and ``reap``.

These commands need only the light client (redis, rq, msgpack): a web backend's install of
``prefillq`` runs them without MLX. `worker.cli` adds the worker-side commands and owns the
entry point. With ``--json`` the last stdout line is one JSON object; errors are one line on
stderr (`CLIError` and `jobs.errors` types, exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

from . import keys
from .client import PrefillClient, redis_url
from .defaults import REDIS_URL_ENV
from .errors import JobCanceled, JobFailed
from .requests import SubmitRequest
from .result import result_record
from .schema import JobState, LogitsMode

SAMPLE_PROMPT = "The capital of France is"
# The `SubmitRequest` fields ``prefillq submit`` takes as flags, beside the prompt's source
# (`prompt_input`); each flag defaults to the field's default.
SUBMIT_FLAGS = ("model", "top_k", "logits", "session", "priority", "tenant", "chunk_tokens",
                "prompt_logprobs", "continuations")
SUBMIT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SubmitRequest)}


class CLIError(Exception):
    """A usage or input error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2, like
    every other prefillq error: ``prefillq: error: <what> (see `prefillq submit --help`)``
    instead of argparse's usage block above it. Its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"prefillq: error: {message} (see `{self.prog} --help`)\n")


def int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum` (so a bad size fails before any model
    loads); it raises ``argparse.ArgumentTypeError`` otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"want an integer >= {minimum}, got {text!r}")
        return value

    return parse


non_negative_int = int_at_least(0)
positive_int = int_at_least(1)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (seconds to wait); it raises
    ``argparse.ArgumentTypeError`` otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"want a number of seconds >= 0, got {text!r}")
    return value


def add_redis(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--redis", required=required, default=None,
                   help="Redis URL: redis://[[USER]:PASSWORD@]HOST:PORT/DB, rediss://... for "
                        f"TLS (default ${REDIS_URL_ENV}, which keeps a password out of ps; "
                        "else redis://localhost:6379/0)")


def prompt_input(args: argparse.Namespace, positional: str | None = None) -> dict:
    """The submit input from TEXT / --prompt / --prompt-file / --tokens-file / --messages-file.

    Returns ``{"prompt": text}``, ``{"tokens": ids}`` or ``{"messages": chat,
    "add_generation_prompt": bool}``; the sample prompt when none given. The messages'
    shape is checked by `submit` (`jobs.requests.check_messages`).

    Raises:
        CLIError: two sources, an unreadable file, a tokens file that is not a JSON array
            of integers, or a messages file that is not a JSON array.
    """
    given = {
        "text": positional,
        "prompt": getattr(args, "prompt", None),
        "prompt_file": getattr(args, "prompt_file", None),
        "tokens_file": getattr(args, "tokens_file", None),
        "messages_file": getattr(args, "messages_file", None),
    }
    chosen = {k: v for k, v in given.items() if v is not None}
    if len(chosen) > 1:
        raise CLIError(f"give one prompt source, got {', '.join(chosen)}")
    if "tokens_file" in chosen:
        # each id is checked by `submit`, whose error names the first bad one
        return {"tokens": _json_file("--tokens-file", chosen["tokens_file"], "integers")}
    if "messages_file" in chosen:
        messages = _json_file("--messages-file", chosen["messages_file"],
                              '{"role": ..., "content": ...} objects')
        return {"messages": messages,
                "add_generation_prompt": not getattr(args, "no_generation_prompt", False)}
    if "prompt_file" in chosen:
        try:
            return {"prompt": Path(chosen["prompt_file"]).read_text(encoding="utf-8")}
        except OSError as e:
            raise CLIError(f"--prompt-file: {e}") from e
        except UnicodeDecodeError as e:
            raise CLIError(f"--prompt-file {chosen['prompt_file']} is not UTF-8 text: byte "
                           f"{e.start} ({e.object[e.start]:#04x}) {e.reason}") from e
    text = chosen.get("text", chosen.get("prompt"))
    return {"prompt": SAMPLE_PROMPT if text is None else text}


def _json_file(flag: str, path: str, items: str) -> list:
    """The JSON array in file `path` (`flag` and `items` name it in errors).

    Raises:
        CLIError: the file is unreadable, not JSON, or not an array.
    """
    want = f"{flag} must hold a JSON array of {items}"
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise CLIError(f"{flag}: {e}") from e
    except UnicodeDecodeError as e:
        raise CLIError(f"{flag} {path} is not UTF-8 text: byte {e.start} {e.reason}") from e
    except json.JSONDecodeError as e:
        raise CLIError(f"{want}: {e}") from e
    if not isinstance(value, list):
        raise CLIError(want)
    return value


def add_messages_flags(p: argparse.ArgumentParser, group=None) -> None:
    """``--messages-file`` (in `group` when given) and ``--no-generation-prompt`` on `p`."""
    (group or p).add_argument(
        "--messages-file",
        help='a file holding a JSON array of chat messages {"role": ..., "content": ...}, '
             "rendered with the model's chat template")
    p.add_argument("--no-generation-prompt", action="store_true",
                   help="with --messages-file: do not end with the assistant's turn opening")


def reused(record: dict) -> str:
    """``"cached 512 tokens (live)"``: how much of a session's slot a job reused."""
    return f"cached {record.get('cached_tokens', 0)} tokens ({record.get('reuse', 'cold')})"


def print_result(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record))
        return
    chunks, resumed = record["chunks"], record.get("resumed_from")
    print(f"job {record['job_id']}: {record['state']}, {record['n_tokens']} tokens "
          f"in {chunks} chunk{'' if chunks == 1 else 's'}, {reused(record)}"
          + ("" if resumed is None else f", resumed from a KV checkpoint at {resumed}"))
    timings = record.get("timings")
    if timings:
        print(f"prefill {timings['prefill_s']:.2f} s ({timings['tokens_per_s']:.0f} tok/s), "
              f"queue wait {timings['queue_wait_s']:.2f} s")
    for rank, t in enumerate(record.get("top_k", []), 1):
        print(f"{rank:>3}  {t['id']:>7}  logit {t['logit']:8.3f}  logprob {t['logprob']:8.3f}  "
              f"{t['piece']!r}")
    for i, c in enumerate(record.get("continuations") or []):
        print(f"continuation {i}: logprob {c['logprob']:.4f} over {len(c['tokens'])} tokens, "
              + ("greedy" if c["is_greedy"] else "not greedy"))


def finish(client: PrefillClient, job_id: str, as_json: bool) -> int:
    """Print a terminal job's result (or its status and error); the command's exit status."""
    status = client.status(job_id)
    try:
        result = client.result(job_id, timeout=0)
    except (JobFailed, JobCanceled) as e:
        if as_json:
            print_result(result_record(status, None), True)
        print(f"prefillq: error: {e}", file=sys.stderr)
        return 1
    print_result(result_record(client.status(job_id), result), as_json)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    client = PrefillClient.from_url(args.redis)
    job_id = client.submit(**prompt_input(args),
                           **{name: getattr(args, name) for name in SUBMIT_FLAGS})
    print(job_id)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = PrefillClient.from_url(args.redis).status(args.job)
    if args.json:
        print(json.dumps(status.to_dict()))
    else:
        total = status.n_tokens if status.n_tokens is not None else "?"
        print(f"{status.job_id}: {status.state.value} {status.cursor}/{total} tokens, "
              f"{status.chunks_done} chunk{'' if status.chunks_done == 1 else 's'}, "
              f"attempt {status.attempts}, {reused(status.to_dict())}"
              + ("" if status.resumed_from is None
                 else f", resumed from a KV checkpoint at {status.resumed_from}")
              + (" (cancel requested)" if status.cancel_requested else ""))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    client = PrefillClient.from_url(args.redis)
    if not client.cancel(args.job):
        print("nothing to cancel: the job already ended, or a cancel is already pending")
    elif client.status(args.job).state == JobState.CANCELED:
        print("canceled")  # it had not started
    else:
        print("cancel requested: the job stops at its next chunk boundary")
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    client = PrefillClient.from_url(args.redis)
    for _ in client.watch(args.job, args.wait):
        pass
    return finish(client, args.job, args.json)


def cmd_reap(args: argparse.Namespace) -> int:
    from redis import Redis

    from .reaper import reap

    reaped = reap(Redis.from_url(redis_url(args.redis)))
    for r in reaped:
        print(f"{r.job_id}: {r.outcome} (worker {r.worker})")
    print(f"reaped {len(reaped)} jobs")
    return 0


def cmd_tenants(args: argparse.Namespace) -> int:
    from redis import Redis

    from .stats import numbers_of, read_cluster_stats_sync

    conn = Redis.from_url(redis_url(args.redis))
    stats = read_cluster_stats_sync(conn)
    weights = numbers_of(conn.hgetall(keys.TENANT_WEIGHTS))  # junk in the hash is skipped
    # the hash's weight (None: none there; a worker's --tenant-weights may give one)
    rows = [{"tenant": t, "weight": weights.get(t), **dataclasses.asdict(n)}
            for t, n in stats.tenants.items()]
    if args.json:
        print(json.dumps({"tenants": rows, "service_spread": stats.service_spread}))
        return 0
    print(f"{'tenant':<20} {'weight':>6} {'queued':>7} {'prefilling':>10} {'tokens':>12} "
          f"{'service':>12}")
    for r in rows:
        weight = "-" if r["weight"] is None else f"{r['weight']:g}"
        print(f"{r['tenant'] or '(none)':<20} {weight:>6} {r['queued']:>7} "
              f"{r['prefilling']:>10} {r['tokens_prefilled']:>12} {r['service']:>12.0f}")
    print(f"service spread between tenants with work: {stats.service_spread:.0f} tokens")
    return 0


def add_submit(sub) -> None:
    """Add ``submit`` to the subparsers `sub`."""
    submit = sub.add_parser("submit", help="enqueue a prompt; prints the job id")
    add_redis(submit)
    src = submit.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    src.add_argument("--tokens-file", help="a file holding a JSON array of token ids")
    add_messages_flags(submit, src)
    submit.add_argument("--model", default=SUBMIT_DEFAULTS["model"])
    submit.add_argument("--top-k", type=int, default=SUBMIT_DEFAULTS["top_k"],
                        help=f"top next tokens to keep (default {SUBMIT_DEFAULTS['top_k']})")
    submit.add_argument("--logits", choices=[m.value for m in LogitsMode],
                        default=SUBMIT_DEFAULTS["logits"].value)
    submit.add_argument("--session",
                        help="session id: the job's worker keeps its KV cache, and the "
                             "session's next job prefills only what its prompt adds")
    submit.add_argument("--priority", type=int, default=SUBMIT_DEFAULTS["priority"],
                        help="higher is admitted first (default 0)")
    submit.add_argument("--tenant", help="whose job: tenants share the workers by weighted "
                        "fair share of tokens prefilled (default: none)")
    submit.add_argument("--chunk-tokens", type=positive_int, help="per-job cap on chunk size")
    submit.add_argument("--prompt-logprobs", type=int, metavar="K",
                        help="per-position logprob and top K of the prompt (result --json)")
    submit.add_argument("--continuation", action="append", dest="continuations",
                        metavar="TEXT", help="score TEXT after the prompt: its summed "
                        "logprob and whether it is greedy (repeat for each choice)")
    submit.set_defaults(func=cmd_submit)


def add_job_commands(sub) -> None:
    """Add ``reap``, ``tenants``, ``status``, ``cancel`` and ``result`` to the subparsers
    `sub`."""
    reaper = sub.add_parser("reap", help="one pass of the dead-worker reaper")
    add_redis(reaper)
    reaper.set_defaults(func=cmd_reap)
    tenants = sub.add_parser("tenants", help="each tenant's weight, queued and prefilling "
                             "jobs, tokens prefilled and virtual service")
    add_redis(tenants)
    tenants.add_argument("--json", action="store_true")
    tenants.set_defaults(func=cmd_tenants)
    for name, func, text in (("status", cmd_status, "print a job's status"),
                             ("cancel", cmd_cancel, "cancel a job (idempotent)"),
                             ("result", cmd_result, "wait for and print a job's result")):
        p = sub.add_parser(name, help=text)
        add_redis(p)
        p.add_argument("job")
        if name in ("status", "result"):
            p.add_argument("--json", action="store_true")
        if name == "result":
            p.add_argument("--wait", type=non_negative_float, default=0.0,
                           help="seconds to wait (default 0)")
        p.set_defaults(func=func)
