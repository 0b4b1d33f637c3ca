"""The server's side of the engine pipe: the supervisor that starts, watches and restarts the engine
process, the tickets of requests in flight, the seats and the memory ledger."""
