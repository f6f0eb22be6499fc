"""``justapi bench``: workloads, a streaming client for any OpenAI-compatible server, reports, sweeps, offline runs."""
