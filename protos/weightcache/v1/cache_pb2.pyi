from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    PENDING: _ClassVar[State]
    FETCHING: _ClassVar[State]
    VERIFYING: _ClassVar[State]
    READY: _ClassVar[State]
    FAILED: _ClassVar[State]
    EVICTED: _ClassVar[State]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    MIRROR_UNREACHABLE: _ClassVar[ErrorCode]
    REVISION_NOT_FOUND: _ClassVar[ErrorCode]
    CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    DISK_FULL: _ClassVar[ErrorCode]
    UNSAFE_REPOSITORY: _ClassVar[ErrorCode]
    INVALID_CHECKPOINT: _ClassVar[ErrorCode]
    OFFLINE: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    BRANCH_NOT_ALLOWED: _ClassVar[ErrorCode]
STATE_UNSPECIFIED: State
PENDING: State
FETCHING: State
VERIFYING: State
READY: State
FAILED: State
EVICTED: State
ERROR_CODE_UNSPECIFIED: ErrorCode
MIRROR_UNREACHABLE: ErrorCode
REVISION_NOT_FOUND: ErrorCode
CHECKSUM_MISMATCH: ErrorCode
DISK_FULL: ErrorCode
UNSAFE_REPOSITORY: ErrorCode
INVALID_CHECKPOINT: ErrorCode
OFFLINE: ErrorCode
INTERNAL: ErrorCode
BRANCH_NOT_ALLOWED: ErrorCode

class ModelRef(_message.Message):
    __slots__ = ("repo", "revision", "allow_branch")
    REPO_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ALLOW_BRANCH_FIELD_NUMBER: _ClassVar[int]
    repo: str
    revision: str
    allow_branch: bool
    def __init__(self, repo: _Optional[str] = ..., revision: _Optional[str] = ..., allow_branch: _Optional[bool] = ...) -> None: ...

class FileProgress(_message.Message):
    __slots__ = ("path", "size", "bytes_done", "sha256", "done")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    bytes_done: int
    sha256: str
    done: bool
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., bytes_done: _Optional[int] = ..., sha256: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class RevisionStatus(_message.Message):
    __slots__ = ("repo", "revision", "commit", "state", "bytes_done", "bytes_total", "files_done", "files_total", "local_path", "manifest_digest", "error_code", "error_message", "pinned", "leases", "size_bytes", "last_used_unix", "files")
    REPO_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FILES_DONE_FIELD_NUMBER: _ClassVar[int]
    FILES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    repo: str
    revision: str
    commit: str
    state: State
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    local_path: str
    manifest_digest: str
    error_code: ErrorCode
    error_message: str
    pinned: bool
    leases: int
    size_bytes: int
    last_used_unix: float
    files: _containers.RepeatedCompositeFieldContainer[FileProgress]
    def __init__(self, repo: _Optional[str] = ..., revision: _Optional[str] = ..., commit: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., files_done: _Optional[int] = ..., files_total: _Optional[int] = ..., local_path: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., error_code: _Optional[_Union[ErrorCode, str]] = ..., error_message: _Optional[str] = ..., pinned: _Optional[bool] = ..., leases: _Optional[int] = ..., size_bytes: _Optional[int] = ..., last_used_unix: _Optional[float] = ..., files: _Optional[_Iterable[_Union[FileProgress, _Mapping]]] = ...) -> None: ...

class EnsureRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("revisions", "used_bytes", "budget_bytes")
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    revisions: _containers.RepeatedCompositeFieldContainer[RevisionStatus]
    used_bytes: int
    budget_bytes: int
    def __init__(self, revisions: _Optional[_Iterable[_Union[RevisionStatus, _Mapping]]] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("model", "lease_holder")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    lease_holder: str
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ..., lease_holder: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("model", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: ModelRef
    force: bool
    def __init__(self, model: _Optional[_Union[ModelRef, _Mapping]] = ..., force: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "freed_bytes", "message")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    freed_bytes: int
    message: str
    def __init__(self, evicted: _Optional[bool] = ..., freed_bytes: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
