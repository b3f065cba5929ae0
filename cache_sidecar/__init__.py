"""Cache sidecar: fetch commit-pinned weights, verify every byte, publish atomically, serve readiness."""
