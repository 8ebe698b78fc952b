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
written: if Redis lost its data and started over (no persistence), the token differs and replicas reload.
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
# Returns {applied (1, or 0 for a batch applied before), seq, evicted, repaired, {count of each member}}.
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
  return {0, 0, 0, 0, zmscore(counts, members)}
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

-- The cap: past `cap` distinct patterns, drop the rarest down to `keep` (ties: Redis's order of equal
-- scores, by member). A rank range on the sorted set: O(dropped x log n), no scan of the whole set.
local evicted = 0
local n = redis.call('ZCARD', counts)
if n > cap then
  evicted = redis.call('ZREMRANGEBYRANK', counts, 0, n - keep - 1)
  hincr(meta, 'epoch', 1)
  values = zmscore(counts, members)
end
-- The change log is capped alike: the oldest stamps go, and meta.floor records the newest seq dropped, so a
-- replica that has not seen that far reloads everything instead of trusting an incomplete log.
local logged = redis.call('ZCARD', changes)
if logged > cap then
  local cut = redis.call('ZRANGE', changes, logged - cap - 1, logged - cap - 1, 'WITHSCORES')
  redis.call('ZREMRANGEBYRANK', changes, 0, logged - cap - 1)
  local floor = tonumber(redis.call('HGET', meta, 'floor') or '0') or 0
  if tonumber(cut[2]) > floor then redis.call('HSET', meta, 'floor', cut[2]) end
end

-- One field per store instance ever started; past 10,000 start over (a batch retried at that very moment
-- could then be counted twice, a risk we accept over unbounded growth).
if redis.call('HLEN', writers) > 10000 then redis.call('DEL', writers) end
redis.call('HSET', writers, writer, batch)
return {1, seq, evicted, repaired, values}
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

# KEYS: counts, changes, meta. Forget the patterns; the epoch bump tells every replica to reload.
RESET = (
    _COMMON
    + r"""
local err = check_types({'zset', 'zset', 'hash'})
if err then return err end
redis.call('DEL', KEYS[1], KEYS[2])
hincr(KEYS[3], 'epoch', 1)
return 1
"""
)
