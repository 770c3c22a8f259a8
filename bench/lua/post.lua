-- wrk script for the benchmark ceilings: POSTs the bodies of BODY_FILE (one per line) in
-- turn; `{SEQ}` in a body becomes KEY_PREFIX-<thread>-<n>, unique in the run, so every
-- tools/call can carry a fresh idempotency key. PERMIT, when set, is sent as the
-- atmost-permit header; PERMIT_FILE (one token a line) instead sends request n under token
-- n mod the number of tokens, so each permit gets the same share, as that many agents would.
local bodies = {}
for line in io.lines(os.getenv("BODY_FILE")) do
  if #line > 0 then bodies[#bodies + 1] = line end
end
local permits = {}
local permit_file = os.getenv("PERMIT_FILE")
if permit_file and #permit_file > 0 then
  for line in io.lines(permit_file) do
    if #line > 0 then permits[#permits + 1] = line end
  end
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
  if #permits > 0 then
    wrk.headers["atmost-permit"] = permits[(counter % #permits) + 1]
  end
  return wrk.format(nil, nil, nil, body)
end
