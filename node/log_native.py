"""Native libraries' console lines (xgrammar's C++ warnings), turned into structlog lines.

xgrammar writes its warnings (``[16:14:13] /project/cpp/json_schema_converter.cc:1094: Warning:
multipleOf is not supported for type:number; ignoring multipleOf``) with C++'s ``std::cerr``, straight to
file descriptor 2: past structlog, in neither log format and whatever ``--log-level`` says. It has no
switch for them. :func:`native_stderr_to_log` points descriptor 2 at a temporary file while the calls
that write them run (grammar compiles, the vocabulary's scan, and a matcher's replay of the tokens an
arriving sequence emitted elsewhere, in their threads: never a step's mask),
then writes each such line as a structlog warning (``native_warning``, its ``source`` the C++ file and
line). Anything else written to descriptor 2 meanwhile (another thread's log line, a traceback) is
copied back to it unchanged, once the last capture ends. A child process must not inherit the capture:
the node starts engine and front-end processes inside :func:`stderr_uncaptured`.

Why a file, not a pipe: nothing has to read while the call runs, and a long message cannot fill a pipe's
buffer and block the writer.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from typing import Iterator

import structlog

log = structlog.get_logger("shiftnode.native")

# "[hh:mm:ss] path/file.cc:123: Level: message": how xgrammar (dmlc-style logging) writes a line
_NATIVE_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] (?P<source>\S+:\d+): (?:(?P<level>[A-Za-z]+): )?(?P<message>.*)$")

_lock = threading.Lock()
_idle = threading.Condition(_lock)  # notified when the last capture ends, and when a child has started
_depth = 0  # captures in progress (threads compiling at once share one redirection)
_starting = 0  # child processes being started (stderr_uncaptured): no capture may open meanwhile
_saved_fd: int | None = None  # descriptor 2 as it was
_capture = None  # the temporary file descriptor 2 points at


@contextlib.contextmanager
def native_stderr_to_log(library: str = "xgrammar") -> Iterator[None]:
    """Within the block, native writes to descriptor 2 are captured; at the end of the last block still
    open, native log lines become structlog warnings (``library`` names their origin) and the rest is
    written back to descriptor 2 as it was. Re-entrant and thread-safe (blocks of several threads
    overlap into one capture)."""
    global _depth, _saved_fd, _capture
    with _idle:
        _idle.wait_for(lambda: _starting == 0)
        if _depth == 0:
            sys.stderr.flush()  # Python's buffered lines go out before descriptor 2 moves
            _capture = tempfile.TemporaryFile()
            _saved_fd = os.dup(2)
            os.dup2(_capture.fileno(), 2)
        _depth += 1
    try:
        yield
    finally:
        with _idle:
            _depth -= 1
            if _depth == 0:
                sys.stderr.flush()
                os.dup2(_saved_fd, 2)
                os.close(_saved_fd)
                _saved_fd = None
                _capture.seek(0)
                text = _capture.read().decode("utf-8", "replace")
                _capture.close()
                _capture = None
                _idle.notify_all()
            else:
                text = ""
        if text:
            _replay(text, library)


@contextlib.contextmanager
def stderr_uncaptured() -> Iterator[None]:
    """Within the block no capture is open, nor can one start: a child process started here inherits the
    real descriptor 2, not a capture's temporary file (its log lines would be lost with it). Waits for
    the captures in progress to end (a grammar compile: milliseconds to seconds)."""
    global _starting
    with _idle:
        _idle.wait_for(lambda: _depth == 0)
        _starting += 1
    try:  # the lock is not held here: a forked child would inherit it locked
        yield
    finally:
        with _idle:
            _starting -= 1
            _idle.notify_all()


def _after_fork_in_child() -> None:
    """A forked child starts with no capture and a fresh lock (another thread of the parent may have held it)."""
    global _lock, _idle, _depth, _starting, _saved_fd, _capture
    _lock = threading.Lock()
    _idle = threading.Condition(_lock)
    _depth = _starting = 0
    _saved_fd = _capture = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _replay(text: str, library: str) -> None:
    """Log the native lines of ``text``; write the others back to stderr as they came."""
    other = []
    for line in text.splitlines(keepends=True):
        m = _NATIVE_LINE.match(line.rstrip("\n"))
        if m is None:
            other.append(line)
            continue
        level = (m["level"] or "warning").lower()
        fields = {"library": library, "source": m["source"], "message": m["message"]}
        if level in ("error", "fatal"):
            log.error("native_error", **fields)
        elif level == "info":
            log.info("native_info", **fields)
        else:
            log.warning("native_warning", **fields)
    if other:
        sys.stderr.write("".join(other))
        sys.stderr.flush()
