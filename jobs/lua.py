"""The Lua source of every read-then-write decision on a job: the job state machine.

Each script touches one job's keys only (hash-tagged by job id, so one Redis Cluster slot)
and is atomic with `cancel`: a job is never continued, published or restarted after a
cancel landed, and a worker that lost the job (the fencing token ``worker`` + ``attempts``
no longer matches) changes nothing. Callers never build KEYS/ARGV: `jobs.scripts` does,
one named function per script.
"""

from __future__ import annotations

# Shared prologue. KEYS[1] job hash, KEYS[2] cancel flag, KEYS[3] events channel;
# ARGV[1] worker, ARGV[2] attempt, ARGV[3] now.
_FENCE = """
local state, worker, attempts = unpack(redis.call('HMGET', KEYS[1], 'state', 'worker', 'attempts'))
if state ~= 'prefilling' or worker ~= ARGV[1] or attempts ~= ARGV[2] then
  return 'fenced'
end
"""

_CANCELED = """
  redis.call('HSET', KEYS[1], 'state', 'canceled', 'cancel_requested', 0,
             'updated_at', ARGV[3], 'finished_at', ARGV[3])
  redis.call('DEL', KEYS[2])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('PUBLISH', KEYS[3], 'canceled')
  return 'canceled'
"""

_CANCEL_IF_FLAGGED = "if redis.call('EXISTS', KEYS[2]) == 1 then" + _CANCELED + "end\n"

# The per-chunk scripts read the fence and the cancel request in one HMGET (`CANCEL` sets
# ``cancel_requested`` together with the flag key), so a chunk's checkpoint costs the
# script, one read, one write and its progress event.
_FENCE_READING_CANCEL = """
local state, worker, attempts, requested = unpack(redis.call('HMGET', KEYS[1], 'state',
                                                   'worker', 'attempts', 'cancel_requested'))
if state ~= 'prefilling' or worker ~= ARGV[1] or attempts ~= ARGV[2] then
  return 'fenced'
end
"""
_CANCEL_IF_REQUESTED = "if requested == '1' then" + _CANCELED + "end\n"

# A worker takes a queued job: state queued -> prefilling, attempts += 1.
# KEYS[1] job, KEYS[2] events; ARGV[1] worker, ARGV[2] now, ARGV[3] a token unique to this
# start, so a start retried after a lost reply finds its own start instead of a stranger's;
# ARGV[4] the job's chunk plan (packed boundaries) or '': recorded at the first start only;
# ARGV[5] to ARGV[10] its n_tokens, recovery_position, cursor (where this attempt starts),
# cached_tokens (reused from a session's slot), reuse (`cold` or how the slot was reused)
# and resumed_from (the cursor a KV checkpoint restored, or ''); absent when its input
# failed.
START = """
local state, token, attempts = unpack(redis.call('HMGET', KEYS[1], 'state', 'start_token',
                                                 'attempts'))
if state == 'prefilling' and token == ARGV[3] then return {'started', tonumber(attempts)} end
if state ~= 'queued' then return {state or 'missing', 0} end
attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'prefilling', 'worker', ARGV[1], 'cursor', 0,
           'chunks_done', 0, 'started_at', ARGV[2], 'updated_at', ARGV[2], 'start_token', ARGV[3],
           'cancel_requested', 0)
redis.call('HSETNX', KEYS[1], 'first_started_at', ARGV[2])
if ARGV[4] and ARGV[4] ~= '' then redis.call('HSETNX', KEYS[1], 'chunk_plan', ARGV[4]) end
if ARGV[5] and ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'n_tokens', ARGV[5], 'recovery_position', ARGV[6],
             'cursor', ARGV[7], 'cached_tokens', ARGV[8], 'reuse', ARGV[9],
             'resumed_from', ARGV[10])
end
redis.call('PUBLISH', KEYS[2], 'prefilling')
return {'started', attempts}
"""

# After a chunk: record progress, then stop if canceled (the cursor says where it stopped).
# ARGV[4] result TTL (s), ARGV[5] cursor, ARGV[6] chunks_done, ARGV[7] n_tokens,
# ARGV[8] recovery_position.
PROGRESS = (
    _FENCE_READING_CANCEL
    + """
redis.call('HSET', KEYS[1], 'cursor', ARGV[5], 'chunks_done', ARGV[6], 'n_tokens', ARGV[7],
           'recovery_position', ARGV[8], 'updated_at', ARGV[3])
"""
    + _CANCEL_IF_REQUESTED
    + """
redis.call('PUBLISH', KEYS[3], 'prefilling')
return 'continue'
"""
)

# The last chunk is done: publish logits and `finished` together, unless canceled or fenced.
# KEYS[4] logits key; ARGV[5] result blob, ARGV[6] logits blob or '', ARGV[7] logits TTL,
# ARGV[8] cursor, ARGV[9] chunks_done; KEYS[5] prompt logprobs key, ARGV[10] their blob or ''.
PUBLISH = (
    _FENCE_READING_CANCEL
    + _CANCEL_IF_REQUESTED
    + """
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[4], ARGV[6], 'EX', ARGV[7])
end
if ARGV[10] and ARGV[10] ~= '' then
  redis.call('SET', KEYS[5], ARGV[10], 'EX', ARGV[7])
end
redis.call('HSET', KEYS[1], 'state', 'finished', 'result', ARGV[5], 'cursor', ARGV[8],
           'chunks_done', ARGV[9], 'updated_at', ARGV[3], 'finished_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', KEYS[3], 'finished')
return 'finished'
"""
)

# The job cannot go on: ARGV[5] error type, ARGV[6] message.
FAIL = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', 'failed', 'error_type', ARGV[5], 'error_message', ARGV[6],
           'updated_at', ARGV[3], 'finished_at', ARGV[3])
redis.call('DEL', KEYS[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', KEYS[3], 'failed')
return 'failed'
"""
)

# Back to intake at cursor 0, or `failed` once failures reach max_attempts. Canceled wins.
# ARGV[5] '1' if a failure caused this (a SIGTERM hand-back is not one), ARGV[6] error
# type, ARGV[7] message (used when the job fails).
# A count that is not a number (junk written into Redis) reads as 0 failures and 1 attempt
# allowed, so the script still decides instead of raising (which would stop a reap pass).
_REQUEUE_BODY = """
local failures = tonumber(redis.call('HGET', KEYS[1], 'failures')) or 0
if ARGV[5] == '1' then
  failures = failures + 1
  redis.call('HSET', KEYS[1], 'failures', failures)
end
if failures >= (tonumber(redis.call('HGET', KEYS[1], 'max_attempts')) or 1) then
  redis.call('HSET', KEYS[1], 'state', 'failed', 'error_type', ARGV[6],
             'error_message', ARGV[7], 'updated_at', ARGV[3], 'finished_at', ARGV[3])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('PUBLISH', KEYS[3], 'failed')
  return 'failed'
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '', 'cursor', 0, 'chunks_done', 0,
           'updated_at', ARGV[3])
redis.call('PUBLISH', KEYS[3], 'queued')
return 'queued'
"""

# A worker hands a job back (failed chunk, SIGTERM); the caller enqueues the RQ job for
# intake in the same MULTI (a stray RQ job for a non-queued job is skipped by START).
REQUEUE = _FENCE + _CANCEL_IF_FLAGGED + _REQUEUE_BODY

# The reaper takes a dead worker's job: fenced on the worker only (ARGV[2] unused).
REAP = (
    """
local state, worker = unpack(redis.call('HMGET', KEYS[1], 'state', 'worker'))
if state ~= 'prefilling' or worker ~= ARGV[1] then return 'fenced' end
"""
    + _CANCEL_IF_FLAGGED
    + _REQUEUE_BODY
)

# A checkpoint's blobs and record are all in the store: point the job at it, unless this
# worker's attempt lost the job (a fenced writer must not overwrite the new holder's pointer).
# KEYS[1] job; ARGV[1] worker, ARGV[2] attempt, ARGV[3] record key, ARGV[4] its cursor.
CHECKPOINT_SWITCH = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[3], 'checkpoint_cursor', ARGV[4])
return 'switched'
"""
)

# Client cancel. KEYS[1] job, KEYS[2] cancel flag, KEYS[3] events; ARGV[1] now, ARGV[2] TTL.
# queued -> canceled at once; prefilling -> flag for the worker; terminal -> unchanged.
CANCEL = """
local state, requested = unpack(redis.call('HMGET', KEYS[1], 'state', 'cancel_requested'))
if not state then return 'missing' end
if state == 'queued' then
  redis.call('HSET', KEYS[1], 'state', 'canceled', 'updated_at', ARGV[1], 'finished_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  redis.call('PUBLISH', KEYS[3], 'canceled')
  return 'canceled'
end
if state == 'prefilling' then
  if requested == '1' then return 'pending' end
  redis.call('SET', KEYS[2], '1')
  redis.call('HSET', KEYS[1], 'cancel_requested', 1, 'updated_at', ARGV[1])
  redis.call('PUBLISH', KEYS[3], 'prefilling')
  return 'requested'
end
return 'unchanged'
"""

# A worker refuses a job whose record does not decode (`jobs.errors.CorruptJob`): its
# undecodable fields are dropped so that its status reads again, and unless it ended it fails
# at once. A job a worker holds is left alone (its fence fields may be the ones to drop).
# No fence otherwise: its attempt and worker fields may be the corrupt ones.
# KEYS[1] job, KEYS[2] events; ARGV[1] now, ARGV[2] TTL (s), ARGV[3] error type,
# ARGV[4] message, ARGV[5..] the fields to drop.
REFUSE = """
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
if state == 'prefilling' then return 'unchanged' end
if #ARGV > 4 then redis.call('HDEL', KEYS[1], unpack(ARGV, 5)) end
if state == 'finished' or state == 'failed' or state == 'canceled' then return 'unchanged' end
redis.call('HSET', KEYS[1], 'state', 'failed', 'error_type', ARGV[3], 'error_message', ARGV[4],
           'updated_at', ARGV[1], 'finished_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', KEYS[2], 'failed')
return 'failed'
"""

# Delete a key only while it still holds the caller's value: a submit whose record Redis
# refused gives its idempotency claim back (KEYS[1] the claim, ARGV[1] the job id) unless
# another submit holds it now; a worker that stops keeping a session's slot forgets itself as
# the holder (KEYS[1] the holder key, ARGV[1] the worker) unless another worker took the
# session over since. DEL is never refused under maxmemory.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# A worker dequeues: pop up to ARGV[1] RQ jobs of its queues, in order, and record each as
# being taken by the worker in the same step, so a worker killed before it starts them leaves
# them to the reaper instead of losing them. KEYS[1] the worker's taking set, KEYS[2..] the RQ
# queue lists; replies {queue key, id, queue key, id, ...}. Like RQ's own multi-queue BLPOP
# these keys span slots: RQ's queues are not Redis Cluster keys.
TAKE = """
local want, taken = tonumber(ARGV[1]), {}
for i = 2, #KEYS do
  local cap, got = tonumber(ARGV[i]) or want, 0
  while #taken < 2 * want and got < cap do
    local id = redis.call('LPOP', KEYS[i])
    if not id then break end
    redis.call('SADD', KEYS[1], id)
    taken[#taken + 1] = KEYS[i]
    taken[#taken + 1] = id
    got = got + 1
  end
end
return taken
"""
