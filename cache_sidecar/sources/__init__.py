"""Weight sources behind one interface (`Source`); the Hugging Face-compatible mirror first."""

from cache_sidecar.sources.base import HttpTarget, RemoteFile, Source

__all__ = ["HttpTarget", "RemoteFile", "Source"]
