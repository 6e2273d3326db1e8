"""The Lua scripts behind RedisLimiter. Each runs atomically inside Redis, so replicas sharing one Redis
share one budget with no read-modify-write race. They mirror buckets.py and LocalLimiter line by line.

Keys of one tenant (hash-tagged on the tenant so that a Redis Cluster keeps them in one slot):
- requests bucket, tokens bucket: hashes {level, ts (ms, server time), cap (the limit when written)};
  each expires when it would be full again, and a missing bucket is full, so idle tenants cost nothing.
- leases: a sorted set of request ids scored by lease deadline (ms, server time). Expired leases are
  dropped at every acquire, so a replica that crashed mid-request frees its slots after lease_ms.

Time is Redis's own (TIME), never a replica's clock: replicas with skewed clocks would otherwise refill
the same bucket at different times. Numbers cross back to Python as strings because Redis truncates Lua
numbers to integers in replies.
"""

# Shared by both scripts: bucket state read, refill and write.
_BUCKET_FUNCTIONS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

local function fmt(x) return string.format('%.17g', x) end

-- The level at `now` under limit `cap` (nil cap: the stored one); also the stored cap. Missing = full.
local function level_now(key, cap)
  local h = redis.call('HMGET', key, 'level', 'ts', 'cap')
  if not h[1] then return cap, cap end
  local old_cap = tonumber(h[3])
  cap = cap or old_cap
  local level = tonumber(h[1]) + (now - tonumber(h[2])) * old_cap / 60000
  return math.min(level, old_cap, cap), old_cap
end

local function write_bucket(key, level, cap)
  redis.call('HSET', key, 'level', fmt(level), 'ts', fmt(now), 'cap', cap)
  -- Expire when full again: from then on a missing key says the same thing.
  redis.call('PEXPIRE', key, math.ceil((cap - level) * 60000 / cap) + 1000)
end
"""

# KEYS: 1 requests bucket, 2 tokens bucket, 3 leases.
# ARGV: 1 request_id, 2 tokens, 3 requests/min, 4 tokens/min, 5 max concurrent (each 0 = unlimited),
#       6 lease ms, 7 concurrency retry ms.
# Returns {1} admitted, {0, reason, wait_ms} refused, {-1} request_id already holds a lease.
ACQUIRE = _BUCKET_FUNCTIONS + """
local request_id, tokens = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, max_concurrent = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease_ms, concurrency_retry_ms = tonumber(ARGV[6]), tonumber(ARGV[7])

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZSCORE', KEYS[3], request_id) then return {-1} end

-- The refusing limit with the longest wait; strict '>' keeps the first of equal waits (tie-break order).
local reason, wait = nil, -1
local function refuse(r, w) if w > wait then reason, wait = r, w end end

if max_concurrent > 0 and redis.call('ZCARD', KEYS[3]) >= max_concurrent then
  refuse('max_concurrent', concurrency_retry_ms)
end
local requests_level, tokens_level = 0, 0
if rpm > 0 then
  requests_level = level_now(KEYS[1], rpm)
  if requests_level < 1 then refuse('requests_per_minute', (1 - requests_level) * 60000 / rpm) end
end
if tpm > 0 then
  tokens_level = level_now(KEYS[2], tpm)
  if tokens_level < tokens then refuse('tokens_per_minute', (tokens - tokens_level) * 60000 / tpm) end
end
if reason then return {0, reason, fmt(wait)} end

if rpm > 0 then write_bucket(KEYS[1], requests_level - 1, rpm) end
if tpm > 0 then write_bucket(KEYS[2], tokens_level - tokens, tpm) end
redis.call('ZADD', KEYS[3], now + lease_ms, request_id)
-- The set lives as long as its latest lease (replicas may run with different lease times).
if redis.call('PTTL', KEYS[3]) < lease_ms then redis.call('PEXPIRE', KEYS[3], math.ceil(lease_ms) + 1000) end
return {1}
"""

# KEYS: 1 tokens bucket, 2 leases. ARGV: 1 request_id, 2 tokens to refund.
# Returns 1 if the request held its lease (now released), 0 otherwise (then nothing is refunded).
RELEASE = _BUCKET_FUNCTIONS + """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
local refund = tonumber(ARGV[2])
if refund > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  local level, cap = level_now(KEYS[1], nil)
  write_bucket(KEYS[1], math.min(level + refund, cap), cap)
end
return 1
"""
