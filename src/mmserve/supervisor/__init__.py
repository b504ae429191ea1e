"""One supervisor for child processes and Ray actors: encoder workers (workers/) and replicas (cluster/) alike.

Role: what every owner of children shares — `ChildSlot` (the one slot type: a child's generation,
handle, queues, reader, readiness and restart history), `RestartPolicy` (the one restart policy:
back-off, window, give-up), `OutboxReader` (the one reader thread of a child's outbox),
`ProcessLauncher` (children started by spawn, their messages through pipes) and `init_ray` (Ray
joined, reused or started, for actors).
What it does not know: what the children run, what their messages mean, requests, engines, routing;
it imports nothing of engine/, runner/, entrypoints/, cluster/ or workers/.
"""
