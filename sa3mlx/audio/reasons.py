"""Why an input was quarantined: one code per kind of bad input, with a plain-words meaning."""

from __future__ import annotations

EMPTY_FILE = "empty_file"
TRUNCATED = "truncated"
TEXT_FILE = "text_file"
UNKNOWN_FORMAT = "unknown_format"
CORRUPT_HEADER = "corrupt_header"
NAN_SAMPLES = "nan_samples"
INF_SAMPLES = "inf_samples"
ABSURD_SAMPLE_RATE = "absurd_sample_rate"
ZERO_FRAMES = "zero_frames"
TOO_SHORT = "too_short"
UNSUPPORTED_CONTAINER = "unsupported_container"
UNREADABLE = "unreadable"
DIRECTORY = "directory"
DANGLING_SYMLINK = "dangling_symlink"
VANISHED = "vanished"
NOT_A_FILE = "not_a_file"
NON_UTF8_NAME = "non_utf8_name"
UNEXPECTED_ERROR = "unexpected_error"

MEANING = {
    EMPTY_FILE: "the file has zero bytes",
    TRUNCATED: "the file ends before its header says it should (cut short or damaged)",
    TEXT_FILE: "a text file with an audio extension",
    UNKNOWN_FORMAT: "the bytes match no audio format",
    CORRUPT_HEADER: "starts with a valid audio signature but the rest is not a readable stream",
    NAN_SAMPLES: "the audio contains NaN samples",
    INF_SAMPLES: "the audio contains infinite samples",
    ABSURD_SAMPLE_RATE: "the header's sample rate is implausible",
    ZERO_FRAMES: "a valid header with no audio frames",
    TOO_SHORT: "shorter than one latent after resampling",
    UNSUPPORTED_CONTAINER: "a format or codec that libsndfile cannot decode on this platform",
    UNREADABLE: "no permission to read the file",
    DIRECTORY: "a directory named like an audio file",
    DANGLING_SYMLINK: "a symbolic link whose target does not exist",
    VANISHED: "the file disappeared between listing and reading",
    NOT_A_FILE: "not a regular file (pipe, socket or device)",
    NON_UTF8_NAME: "the path is not valid UTF-8 (DVC cannot hash the folder); rename it",
    UNEXPECTED_ERROR: "an unexpected error while processing the file",
}


class Rejected(Exception):
    """Raised while processing one input: it goes to quarantine with `reason` and `detail`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
