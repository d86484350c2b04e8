"""The journal's Redis scripts (app.server.journal): each runs atomically in Redis, so
that what must hold together does.

ACCEPT appends a turn: its record, its stream entry, and the entry's delivery to this
process, in one step; entries that are not ours and were never delivered (anything else
XADDed to the stream) are acknowledged and counted on the way, so the entry delivered is
always the one just added. It carries a deadline on Redis's own clock: a call that reaches
Redis after its caller gave up (Redis stalled with the call in its socket buffer) does
nothing, instead of creating a turn nobody runs.

WRITE appends to a turn's record only while its entry is still pending under this
process: once another process claimed it (this one stalled past `claim_after_s`), this
one's writes and its end are refused, so a turn is never written, acknowledged or ended by
two processes. A write retried after a timeout is told whether it had landed. It also
checks that the record is as long as this process left it: a Redis
that lost writes (restarted from an older snapshot) gets no frame after a gap.

SETTLE clears up after an accept whose answer was lost (it ran in time, its reply did not
come back): the entry is found by the nonce it carries, acknowledged and deleted, and its
record deleted.

ABANDON ends a turn without its record (it lost a write and ran on without durability, or
it never showed a frame): acknowledged and its record deleted, only while the entry is
still ours and the record still that accept's.

HEARTBEAT refreshes the idle time of this process's entries that are still its own and
names those another process holds now (taken over). An entry pending under nobody is
neither: it was acknowledged, perhaps by this process's own end whose answer is still on
its way, so not seeing it is no sign of a take-over (WRITE's fence catches a turn another
process took and ended). TRIM drops acknowledged entries past the bound.
"""

ACCEPT = """
-- KEYS: stream, record. ARGV: group, consumer, header, version, nonce, deadline (ms, Redis
-- clock; '' for none). Returns {entry id, entries skipped}, or false when too late.
if ARGV[6] ~= '' then
  local t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[6]) then
    return false
  end
end
redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '$', 'MKSTREAM')  -- Redis lost it
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[3])
local id = redis.call('XADD', KEYS[1], '*', 'rec', KEYS[2], 'v', ARGV[4], 'n', ARGV[5])
local skipped = 0
while true do
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 100,
                           'STREAMS', KEYS[1], '>')
  if not reply then return redis.error_reply('journal entry ' .. id .. ' went missing') end
  for _, entry in ipairs(reply[1][2]) do
    if entry[1] == id then return {id, skipped} end
    redis.call('XACK', KEYS[1], ARGV[1], entry[1])
    skipped = skipped + 1
  end
end
"""

WRITE = """
-- KEYS: stream, record. ARGV: group, consumer, entry id, the record's length as this
-- process left it, ttl (s; 0 while the turn runs), items to append. With a ttl the turn
-- ends: acknowledged, its record left to expire. Returns 1; 2 when these very items are
-- already the record's last (this write is a retry of one whose answer was lost); 0 when
-- the entry is no longer ours; -1 when the record is not as this process left it (Redis
-- lost writes). Nothing is written but for 1.
local n = #ARGV - 5
local len = redis.call('LLEN', KEYS[2])
if n > 0 and len == tonumber(ARGV[4]) + n then
  local tail = redis.call('LRANGE', KEYS[2], -n, -1)
  local same = true
  for i = 1, n do if tail[i] ~= ARGV[5 + i] then same = false end end
  if same then return 2 end
end
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
if len ~= tonumber(ARGV[4]) then return -1 end
for i = 6, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
if tonumber(ARGV[5]) > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
end
return 1
"""

SETTLE = """
-- KEYS: stream, record. ARGV: group, consumer, nonce. Returns 1 when an entry was found.
local found = 0
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 10000, ARGV[2])
for _, p in ipairs(pending) do
  local entry = redis.call('XRANGE', KEYS[1], p[1], p[1])
  local fields = entry[1] and entry[1][2] or {}
  for i = 1, #fields, 2 do
    if fields[i] == 'n' and fields[i + 1] == ARGV[3] then
      redis.call('XACK', KEYS[1], ARGV[1], p[1])
      redis.call('XDEL', KEYS[1], p[1])
      found = 1
    end
  end
end
local head = redis.call('LINDEX', KEYS[2], 0)
if head then
  local ok, header = pcall(cjson.decode, head)
  if ok and type(header) == 'table' and header['n'] == ARGV[3] then
    redis.call('DEL', KEYS[2])
  end
end
return found
"""

HEARTBEAT = """
-- KEYS: stream. ARGV: group, consumer, entry ids. Returns {ids still ours, ids another
-- consumer holds}.
local kept, taken = {}, {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept[#kept + 1] = ARGV[i]
  elseif #p > 0 then
    taken[#taken + 1] = ARGV[i]
  end
end
return {kept, taken}
"""

TRIM = """
-- KEYS: stream. ARGV: group, bound. Past the bound, drop acknowledged entries: all older
-- than the oldest pending one.
if redis.call('XLEN', KEYS[1]) <= tonumber(ARGV[2]) then return 0 end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
if pending[1] > 0 then return redis.call('XTRIM', KEYS[1], 'MINID', pending[2]) end
return redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)
"""

ABANDON = """
-- KEYS: stream, record. ARGV: group, consumer, entry id, nonce, the record's length as
-- this process left it ('' for any). A turn ends without its record: acknowledged while the
-- entry is still ours, and the record deleted if it is still this accept's (a later accept
-- of the same turn id rewrites it) and, given a length, no longer than that. Returns 1 or 0.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
local head = redis.call('LINDEX', KEYS[2], 0)
if head and (ARGV[5] == '' or redis.call('LLEN', KEYS[2]) <= tonumber(ARGV[5])) then
  local ok, header = pcall(cjson.decode, head)
  if ok and type(header) == 'table' and (ARGV[4] == '' or header['n'] == ARGV[4]) then
    redis.call('DEL', KEYS[2])
  end
end
return 1
"""

ALL = (ACCEPT, WRITE, SETTLE, ABANDON, HEARTBEAT, TRIM)
