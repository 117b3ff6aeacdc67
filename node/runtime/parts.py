"""An object made of parts keeps its old attribute names: each is a property that reads (and, where
allowed, writes) the part that owns the state (:class:`node.runtime.engine.DeviceEngine`'s roles and
moves), so callers elsewhere need not know which part holds what."""

from __future__ import annotations


def part(owner: str, name: str, settable: bool = False) -> property:
    """A property that is ``getattr(self.<owner>, name)`` (a method comes bound to the part); read-only
    unless ``settable``."""
    def get(obj):
        return getattr(getattr(obj, owner), name)

    def put(obj, value):
        setattr(getattr(obj, owner), name, value)

    return property(get, put if settable else None, doc=f"the ``{owner}`` part's ``{name}``")
