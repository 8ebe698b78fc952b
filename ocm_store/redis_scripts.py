"""The Lua scripts the Redis OCM store runs server-side (each touches the keys of one namespace only).

Why scripts: a flush must add the counts, stamp the change log, apply the pattern cap and remember the batch
number in one atomic step, or a crash between two of them would double-count or lose increments.

Change tracking (for the incremental refresh): `meta.seq` goes up by one per applied flush batch, and every
pattern the batch touched gets that seq as its score in the `changes` zset. A replica that has seen up to
seq S asks for the patterns with score > S and reads just their counts. Deletions cannot be expressed that
way, so an eviction or a reset bumps `meta.epoch` instead, and a replica whose epoch differs reloads the
whole hash. `meta.gen` is a random token set when the namespace is first written: if Redis lost its data
and started over (no persistence), the token differs and replicas reload too.
"""

from __future__ import annotations

# Shared helpers, prepended to both scripts.
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

-- HINCRBY that survives a junk value: the junk is replaced by the increment (junk counts as 0).
local function incr(key, field, by)
  local r = redis.pcall('HINCRBY', key, field, by)
  if type(r) == 'table' and r.err then
    redis.call('HSET', key, field, by)
    return tonumber(by), true
  end
  return r, false
end

local function hmget(key, fields)
  local out = {}
  for i = 1, #fields, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, #fields) do chunk[#chunk + 1] = fields[j] end
    local vals = redis.call('HMGET', key, unpack(chunk))
    for _, v in ipairs(vals) do out[#out + 1] = v end
  end
  return out
end
"""

# KEYS: counts, changes, meta, writers
# ARGV: writer id, batch number, cap, keep, gen candidate, then field, increment, field, increment, ...
# Returns {applied (1 or 0 for a batch already applied), seq, evicted, repaired, {count of each field}}.
FLUSH = (
    _COMMON
    + r"""
local err = check_types({'hash', 'zset', 'hash', 'hash'})
if err then return err end
local counts, changes, meta, writers = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local writer, batch = ARGV[1], tonumber(ARGV[2])
local cap, keep = tonumber(ARGV[3]), tonumber(ARGV[4])

local fields = {}
for i = 6, #ARGV, 2 do fields[#fields + 1] = ARGV[i] end

-- A retry of a batch whose first attempt was applied (the reply was lost with the connection): skip it.
local last = tonumber(redis.call('HGET', writers, writer) or '0') or 0
if last >= batch then
  return {0, 0, 0, 0, hmget(counts, fields)}
end

redis.call('HSETNX', meta, 'gen', ARGV[5])
local seq = incr(meta, 'seq', 1)
local repaired = 0
local values = {}
for i = 6, #ARGV, 2 do
  local v, fixed = incr(counts, ARGV[i], ARGV[i + 1])
  if fixed then repaired = repaired + 1 end
  values[#values + 1] = v
  redis.call('ZADD', changes, seq, ARGV[i])
end

-- The cap: past `cap` distinct patterns, drop the rarest down to `keep`; among equal counts the patterns
-- least recently changed go first (patterns with no change stamp, written by someone else, before those).
local evicted = 0
if redis.call('HLEN', counts) > cap then
  local flat = redis.call('HGETALL', counts)
  local value_of, hist = {}, {}
  for i = 1, #flat, 2 do
    local c = tonumber(flat[i + 1]) or 0  -- junk is worth nothing
    value_of[flat[i]] = c
    hist[c] = (hist[c] or 0) + 1
  end
  local excess = #flat / 2 - keep
  local levels = {}
  for c in pairs(hist) do levels[#levels + 1] = c end
  table.sort(levels)
  local below, threshold = 0, levels[#levels]
  for _, c in ipairs(levels) do
    if below + hist[c] >= excess then threshold = c; break end
    below = below + hist[c]
  end
  local ties = excess - below  -- how many patterns with count == threshold must go
  local doomed = {}
  local function consider(f)
    local c = value_of[f]
    if c == nil then return end
    value_of[f] = nil
    if c < threshold then
      doomed[#doomed + 1] = f
    elseif c == threshold and ties > 0 then
      doomed[#doomed + 1] = f
      ties = ties - 1
    end
  end
  local stamped = redis.call('ZRANGE', changes, 0, -1)  -- oldest change first
  local has_stamp = {}
  for _, f in ipairs(stamped) do has_stamp[f] = true end
  for i = 1, #flat, 2 do
    if not has_stamp[flat[i]] then consider(flat[i]) end
  end
  for _, f in ipairs(stamped) do consider(f) end
  for i = 1, #doomed, 1000 do
    local chunk = {}
    for j = i, math.min(i + 999, #doomed) do chunk[#chunk + 1] = doomed[j] end
    redis.call('HDEL', counts, unpack(chunk))
    redis.call('ZREM', changes, unpack(chunk))
  end
  evicted = #doomed
  incr(meta, 'epoch', 1)
  values = hmget(counts, fields)
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
# Returns {gen, seq, epoch, mode, ...}: mode 'same' (nothing changed), 'delta' with {fields} and {counts},
# or 'full' with the whole hash as a flat {field, count, ...} list.
REFRESH = (
    _COMMON
    + r"""
local err = check_types({'hash', 'zset', 'hash'})
if err then return err end
local m = redis.call('HMGET', KEYS[3], 'gen', 'seq', 'epoch')
local gen, epoch = m[1] or '', m[3] or '0'
local seq = tonumber(m[2] or '0') or -1
local since, most = tonumber(ARGV[1]), tonumber(ARGV[4])
if seq >= 0 and gen == ARGV[2] and epoch == ARGV[3] and since <= seq then
  if since == seq then return {gen, seq, epoch, 'same'} end
  local fields = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf', 'LIMIT', 0, most + 1)
  if #fields <= most then
    return {gen, seq, epoch, 'delta', fields, hmget(KEYS[1], fields)}
  end
end
return {gen, seq, epoch, 'full', redis.call('HGETALL', KEYS[1])}
"""
)

# KEYS: counts, changes, meta. Forget the patterns; the epoch bump tells every replica to reload.
RESET = (
    _COMMON
    + r"""
local err = check_types({'hash', 'zset', 'hash'})
if err then return err end
redis.call('DEL', KEYS[1], KEYS[2])
incr(KEYS[3], 'epoch', 1)
return 1
"""
)
