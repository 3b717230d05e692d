"""Resume a checkpointed prefill in a fresh process (run by tests/worker/test_checkpoint_resume.py).

``python -m tests.worker.checkpoint_resume MODEL OUT_DIR STORE_URL#RECORD_KEY...``: for each
pair, `latest_usable` on `checkpoint_helpers.prompt` / `plan`, `resume_prefill`, run
to the end, write the float32 logits to ``OUT_DIR/<i>.f32`` and print one JSON line with the
cursor it resumed from (null: no usable checkpoint, ran from 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from worker.checkpoints.restore import latest_usable
from worker.checkpoints.store import open_store

from .checkpoint_helpers import loaded, plan, prompt


def main(argv: list[str]) -> None:
    name, out, *pairs = argv
    model, ids = loaded(name), prompt(name)
    for i, pair in enumerate(pairs):
        url, _, key = pair.partition("#")
        found = latest_usable(open_store(url, connection=None), key, model, ids, plan())
        if found is None:
            prefill, cursor = model.start_prefill(ids, plan=plan()), None
        else:
            record, state = found
            prefill, cursor = model.resume_prefill(ids, plan(), state), record.cursor
        logits = prefill.run()
        Path(out, f"{i}.f32").write_bytes(logits.astype("<f4").tobytes())
        print(json.dumps({"key": key, "cursor": cursor, "chunks": prefill.chunks_done}))


if __name__ == "__main__":
    main(sys.argv[1:])
