"""The Lua scripts the Redis limiter runs: one atomic decision over every bucket a call must
pass, and the level, block, adjustment and adaptive-factor scripts around it."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=64)
def acquire_script(n: int, m: int) -> str:
    """The decision for ``n`` buckets and ``m`` blocks (a script per shape, see above)."""
    lines = [
        "local t = redis.call('TIME')",
        "local now = t[1] * 1000 + math.floor(t[2] / 1000)",
        f"local v = redis.call('MGET', {', '.join(f'KEYS[{k}]' for k in range(1, n + m + 1))})",
        "local wait, who = 0, 0",
    ]
    for j in range(n + 1, n + m + 1):
        lines.append(f"if v[{j}] and v[{j}] - now > wait then wait, who = v[{j}] - now, {j} end")
    if m:
        lines.append("if wait > 0 then return {wait, who} end")
    if n:
        lines.append(
            "local pack, unpack, min, max = struct.pack, struct.unpack, math.min, math.max"
        )
        lines.append("local pos, per_ms, burst, cost, level, ts = 1")
    for i in range(1, n + 1):
        lines += [
            "per_ms, burst, cost, pos = unpack('<ddd', ARGV[1], pos)",
            f"if v[{i}] then level, ts = unpack('<dd', v[{i}]) else level, ts = burst, now end",
            f"local l{i} = min(burst, level + max(0, now - ts) * per_ms) - cost",
            f"if l{i} < 0 then",
            f"  local need = math.ceil(-l{i} / per_ms)",
            f"  if need > wait then wait, who = need, {i} end",
            "end",
        ]
    if n:
        lines.append("if wait > 0 then return {wait, who} end")
        writes = ", ".join(f"KEYS[{i}], pack('<dd', l{i}, now)" for i in range(1, n + 1))
        lines.append(f"redis.call('MSET', {writes})")
    lines.append("return 0")
    return "\n".join(lines) + "\n"


_READ_LEVEL = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local per_ms, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local level, ts = burst, now
local value = redis.call('GET', KEYS[1])
if value then level, ts = struct.unpack('<dd', value) end
level = math.min(burst, level + math.max(0, now - ts) * per_ms)
"""


# Refund (delta < 0 takes back less) or charge the difference after the real usage is known.
ADJUST = (
    _READ_LEVEL
    + """
redis.call('SET', KEYS[1], struct.pack('<dd', math.min(burst, level - tonumber(ARGV[3])), now))
return 1
"""
)


LEVEL = _READ_LEVEL + "return tostring(level)\n"


# Block a scope until now + ARGV[1] ms on the Redis clock, and count the provider's 429.
BLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
redis.call('SET', KEYS[1], now + ms, 'PX', ms)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('EXPIRE', KEYS[2], 600)
return 1
"""


# Adaptive limits (AIMD): a scope's factor, the share of its configured rate it may use, is
# "<factor>:<ms>" with additive recovery since then; a provider's 429 multiplies it down.
DECREASE = 0.5


FLOOR = 0.1


RECOVERY_PER_MS = 0.1 / 60_000  # a tenth of the configured rate per minute


_READ_FACTOR = f"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local factor = 1
local value = redis.call('GET', KEYS[1])
if value then
  local f, s = string.match(value, '^([^:]+):(.+)$')
  factor = math.min(1, tonumber(f) + (now - tonumber(s)) * {RECOVERY_PER_MS!r})
end
"""


FACTOR = _READ_FACTOR + "return tostring(factor)\n"


# ARGV[1]: a window in ms. A provider rejects every call in flight when its quota trips:
# the 429s that arrive within the window of the last cut are the same overload, cut once.
CUT = (
    _READ_FACTOR
    + f"""
if value then
  local since = now - tonumber(string.match(value, ':(.+)$'))
  if since < tonumber(ARGV[1]) then return tostring(factor) end
end
factor = math.max({FLOOR!r}, factor * {DECREASE!r})
local back_ms = math.ceil((1 - factor) / {RECOVERY_PER_MS!r})
redis.call('SET', KEYS[1], factor .. ':' .. now, 'PX', back_ms + 60000)
return tostring(factor)
"""
)
