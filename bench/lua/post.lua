-- wrk script for the benchmark ceilings: POSTs the bodies of BODY_FILE (one per line) in
-- turn; `{SEQ}` in a body becomes KEY_PREFIX-<thread>-<n>, unique in the run, so every
-- tools/call can carry a fresh idempotency key. PERMIT, when set, is sent as the
-- atmost-permit header.
local bodies = {}
for line in io.lines(os.getenv("BODY_FILE")) do
  if #line > 0 then bodies[#bodies + 1] = line end
end
local prefix = os.getenv("KEY_PREFIX") or "w"
local permit = os.getenv("PERMIT")
local threads = 0
local counter = 0

function setup(thread)
  thread:set("tid", tostring(threads))
  threads = threads + 1
end


wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Accept"] = "application/json, text/event-stream"
if permit and #permit > 0 then wrk.headers["atmost-permit"] = permit end

function request()
  counter = counter + 1
  local body = bodies[(counter % #bodies) + 1]
  body = body:gsub("{SEQ}", prefix .. "-" .. (tid or "0") .. "-" .. counter)
  return wrk.format(nil, nil, nil, body)
end
