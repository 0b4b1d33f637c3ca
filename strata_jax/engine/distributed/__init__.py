"""One model over several devices or hosts: expert shards, pipeline stages and micro-batches, and
the process group (the channel, the hosts, the lockstep of a leader and its followers)."""
