"""The protocol's error codes and the error a malformed message raises (shared by the wire modules)."""

BRIEF_CHARS = 80  # a value quoted in an error: never the whole of a hostile input


class ErrorCode:
    """Stable error codes carried by :class:`Error` (strings, so logs and clients read them)."""

    BAD_MESSAGE = "bad_message"
    BAD_VERSION = "bad_version"
    BAD_JOB = "bad_job"
    UNKNOWN_DATASET = "unknown_dataset"
    UNKNOWN_CLIENT = "unknown_client"
    NO_CAPACITY = "no_capacity"
    SAMPLE_FAILED = "sample_failed"
    SHUTTING_DOWN = "shutting_down"
    REPLACED = "replaced"  # a newer client took over this (job, rank)
    DATASET_CHANGED = "dataset_changed"  # the dataset is not the one the epoch (or a loaded state) was planned on
    REPLICA_MISMATCH = "replica_mismatch"  # the replicas serve different data: none left serves the loader's
    BAD_RELEASE = "bad_release"  # a co-located client handed back a slot its stream did not hand over
    REVOKED = "revoked"  # the client's CURVE key was removed from the service's keys directory
    INTERNAL = "internal"


class ProtocolError(ValueError):
    """A message that does not follow this protocol. ``code`` is an :class:`ErrorCode`."""

    def __init__(self, message: str, code: str = ErrorCode.BAD_MESSAGE):
        super().__init__(message)
        self.code = code


def brief(value: object, limit: int = BRIEF_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error names what it refused without
    echoing a large input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
