"""Typed sidecar errors: each carries the wire ErrorCode and a message that tells the operator what to do."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mirrors `weightcache.v1.ErrorCode` value for value (checked by a test)."""

    ERROR_CODE_UNSPECIFIED = 0
    MIRROR_UNREACHABLE = 1
    REVISION_NOT_FOUND = 2
    CHECKSUM_MISMATCH = 3
    DISK_FULL = 4
    UNSAFE_REPOSITORY = 5
    INVALID_CHECKPOINT = 6
    OFFLINE = 7
    INTERNAL = 8
    BRANCH_NOT_ALLOWED = 9


class SidecarError(Exception):
    """Base of every error the sidecar reports; `code` goes on the wire, `retryable` drives backoff."""

    code: ErrorCode = ErrorCode.INTERNAL
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidReference(SidecarError, ValueError):
    code = ErrorCode.REVISION_NOT_FOUND


class BranchNotAllowed(SidecarError):
    code = ErrorCode.BRANCH_NOT_ALLOWED


class MirrorUnreachable(SidecarError):
    code = ErrorCode.MIRROR_UNREACHABLE
    retryable = True


class TransientTransferError(MirrorUnreachable):
    """A reset, a 5xx, a stall or a short body: worth retrying from the bytes already on disk."""


class RevisionNotFound(SidecarError):
    code = ErrorCode.REVISION_NOT_FOUND


class ChecksumMismatch(SidecarError):
    code = ErrorCode.CHECKSUM_MISMATCH


class DiskFull(SidecarError):
    code = ErrorCode.DISK_FULL


class UnsafeRepository(SidecarError):
    code = ErrorCode.UNSAFE_REPOSITORY


class InvalidCheckpoint(SidecarError):
    code = ErrorCode.INVALID_CHECKPOINT


class OfflineMiss(SidecarError):
    code = ErrorCode.OFFLINE


class LockUnsupported(SidecarError):
    """The cache volume's file locks do not exclude (some network filesystems): sharing it is unsafe."""

    code = ErrorCode.INTERNAL


class Cancelled(SidecarError):
    code = ErrorCode.INTERNAL
