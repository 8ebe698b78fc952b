"""The Lua scripts the Redis OCM store runs server-side (each touches the keys of one namespace only).

Why scripts: a flush must add the counts, stamp the change log, apply the pattern cap and remember the batch
number in one atomic step, or a crash between two of them would double-count or lose increments.

Why the counts are a sorted set (member "draft:target", score = count) and not a hash: dropping the rarest
patterns is then a rank range, O(dropped x log n), and top-n is a server-side range. With a hash the cap
needed a scan of every pattern inside a script: measured at 200,000 patterns, it blocked Redis for seconds.
Scores are doubles, exact for whole numbers below 2^53.

Change tracking (for the incremental refresh): `meta.seq` goes up by one per applied flush batch, and every
pattern the batch touched gets that seq as its score in the `changes` zset. A replica that has seen up to
seq S asks for the patterns with score > S and reads just their counts. Deletions cannot be expressed that
way, so an eviction or a reset bumps `meta.epoch` instead, and a replica whose epoch differs reloads the
whole set. The log is capped like the counts; `meta.floor` is the newest seq it has dropped, and a replica
that has not seen that far reloads too. `meta.gen` is a random token set when the namespace is first
written: if Redis lost its data and started over (no persistence, a failover to a replica that never had
the namespace, a flushed instance), the token differs or is gone. `csd ocm reset` keeps `meta` (it bumps the
epoch), so a deliberate reset and a loss can be told apart: the meta hash is the record of resets that an
emptied Redis does not have.

Restoring what Redis lost (RESTORE). Every replica holds a view of the pooled counts (`snapshot`: counts
Redis confirmed, never more than the truth). After a loss of the whole namespace ('lost': the gen changed),
each replica sends its view, and for each pattern the script adds only what exceeds the largest view
restored so far in this gen, kept in the `restored` zset (the *base*): counts = max over the replicas' views
+ every increment flushed since the loss. Scripts are atomic, so replicas restoring at once, in any order
and in any chunks, end with the same counts, and the max of views that are each <= the old count never
counts anything twice. After a partial loss ('behind': a failover to a replica that had not caught up,
same gen and epoch but fewer counts) the script raises each count to the replica's view (ZADD-GT style):
idempotent, never above what Redis once confirmed; increments the lagging server got after the failover
may then be absorbed in the max (an undercount, never a double count). A 'behind' restore is refused when
the epoch moved (a reset or an eviction since the view was taken: the view is stale, not lost).
"""

from __future__ import annotations

# Shared helpers, prepended to every script.
_COMMON = r"""
local function check_types(expected)
  for i, want in ipairs(expected) do
    local got = redis.call('TYPE', KEYS[i]).ok
    if got ~= 'none' and got ~= want then
      return redis.error_reply('CSDWRONGTYPE ' .. KEYS[i] .. ' holds a ' .. got .. ', expected a ' .. want)
    end
  end
  return nil
end

-- A count is a non-negative whole number below 2^53 (exact in a double score).
local function is_count(v)
  return v ~= nil and v >= 0 and v < 9007199254740992 and v == math.floor(v)
end

-- HINCRBY that survives a junk value: the junk is replaced by the increment (junk counts as 0).
local function hincr(key, field, by)
  local r = redis.pcall('HINCRBY', key, field, by)
  if type(r) == 'table' and r.err then
    redis.call('HSET', key, field, by)
    return tonumber(by)
  end
  return r
end

-- The cap: past `cap` distinct patterns, drop the rarest down to `keep` (ties: Redis's order of equal
-- scores, by member). A rank range on the sorted set: O(dropped x log n), no scan of the whole set.
-- The change log is capped alike: the oldest stamps go, and meta.floor records the newest seq dropped, so a
-- replica that has not seen that far reloads everything instead of trusting an incomplete log.
local function apply_caps(counts, changes, meta, cap, keep)
  local evicted = 0
  local n = redis.call('ZCARD', counts)
  if n > cap then
    evicted = redis.call('ZREMRANGEBYRANK', counts, 0, n - keep - 1)
    hincr(meta, 'epoch', 1)
  end
  local logged = redis.call('ZCARD', changes)
  if logged > cap then
    local cut = redis.call('ZRANGE', changes, logged - cap - 1, logged - cap - 1, 'WITHSCORES')
    redis.call('ZREMRANGEBYRANK', changes, 0, logged - cap - 1)
    local floor = tonumber(redis.call('HGET', meta, 'floor') or '0') or 0
    if tonumber(cut[2]) > floor then redis.call('HSET', meta, 'floor', cut[2]) end
  end
  return evicted
end

local function zmscore(key, members)
  local out = {}
  for i = 1, #members, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, #members) do chunk[#chunk + 1] = members[j] end
    local vals = redis.call('ZMSCORE', key, unpack(chunk))
    for _, v in ipairs(vals) do out[#out + 1] = v end
  end
  return out
end
"""

# KEYS: counts, changes, meta, writers
# ARGV: writer id, batch number, cap, keep, gen candidate, then member, increment, member, increment, ...
# Returns {applied (1, or 0 for a batch applied before), seq, evicted, repaired, {count of each member}, gen}.
FLUSH = (
    _COMMON
    + r"""
local err = check_types({'zset', 'zset', 'hash', 'hash'})
if err then return err end
local counts, changes, meta, writers = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local writer, batch = ARGV[1], tonumber(ARGV[2])
local cap, keep = tonumber(ARGV[3]), tonumber(ARGV[4])

local members = {}
for i = 6, #ARGV, 2 do members[#members + 1] = ARGV[i] end

-- A retry of a batch whose first attempt was applied (the reply was lost with the connection): skip it.
local last = tonumber(redis.call('HGET', writers, writer) or '0') or 0
if last >= batch then
  return {0, 0, 0, 0, zmscore(counts, members), redis.call('HGET', meta, 'gen') or ''}
end

redis.call('HSETNX', meta, 'gen', ARGV[5])
local seq = hincr(meta, 'seq', 1)
local repaired = 0
local values = {}
for i = 6, #ARGV, 2 do
  local v = tonumber(redis.call('ZINCRBY', counts, ARGV[i + 1], ARGV[i]))
  if not is_count(v) then  -- junk score (2.5, -3, inf) written by someone else: counts as 0
    redis.call('ZADD', counts, ARGV[i + 1], ARGV[i])
    v = tonumber(ARGV[i + 1])
    repaired = repaired + 1
  end
  values[#values + 1] = v
  redis.call('ZADD', changes, seq, ARGV[i])
end

local evicted = apply_caps(counts, changes, meta, cap, keep)
if evicted > 0 then values = zmscore(counts, members) end

-- One field per store instance ever started; past 10,000 start over (a batch retried at that very moment
-- could then be counted twice, a risk we accept over unbounded growth).
if redis.call('HLEN', writers) > 10000 then redis.call('DEL', writers) end
redis.call('HSET', writers, writer, batch)
return {1, seq, evicted, repaired, values, redis.call('HGET', meta, 'gen')}
"""
)

# KEYS: counts, changes, meta
# ARGV: seq seen, gen seen, epoch seen, the most changed patterns worth an incremental read
# Returns {gen, seq, epoch, mode, ...}: mode 'same' (nothing changed), 'delta' with {members} and {counts},
# or 'full': the caller reads the whole set itself, with ZSCAN in slices (a single read of a large set
# inside a script would block Redis for its whole length). Writes during that scan get seqs above the one
# returned here, so the next refresh reads them again.
REFRESH = (
    _COMMON
    + r"""
local err = check_types({'zset', 'zset', 'hash'})
if err then return err end
local m = redis.call('HMGET', KEYS[3], 'gen', 'seq', 'epoch', 'floor')
local gen, epoch = m[1] or '', m[3] or '0'
local seq = tonumber(m[2] or '0') or -1
local floor = tonumber(m[4] or '0') or math.huge
local since, most = tonumber(ARGV[1]), tonumber(ARGV[4])
if seq >= 0 and gen == ARGV[2] and epoch == ARGV[3] and since <= seq and since >= floor then
  if since == seq then return {gen, seq, epoch, 'same'} end
  local members = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf', 'LIMIT', 0, most + 1)
  if #members <= most then
    return {gen, seq, epoch, 'delta', members, zmscore(KEYS[1], members)}
  end
end
return {gen, seq, epoch, 'full'}
"""
)

# KEYS: counts, changes, meta, writers, restored
# ARGV: mode ('lost' or 'behind'), gen seen, epoch seen, gen candidate, cap, keep, then member, count, ...
# Returns {'done' or 'stale', gen, added increments, patterns raised}. 'stale': nothing was lost relative to
# this view ('lost' but the gen is the one seen; 'behind' but the gen or epoch moved): reload instead.
RESTORE = (
    _COMMON
    + r"""
local err = check_types({'zset', 'zset', 'hash', 'hash', 'zset'})
if err then return err end
local counts, changes, meta, restored = KEYS[1], KEYS[2], KEYS[3], KEYS[5]
local mode, gen_seen, epoch_seen = ARGV[1], ARGV[2], ARGV[3]
local cap, keep = tonumber(ARGV[5]), tonumber(ARGV[6])
local gen = redis.call('HGET', meta, 'gen')
if mode == 'lost' then
  if gen == gen_seen then return {'stale', gen, 0, 0} end
  if not gen then
    redis.call('HSET', meta, 'gen', ARGV[4])
    gen = ARGV[4]
  end
elseif gen ~= gen_seen or (redis.call('HGET', meta, 'epoch') or '0') ~= epoch_seen then
  return {'stale', gen or '', 0, 0}
end
local seq = hincr(meta, 'seq', 1)
local added, raised = 0, 0
for i = 7, #ARGV, 2 do
  local member, view = ARGV[i], tonumber(ARGV[i + 1])
  local now = tonumber(redis.call('ZSCORE', counts, member) or '0')
  if not is_count(now) then now = 0 end  -- junk: counts as 0, overwritten below
  local add = 0
  if mode == 'lost' then
    local base = tonumber(redis.call('ZSCORE', restored, member) or '0') or 0
    if view > base then
      add = view - base
      redis.call('ZADD', restored, view, member)
    end
  elseif view > now then
    add = view - now
  end
  if add > 0 then
    redis.call('ZADD', counts, now + add, member)
    redis.call('ZADD', changes, seq, member)
    added, raised = added + add, raised + 1
  end
end
apply_caps(counts, changes, meta, cap, keep)
local n = redis.call('ZCARD', restored)
if n > cap then redis.call('ZREMRANGEBYRANK', restored, 0, n - keep - 1) end
return {'done', gen, added, raised}
"""
)

# KEYS: counts, changes, meta, writers, restored. Forget the patterns (and the restore bases); the epoch
# bump tells every replica to reload. `meta` (with its gen) stays: the record that this was a reset.
RESET = (
    _COMMON
    + r"""
local err = check_types({'zset', 'zset', 'hash', 'hash', 'zset'})
if err then return err end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[5])
hincr(KEYS[3], 'epoch', 1)
return 1
"""
)
