"""gRPC servers: llm.v1 (native), fmaas (TGIS), health and reflection over one engine."""
